"""kernels.sparse_attn: the Pallas kernel (interpret mode on CPU) against the jnp reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import dijax  # noqa: F401  (sets XLA flags before JAX starts)
from dijax.kernels.sparse_attn import (SparseAttnConfig, _num_splits, sparse_attn, sparse_attn_pallas,
                                      sparse_attn_reference)

H, K = 16, 64


def problem(t: int, length: int, sizes: tuple[int, ...], seed: int, h: int = H, k: int = K):
    """(q bf16 [t, h, k], sources bf16 [n, k] of ``sizes``, idx int32 [t, length] with 30 % -1, sink float32 [h])."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((t, h, k)), jnp.bfloat16)
    sources = tuple(jnp.asarray(rng.standard_normal((n, k)) * 2, jnp.bfloat16) for n in sizes)
    idx = rng.integers(0, sum(sizes), (t, length)).astype(np.int32)
    idx[rng.random((t, length)) < 0.3] = -1
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    return q, sources, idx, sink


def run_both(q, sources, idx, sink, config):
    scale = K ** -0.5
    want = np.asarray(sparse_attn_reference(q, sources, jnp.asarray(idx), sink, scale), np.float32)
    got = np.asarray(sparse_attn_pallas(q, sources, jnp.asarray(idx), sink, scale, config=config), np.float32)
    return got, want


def assert_close(got, want):
    # one split reproduces the reference block for block; splits round P relative to their own running max
    np.testing.assert_allclose(got, want, atol=4e-3, rtol=2e-2)
    assert np.abs(got - want).mean() < 2e-3 * max(np.abs(want).mean(), 1e-6)


@pytest.mark.parametrize("config", [SparseAttnConfig(num_splits=1), SparseAttnConfig(num_splits=3),
                                    SparseAttnConfig(block_h=8, num_splits=2), SparseAttnConfig()])
def test_matches_reference_over_three_sources(config):
    q, sources, idx, sink = problem(4, 200, (24, 4, 300), seed=1)
    got, want = run_both(q, sources, idx, sink, config)
    assert_close(got, want)


@pytest.mark.parametrize("length", [1, 63, 64, 65, 130])
def test_ragged_list_lengths(length):
    q, sources, idx, sink = problem(3, length, (50,), seed=length)
    got, want = run_both(q, sources, idx, sink, SparseAttnConfig(num_splits=2))
    assert_close(got, want)


@pytest.mark.parametrize("splits", [1, 3])  # 1: the kernel adds the sink and divides itself
def test_empty_rows_and_all_minus_one_lists_give_zero(splits):
    q, sources, idx, sink = problem(5, 150, (40, 7), seed=2)
    idx[1] = -1
    idx[3, :] = -1
    idx[4, :140] = -1  # the only valid entries sit in the last split
    got, want = run_both(q, sources, idx, sink, SparseAttnConfig(num_splits=splits))
    assert (got[1] == 0).all() and (got[3] == 0).all()
    assert np.abs(got[4]).max() > 0
    assert_close(got, want)


def test_window_ring_that_wraps():
    # a ring of 8 rows read oldest-first across the wrap, then this step's rows, then compressed rows
    t, w = 3, 8
    q, sources, _, sink = problem(t, 1, (2 * w, t, 100), seed=4)
    ring = np.array([(5 + j) % w for j in range(w)], np.int32) + w  # slot 1 of the ring
    new = 2 * w + np.arange(t, dtype=np.int32)
    comp = 2 * w + t + np.array([3, 17, 50, 99], np.int32)
    idx = np.stack([np.concatenate([ring, np.where(np.arange(t) <= i, new, -1), comp]) for i in range(t)])
    got, want = run_both(q, sources, idx, sink, SparseAttnConfig(num_splits=1))
    assert_close(got, want)


def test_fewer_heads_than_a_tensor_core_tile():
    # tiny test models have 4 heads: the kernel pads the queries to MIN_HEADS and returns only the real ones
    q, sources, idx, sink = problem(3, 100, (40, 3), seed=8)
    q, sink = q[:, :4], sink[:4]
    want = np.asarray(sparse_attn_reference(q, sources, jnp.asarray(idx), sink, K ** -0.5), np.float32)
    got = np.asarray(sparse_attn_pallas(q, sources, jnp.asarray(idx), sink, K ** -0.5), np.float32)
    assert got.shape == (3, 4, K)
    assert_close(got, want)


