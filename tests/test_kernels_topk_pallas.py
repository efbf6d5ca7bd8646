"""kernels.topk: the Pallas kernel (interpret mode on CPU) returns exactly lax.top_k's values, indices, order and
ties, lowers to Triton for an H200, and gives the model step the reference's selections."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dijax  # noqa: F401  (sets XLA flags before JAX starts)
from dijax.kernels import topk as topk_module
from dijax.kernels.topk import (TopkConfig, chunk_length, topk_ascending, topk_pallas, topk_pallas_ascending,
                                topk_pallas_supports, topk_reference)
from dijax.model.step import CacheSpec, SeqChunk, build_step, init_cache
from dijax.model.transformer import forward_step
from tests.test_kernels_topk import scores

pytestmark = pytest.mark.cost(60)  # CI seconds, a scheduling hint (tests/conftest.py)

pallas_jit = jax.jit(topk_pallas, static_argnames=("k", "config"))


def assert_same(score, k: int, config: TopkConfig | None = None) -> None:
    """The kernel's values (bit patterns: NaN, -0.0 and +0.0 must match too) and indices equal lax.top_k's."""
    want_v, want_i = topk_reference(jnp.asarray(score), k)
    got_v, got_i = pallas_jit(jnp.asarray(score), k=k, config=config)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(got_v).view(np.uint16 if got_v.dtype.itemsize == 2 else np.uint32),
                                  np.asarray(want_v).view(np.uint16 if want_v.dtype.itemsize == 2 else np.uint32))


KINDS = ["random", "ties", "equal", "masked", "nan", "zeros", "special", "bf16"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,width,k", [(4, 100, 7), (3, 37, 37), (2, 300, 1), (5, 5000, 16), (3, 3001, 64)])
def test_matches_lax_top_k(kind, rows, width, k):
    assert_same(scores(kind, rows, width, seed=width * 31 + k), k)


@pytest.mark.parametrize("kind", ["ties", "masked", "special"])
@pytest.mark.parametrize("rows,width,k", [(4, 100, 7), (3, 37, 37), (3, 3001, 64)])
def test_ascending_is_the_sorted_top_k_set(kind, rows, width, k):
    """Without the ranking stage the kernel returns lax.top_k's indices in ascending order."""
    x = jnp.asarray(scores(kind, rows, width, seed=width + k))
    got = jax.jit(topk_pallas_ascending, static_argnames="k")(x, k=k)
    np.testing.assert_array_equal(np.asarray(got), np.sort(np.asarray(jax.lax.top_k(x, k)[1]), axis=-1))


@pytest.mark.parametrize("chunk", [1, 2, 64])
def test_every_chunk_length(chunk):
    """The prefilter's chunk length changes the candidates, never the result; ragged last chunks included."""
    config = TopkConfig(chunk=chunk, max_lanes=1 << 16)
    for seed, kind in enumerate(["ties", "masked", "special"]):
        assert_same(scores(kind, 3, 1000 + 7 * chunk, seed), 24, config)


def test_ties_spread_over_chunks_go_to_the_lowest_positions():
    # every chunk's maximum is the tied threshold: only the earliest positions may be taken
    width, k = 4096, 8
    x = np.full((2, width), 0.5, np.float32)
    x[0, 3000] = 2.0  # one value above the threshold, late in the row
    x[1, ::97] = 0.75
    for chunk in (None, 32):
        assert_same(x, k, TopkConfig(chunk=chunk))
    np.testing.assert_array_equal(np.asarray(pallas_jit(jnp.asarray(x), k=k)[1])[0], [3000, 0, 1, 2, 3, 4, 5, 6])


def test_small_rank_tiles_and_lanes():
    """The rank order in tiles of 4 picks; lanes so few that one chunk length fits: 2000 / 16 maxima, 8 x 16
    candidates."""
    assert_same(scores("ties", 3, 2000, seed=1), 40, TopkConfig(rank_tile=4))
    config = TopkConfig(max_lanes=128)
    assert chunk_length(2000, 8, config) == 16 and chunk_length(2000, 9, config) is None
    assert_same(scores("bf16", 3, 2000, seed=2), 8, config)


def test_leading_axes_and_half_inputs():
    x = scores("special", 6, 200, seed=3).reshape(2, 3, 200)
    assert_same(x, 5)
    for dtype in (jnp.bfloat16, jnp.float16):
        got_v, _ = pallas_jit(jnp.asarray(x, dtype), k=5)
        assert got_v.dtype == dtype and got_v.shape == (2, 3, 5)
        assert_same(jnp.asarray(x, dtype), 5)


