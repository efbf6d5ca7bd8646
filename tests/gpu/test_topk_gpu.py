"""The Pallas top-k kernel on the GPU against ``lax.top_k``: values (bit patterns), indices, order and ties.

Run on a GPU machine: ``python -m pytest -q tests/gpu/test_topk_gpu.py``. Output buffers are poisoned first: a NaN
array of the outputs' size is freed just before each kernel call, so the allocator hands the kernel memory full of
NaN and any element the kernel fails to write shows up in the comparison.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dijax  # noqa: F401  (sets XLA flags before JAX starts)
from dijax.kernels import topk as topk_module
from dijax.kernels.topk import TopkConfig, topk_ascending, topk_pallas, topk_pallas_ascending, topk_reference

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="GPU kernels: needs a CUDA backend (jax.default_backend() == 'gpu')")

WIDTH, TOPK = 262_144, 512  # V4.1-Flash: the longest rows of compressed positions, index_topk


def poison(nbytes: int) -> None:
    """Leave ``nbytes`` of freed device memory holding NaN for the next allocation to reuse."""
    filler = jnp.full((nbytes // 4 + 1,), jnp.nan, jnp.float32)
    filler.block_until_ready()
    filler.delete()


def indexer_scores(rows: int, width: int, seed: int) -> np.ndarray:
    """bf16 scores (many ties) widened to float32, -inf past each row's visible length; the first row has fewer
    real values than ``TOPK``."""
    rng = np.random.default_rng(seed)
    score = np.asarray(jnp.asarray(rng.standard_normal((rows, width)), jnp.bfloat16).astype(jnp.float32))
    visible = rng.integers(min(100, width), width + 1, rows)
    visible[0] = min(300, width)
    return np.where(np.arange(width)[None, :] < visible[:, None], score, -np.inf).astype(np.float32)


def assert_matches(score: np.ndarray, k: int, config: TopkConfig | None = None) -> None:
    x = jnp.asarray(score)
    want_v, want_i = jax.jit(topk_reference, static_argnums=1)(x, k)
    kernel = jax.jit(lambda s: topk_pallas(s, k, config=config))
    poison(score.shape[0] * 4 * (2 * k + 4 * 16_384))  # the values, indices, chunk maxima and scratch
    got_v, got_i = kernel(x)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(got_v).view(np.uint32), np.asarray(want_v).view(np.uint32))


@pytest.mark.parametrize("rows", [1, 4, 64])
def test_matches_lax_top_k_at_flash_sizes(rows):
    assert_matches(indexer_scores(rows, WIDTH, seed=rows), TOPK)


@pytest.mark.parametrize("rows,width,k", [(3, 100_003, 512), (5, 70_001, 64), (2, 4097, 1), (7, 1000, 1000),
                                          (16, WIDTH - 5, TOPK), (9, 33, 7)])
def test_matches_lax_top_k_at_ragged_sizes(rows, width, k):
    assert_matches(indexer_scores(rows, width, seed=width + k), k)


@pytest.mark.parametrize("config", [TopkConfig(chunk=32), TopkConfig(select_warps=4), TopkConfig(select_warps=16),
                                    TopkConfig(rank_tile=64), TopkConfig(block_values=16_384, max_warps=8)])
def test_other_tilings(config):
    # the benchmark's sweep variants (tools/bench_kernels.py --only topk --sweep) must be exact too
    assert_matches(indexer_scores(64, WIDTH, seed=7), TOPK, config)


def test_special_values_and_uniform_rows():
    # NaN of both signs, signed zeros, infinities; a row of one value (the lowest positions win) and a row of -inf
    rng = np.random.default_rng(0)
    x = rng.choice(np.array([0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 1.0, -1.0], np.float32), (8, 65_536))
    x[5] = 0.25
    x[6] = -np.inf
    x[7] = -0.0
    assert_matches(x, 64)
    assert_matches(x, TOPK)


def test_dispatcher_takes_the_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(topk_module, "topk_pallas_ascending",
                        lambda s, k: calls.append(s.shape) or topk_pallas_ascending(s, k))
    x = jnp.asarray(indexer_scores(4, WIDTH, seed=11))
    got = jax.jit(lambda s: topk_ascending(s, TOPK, impl="pallas"))(x)
    assert calls == [(4, WIDTH)]
    np.testing.assert_array_equal(np.asarray(got), np.sort(np.asarray(jax.lax.top_k(x, TOPK)[1]), axis=-1))


@pytest.mark.parametrize("rows,width", [(1, WIDTH), (64, WIDTH), (8192, 2048), (300, 1000)])
def test_ascending_is_the_sorted_top_k_set(rows, width):
    """The kernel without its ranking stage (the model's ``topk_positions``): lax.top_k's indices, ascending; at
    flash decode widths and at a prefill of 8192 tokens over 2048 compressed positions."""
    x = jnp.asarray(indexer_scores(rows, width, seed=rows + width))
    want = np.sort(np.asarray(jax.jit(topk_reference, static_argnums=1)(x, TOPK)[1]), axis=-1)
    poison(rows * 4 * 4 * 16_384)
    got = jax.jit(lambda s: topk_pallas_ascending(s, TOPK))(x)
    np.testing.assert_array_equal(np.asarray(got), want)
