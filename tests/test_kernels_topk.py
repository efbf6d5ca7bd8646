"""kernels.topk: the threshold select returns exactly lax.top_k's values, indices, order and ties (CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dijax  # noqa: F401  (sets XLA flags before JAX starts)
from dijax.kernels import topk as topk_module
from dijax.kernels.topk import topk_ascending, topk_reference, topk_select
from dijax.model.attention import select_candidate_blocks, topk_positions

select_jit = jax.jit(topk_select, static_argnums=1)


def assert_same(score: np.ndarray, k: int) -> None:
    want_v, want_i = topk_reference(jnp.asarray(score), k)
    got_v, got_i = select_jit(jnp.asarray(score), k)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    # compare bit patterns so that NaN, -0.0 and +0.0 must match too
    np.testing.assert_array_equal(np.asarray(got_v).view(np.uint32), np.asarray(want_v).view(np.uint32))


def scores(kind: str, rows: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    if kind == "ties":  # few distinct values: many ties at the k-th value
        x = np.round(x * 2) / 2
    elif kind == "equal":  # every row one value (the first all zeros): the lowest positions win
        x = np.broadcast_to(np.round(x[:, :1] * 4) / 4 * (np.arange(rows) > 0)[:, None], x.shape).copy()
    elif kind == "masked":  # most positions -inf, some rows entirely
        x[rng.random((rows, width)) < 0.9] = -np.inf
        x[0] = -np.inf
    elif kind == "nan":  # NaN of both signs (and a payload) among values
        pick = rng.random((rows, width)) < 0.05
        x[pick] = rng.choice(np.array([0x7FC00000, 0xFFC00000, 0x7FC01234], np.uint32).view(np.float32),
                             int(pick.sum()))
    elif kind == "zeros":  # -0.0 against +0.0 around the k-th value
        x = rng.choice(np.array([0.0, -0.0, 1.0, -1.0], np.float32), (rows, width))
    elif kind == "special":
        x = rng.choice(np.array([0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 1.0, -1.0], np.float32),
                       (rows, width))
    elif kind == "bf16":  # the indexer's scores: bf16 values widened to float32
        x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    return x


@pytest.mark.parametrize("kind", ["random", "ties", "equal", "masked", "nan", "zeros", "special", "bf16"])
@pytest.mark.parametrize("width,k", [(100, 7), (37, 37), (300, 1), (1024, 8), (5000, 16)])
def test_select_matches_lax_top_k(kind, width, k):
    assert_same(scores(kind, 4, width, seed=width * 31 + k), k)


@pytest.fixture
def prefilter_small_arrays(monkeypatch):
    """Let small arrays take the chunk prefilter (it is kept for large ones), with a fresh jit of the select."""
    monkeypatch.setattr(topk_module, "PREFILTER_MIN_VALUES", 0)
    return jax.jit(topk_select, static_argnums=1)


def test_long_rows_take_the_chunk_prefilter(prefilter_small_arrays):
    width, k = 4 * 8 * topk_module.CHUNK + 17, 8  # above the prefilter bound, with a ragged last chunk
    assert width >= topk_module.PREFILTER_FACTOR * k * topk_module.CHUNK
    for seed, kind in enumerate(["random", "ties", "masked", "special"]):
        x = jnp.asarray(scores(kind, 3, width, seed))
        want_v, want_i = topk_reference(x, k)
        got_v, got_i = prefilter_small_arrays(x, k)
        np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
        np.testing.assert_array_equal(np.asarray(got_v).view(np.uint32), np.asarray(want_v).view(np.uint32))


def test_ties_spread_over_chunks_go_to_the_lowest_positions(prefilter_small_arrays):
    # every chunk's maximum is the tied threshold: only the earliest positions may be taken
    width, k = 4096, 8
    x = np.full((2, width), 0.5, np.float32)
    x[0, 3000] = 2.0  # one value above the threshold, late in the row
    x[1, ::97] = 0.75
    _, idx = prefilter_small_arrays(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(jax.lax.top_k(jnp.asarray(x), k)[1]))
    np.testing.assert_array_equal(np.asarray(idx)[0], [3000, 0, 1, 2, 3, 4, 5, 6])


def test_leading_axes_and_bf16_input():
    x = scores("ties", 6, 200, seed=3).reshape(2, 3, 200)
    assert_same(x, 5)
    xb = jnp.asarray(x, jnp.bfloat16)
    want = topk_reference(xb, 5)
    got = select_jit(xb, 5)
    assert got[0].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_k_zero_and_k_out_of_range():
    v, i = topk_select(jnp.zeros((3, 10)), 0)
    assert v.shape == (3, 0) and i.shape == (3, 0)
    with pytest.raises(ValueError, match="k must be in"):
        topk_select(jnp.zeros((3, 10)), 11)
    with pytest.raises(TypeError, match="float"):
        topk_select(jnp.zeros((3, 10), jnp.int32), 2)


def test_dispatcher(monkeypatch):
    x = jnp.asarray(scores("ties", 2, 64, seed=1))
    want = np.sort(np.asarray(jax.lax.top_k(x, 9)[1]), axis=-1)
    for threshold in (0, topk_module.SELECT_MIN_VALUES):  # the select path, then the short-row hand-off
        monkeypatch.setattr(topk_module, "SELECT_MIN_VALUES", threshold)
        for impl in ("reference", "select", "pallas"):
            np.testing.assert_array_equal(np.asarray(topk_ascending(x, 9, impl=impl)), want)
    with pytest.raises(ValueError, match="impl must be one of"):
        topk_ascending(x, 9, impl="sort")


def _positions_oracle(score: np.ndarray, visible: np.ndarray, limit: np.ndarray, k: int) -> np.ndarray:
    """The reference's rule, in numpy: rank each row by value (descending, ties to the lower position; the row
    padded with -inf to k), keep ranks below ``limit`` at visible positions, ascending, -1 padded."""
    rows, width = score.shape
    padded = np.pad(score, ((0, 0), (0, max(0, k - width))), constant_values=-np.inf)
    out = np.full((rows, k), -1, np.int32)
    for r in range(rows):
        picks = np.argsort(-padded[r], kind="stable")[:k]
        kept = np.sort([p for rank, p in enumerate(picks) if p < visible[r] and rank < limit[r]])
        out[r, :len(kept)] = kept
    return out


@pytest.mark.parametrize("width", [700, 16, 10])
def test_attention_call_sites_identical_for_every_impl(monkeypatch, width):
    """``topk_positions`` (visible positions of the top-k set, no rank limit) is the reference's rank-limited rule
    for every limit the model gives (``min(k, end // ratio)`` with end past every query: at least
    ``min(k, visible)``), with -inf at visible positions too (the candidate mask) and rows shorter than k."""
    # force the select and Pallas paths at these short widths (the dispatcher hands rows shorter than
    # SELECT_MIN_VALUES to lax.top_k)
    monkeypatch.setattr(topk_module, "SELECT_MIN_VALUES", 0)
    t, k = 7, 16
    score = np.round(scores("bf16", t, width, seed=5) * 4) / 4  # ties
    visible = np.minimum(np.array([0, 1, 15, 16, 300, 700, 40], np.int32), width)
    score[6, : min(width, 30)] = -np.inf  # a candidate mask: visible positions excluded
    score = np.where(np.arange(width)[None, :] < visible[:, None], score, -np.inf).astype(np.float32)
    s, vis = jnp.asarray(score), jnp.asarray(visible)
    impls = ("reference", "select", "pallas")
    pos = {impl: np.asarray(jax.jit(topk_positions, static_argnums=2, static_argnames="impl")(s, vis, k, impl=impl))
           for impl in impls}
    for end in (visible, visible + 3, np.full(t, 10_000)):  # the sequence's end: at or past each query's visible
        np.testing.assert_array_equal(pos["reference"], _positions_oracle(score, visible, np.minimum(k, end), k))
    np.testing.assert_array_equal(pos["select"], pos["reference"])
    np.testing.assert_array_equal(pos["pallas"], pos["reference"])
    assert (pos["reference"][0] == -1).all()
    cand = {impl: np.asarray(select_candidate_blocks(s, vis, 5, 8, impl=impl)) for impl in impls}
    np.testing.assert_array_equal(cand["select"], cand["reference"])
    np.testing.assert_array_equal(cand["pallas"], cand["reference"])


@pytest.mark.parametrize("kind", ["ties", "masked", "special", "bf16"])
@pytest.mark.parametrize("width,k", [(300, 7), (37, 37), (1000, 64), (50, 1)])
def test_topk_ascending_is_the_sorted_top_k_set(monkeypatch, kind, width, k):
    """Every impl's ``topk_ascending`` is lax.top_k's indices sorted (ties, NaN and -inf included), the select
    without its final sort; k = P takes every index."""
    monkeypatch.setattr(topk_module, "SELECT_MIN_VALUES", 0)
    x = jnp.asarray(scores(kind, 3, width, seed=width + k))
    want = np.sort(np.asarray(jax.lax.top_k(x, k)[1]), axis=-1)
    for impl in ("reference", "select", "pallas"):
        np.testing.assert_array_equal(np.asarray(topk_ascending(x, k, impl=impl)), want)
    np.testing.assert_array_equal(np.asarray(topk_module.topk_select_ascending(x, k)), want)


@pytest.mark.parametrize("digits_major", [False, True])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_largest_reaching_counts_and_weights(digits_major, bits):
    """The radix descent in both layouts and every digit width against numpy: the largest key whose keys at or above it
    reach the target, by count (the k-th largest, ties included) and by weight; 0 when the row falls short."""
    rng = np.random.default_rng(bits)
    score = rng.normal(size=(6, 300)).astype(np.float32)
    score[0, :50] = score[0, 50]  # ties
    key = np.asarray(topk_module.order_key(jnp.asarray(score)))
    weight = rng.uniform(0, 1, (6, 300)).astype(np.float32)
    count_target = np.array([1, 7, 50, 300, 301, 120], np.int32)
    mass_target = np.array([0.5, 10.0, 149.0, 1e-3, 1e9, 75.0], np.float32)
    descent = {"bits": bits, "digits_major": digits_major}
    got_count = np.asarray(topk_module.largest_reaching(jnp.asarray(key), jnp.asarray(count_target), **descent))
    got_mass = np.asarray(topk_module.largest_reaching(jnp.asarray(key), jnp.asarray(mass_target),
                                                       jnp.asarray(weight), **descent))
    for r in range(6):
        keys = np.unique(key[r])
        reach_count = [(key[r] >= t).sum() for t in keys]
        reach_mass = [weight[r][key[r] >= t].astype(np.float64).sum() for t in keys]
        want_count = max([t for t, c in zip(keys, reach_count) if c >= count_target[r]], default=0)
        want_mass = max([t for t, m in zip(keys, reach_mass) if m >= mass_target[r]], default=0)
        assert got_count[r] == want_count, (r, "count")
        assert got_mass[r] == want_mass, (r, "mass")
    with pytest.raises(ValueError, match="bits must be 1, 2, 4 or 8, got 3"):
        topk_module.largest_reaching(jnp.asarray(key), 1, bits=3)