def test_sink_only_scales_the_denominator():
    # with the sink at -inf the output is a plain softmax average; a large sink shrinks it uniformly
    q, sources, idx, _ = problem(2, 64, (30,), seed=6)
    low = jnp.full((H,), -jnp.inf, jnp.float32)
    high = jnp.full((H,), 30.0, jnp.float32)
    out_low = np.asarray(sparse_attn_pallas(q, sources, jnp.asarray(idx), low, K ** -0.5), np.float32)
    out_high = np.asarray(sparse_attn_pallas(q, sources, jnp.asarray(idx), high, K ** -0.5), np.float32)
    assert np.abs(out_low).max() > 0.05
    assert np.abs(out_high).max() < np.abs(out_low).max() * 1e-3


def test_dispatcher_and_errors():
    q, sources, idx, sink = problem(2, 64, (30,), seed=7)
    ref = sparse_attn(q, sources, jnp.asarray(idx), sink, K ** -0.5, impl="reference")
    ker = sparse_attn(q, sources, jnp.asarray(idx), sink, K ** -0.5, impl="pallas")
    assert_close(np.asarray(ker, np.float32), np.asarray(ref, np.float32))
    with pytest.raises(ValueError, match="impl must be one of"):
        sparse_attn(q, sources, jnp.asarray(idx), sink, K ** -0.5, impl="triton")
    with pytest.raises(ValueError, match="block_h"):
        sparse_attn_pallas(q, sources, jnp.asarray(idx), sink, K ** -0.5, config=SparseAttnConfig(block_h=6))
    with pytest.raises(ValueError, match="kv_sources"):
        sparse_attn_pallas(q, sources * 4, jnp.asarray(idx), sink, K ** -0.5)


@pytest.mark.parametrize("programs,blocks,want", [(1, 10, 10), (16, 10, 5), (64, 10, 2), (65, 10, 2), (66, 10, 2),
                                                  (67, 10, 1), (256, 10, 1), (8192, 128, 1), (1, 200, 100)])
def test_splits_fill_one_wave_with_equal_blocks(programs, blocks, want):
    # as many splits as one wave of 132 programs holds, then the fewest with the same blocks a split
    splits = _num_splits(SparseAttnConfig(), programs, blocks)
    assert splits == want
    assert programs * splits <= 132 or splits == 1
    per_split = -(-blocks // splits)
    assert (splits - 1) * per_split < blocks  # no split is padding only


def first_problem(t: int, n0: int, n1: int, firsts: list[int], length: int, seed: int):
    """Lists whose lanes below first[t] index source 0 and the rest source 1 (some -1), as attend_lists builds."""
    q, sources, _, sink = problem(t, 1, (n0, n1), seed=seed)
    rng = np.random.default_rng(seed)
    lane = np.arange(length)[None, :]
    first = np.asarray(firsts, np.int32)[:, None]
    idx = np.where(lane < first, rng.integers(0, n0, (t, length)), n0 + rng.integers(0, n1, (t, length)))
    idx[rng.random(idx.shape) < 0.2] = -1
    return q, sources, idx.astype(np.int32), sink, jnp.asarray(firsts, jnp.int32)


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_first_T_walk_equals_the_general_walk(splits):
    # the blocks below first_T read source 0 alone, those above it source 1 alone, the one it cuts both: the
    # general walk's bits, wherever the boundary falls (none, a block's edge, inside a block, in any split)
    firsts = [0, 1, 37, 64, 100, 128, 200, 320]
    q, sources, idx, sink, first_T = first_problem(len(firsts), 40, 300, firsts, 320, seed=7)
    config = SparseAttnConfig(num_splits=splits)
    general = sparse_attn_pallas(q, sources, jnp.asarray(idx), sink, K ** -0.5, config=config)
    split_walk = sparse_attn_pallas(q, sources, jnp.asarray(idx), sink, K ** -0.5, first_T=first_T, config=config)
    np.testing.assert_array_equal(np.asarray(split_walk, np.float32), np.asarray(general, np.float32))


def test_first_T_needs_two_sources_and_a_width_a_token():
    q, sources, idx, sink = problem(2, 130, (20, 30), seed=8)
    with pytest.raises(ValueError, match=r"first_T needs 2 kv_sources and shape \(2,\)"):
        sparse_attn_pallas(q, sources, jnp.asarray(idx), sink, K ** -0.5, first_T=jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="first_T needs 2 kv_sources"):
        sparse_attn_pallas(q, sources[:1], jnp.asarray(idx), sink, K ** -0.5, first_T=jnp.zeros((2,), jnp.int32))