def test_empty_and_bad_arguments():
    v, i = topk_pallas(jnp.zeros((3, 10)), 0)
    assert v.shape == (3, 0) and i.shape == (3, 0)
    assert topk_pallas(jnp.zeros((0, 10)), 2)[1].shape == (0, 2)
    with pytest.raises(ValueError, match="k must be in"):
        topk_pallas(jnp.zeros((3, 10)), 11)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        topk_pallas(jnp.zeros((3, 10), jnp.int32), 2)
    with pytest.raises(ValueError, match="config.max_lanes=64"):
        topk_pallas(jnp.zeros((3, 10_000)), 8, config=TopkConfig(max_lanes=64))
    for field in ("chunk", "rank_tile", "block_values"):
        with pytest.raises(ValueError, match=f"config.{field}=3 must be a power of two"):
            topk_pallas(jnp.zeros((3, 10)), 2, config=TopkConfig(**{field: 3}))
    # V4.1-Flash's longest rows (262,144 compressed positions, k = 512) fit; four times as many do not
    assert chunk_length(262_144, 512, TopkConfig()) == 16
    assert topk_pallas_supports((64, 262_144), 512) and not topk_pallas_supports((64, 1 << 20), 512)
    assert not topk_pallas_supports((3, 10), 0)
    # a prefill of 8192 tokens over such rows would need offsets past 2^31: the dispatcher takes the select
    assert not topk_pallas_supports((8192, 262_144), 512)


def test_dispatcher_takes_the_kernel_for_any_row_it_supports(monkeypatch):
    calls = []
    monkeypatch.setattr(topk_module, "topk_pallas_ascending",
                        lambda s, k: calls.append(s.shape) or topk_pallas_ascending(s, k))
    x = jnp.asarray(scores("ties", 2, 3000, seed=1))
    want = np.sort(np.asarray(jax.lax.top_k(x, 9)[1]), axis=-1)
    np.testing.assert_array_equal(np.asarray(topk_ascending(x, 9, impl="pallas")), want)
    assert calls == [(2, 3000)]  # shorter than SELECT_MIN_VALUES, and still the kernel
    topk_ascending(x[:, :9], 9, impl="pallas")
    assert calls == [(2, 3000)]  # k = P: every index, no kernel
    monkeypatch.setattr(topk_module, "topk_pallas_supports", lambda shape, k: False)
    np.testing.assert_array_equal(np.asarray(topk_ascending(x, 9, impl="pallas")), want)
    assert calls == [(2, 3000)]  # an unsupported shape takes the select (long rows) or lax.top_k (short ones)


@pytest.mark.parametrize("rows,width,k,dtype", [(64, 262_144, 512, jnp.float32), (1, 262_144, 512, jnp.float32),
                                                (4, 100_003, 512, jnp.float32), (3, 100, 7, jnp.float32),
                                                (2, 3000, 64, jnp.bfloat16)])
def test_lowers_to_triton_without_a_gpu(lower_for_cuda, rows, width, k, dtype):
    """Both kernels lower to Triton IR (conftest ``lower_for_cuda``) at V4.1-Flash's sizes and ragged ones."""
    arg = jax.ShapeDtypeStruct((rows, width), dtype)
    text = lower_for_cuda(lambda s: topk_pallas(s, k, interpret=False), arg)
    assert "topk_chunk_max" in text and "topk_select" in text
    text = lower_for_cuda(lambda s: topk_pallas_ascending(s, k, interpret=False), arg)
    assert "topk_chunk_max" in text and "topk_select_ascending" in text


def test_model_step_selects_the_reference_positions(tiny_nodrop, monkeypatch):
    """One tiny-nodrop prefill step (index_topk 4) with ``topk_impl='pallas'`` (interpret mode) publishes the same
    index-source selections and the same logits as the reference."""
    shapes = []
    monkeypatch.setattr(topk_module, "topk_pallas_ascending",
                        lambda s, k: shapes.append(s.shape) or topk_pallas_ascending(s, k))
    fixture, params, consts = tiny_nodrop
    cfg = dataclasses.replace(fixture.cfg, index_topk=4)  # fewer picks than positions: a top-k to take
    chunks = [SeqChunk(slot=0, block_table=[0, 1, 2, 3], start=0, tokens=list(range(3, 60)), logits="all")]
    batch, _ = build_step(chunks, 64, 2, 4, 64)
    cache = init_cache(cfg, CacheSpec(num_blocks=8, num_slots=2, block_size=16))
    out = {impl: jax.jit(functools.partial(forward_step, cfg=cfg, topk_impl=impl))(params, cache, batch, consts)
           for impl in ("reference", "pallas")}
    assert out["reference"][2] and shapes, "no index-source layer's top-k reached the kernel"
    for layer, want in out["reference"][2].items():
        np.testing.assert_array_equal(np.asarray(out["pallas"][2][layer]), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(out["pallas"][0]), np.asarray(out["reference"][0]))
