"""kernels.topk: the threshold select returns exactly lax.top_k's values, indices, order and ties (CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dijax  # noqa: F401  (sets XLA flags before JAX starts)
from dijax.kernels import topk as topk_mod
from dijax.kernels import topk as topk_module
from dijax.kernels.topk import topk, topk_reference, topk_select
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
    monkeypatch.setattr(topk_mod, "PREFILTER_MIN_VALUES", 0)
    return jax.jit(topk_select, static_argnums=1)


def test_long_rows_take_the_chunk_prefilter(prefilter_small_arrays):
    width, k = 4 * 8 * topk_mod.CHUNK + 17, 8  # above the prefilter bound, with a ragged last chunk
    assert width >= topk_mod.PREFILTER_FACTOR * k * topk_mod.CHUNK
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
    for threshold in (0, topk_module.SELECT_MIN_VALUES):  # the select path, then the short-row hand-off
        monkeypatch.setattr(topk_module, "SELECT_MIN_VALUES", threshold)
        for impl in ("reference", "select", "pallas"):
            v, i = topk(x, 9, impl=impl)
            np.testing.assert_array_equal(np.asarray(i), np.asarray(jax.lax.top_k(x, 9)[1]))
    with pytest.raises(ValueError, match="impl must be one of"):
        topk(x, 9, impl="sort")


def test_attention_call_sites_identical_for_every_impl(monkeypatch):
    # force the select and Pallas paths at these short widths (the dispatcher hands rows shorter than
    # SELECT_MIN_VALUES to lax.top_k)
    monkeypatch.setattr(topk_module, "SELECT_MIN_VALUES", 0)
    # the indexer's masked scores: bf16 ties, -inf beyond each query's visible prefix, ragged limits
    t, width, k = 6, 700, 16
    score = scores("bf16", t, width, seed=5)
    score = np.round(score * 4) / 4
    visible = np.array([0, 1, 15, 16, 300, 700], np.int32)
    score = np.where(np.arange(width)[None, :] < visible[:, None], score, -np.inf).astype(np.float32)
    limit = np.minimum(k, np.array([0, 1, 7, 16, 16, 16], np.int32))
    s, vis, lim = jnp.asarray(score), jnp.asarray(visible), jnp.asarray(limit)
    impls = ("reference", "select", "pallas")
    pos = {impl: np.asarray(topk_positions(s, vis, lim, k, impl=impl)) for impl in impls}
    np.testing.assert_array_equal(pos["select"], pos["reference"])
    np.testing.assert_array_equal(pos["pallas"], pos["reference"])
    assert (pos["select"][0] == -1).all() and (pos["select"][2][7:] == -1).all()
    cand = {impl: np.asarray(select_candidate_blocks(s, vis, 5, 8, impl=impl)) for impl in impls}
    np.testing.assert_array_equal(cand["select"], cand["reference"])
    np.testing.assert_array_equal(cand["pallas"], cand["reference"])
    # a width below k pads with -inf: every impl still agrees
    short = {impl: np.asarray(topk_positions(s[:, :10], jnp.minimum(vis, 10), lim, k, impl=impl)) for impl in impls}
    np.testing.assert_array_equal(short["select"], short["reference"])
    np.testing.assert_array_equal(short["pallas"], short["reference"])
