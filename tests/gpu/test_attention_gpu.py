"""Top-k select and the Pallas sparse-attention kernel on the GPU, at V4.1-Flash sizes, against their references.

Run on a GPU machine: ``python -m pytest -q tests/gpu/test_attention_gpu.py``. Output buffers are poisoned first:
a NaN array of the outputs' size is freed just before each kernel call, so the allocator hands the kernel memory
full of NaN and any element the kernel fails to write shows up in the comparison.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dijax  # noqa: F401  (sets XLA flags before JAX starts)
from dijax.kernels import row_gather, sparse_attn, sparse_attn_mgpu
from dijax.kernels.sparse_attn import SparseAttnConfig, sparse_attn_pallas, sparse_attn_reference
from dijax.kernels.topk import topk_reference, topk_select
from tools import kernel_regions

TRITON = functools.partial(SparseAttnConfig, engine="triton")  # the Triton kernel's tests

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="GPU kernels: needs a CUDA backend (jax.default_backend() == 'gpu')")

HEADS, DIM, WINDOW, TOPK = 64, 512, 128, 512


def poison(nbytes: int) -> None:
    """Leave ``nbytes`` of freed device memory holding NaN for the next allocation to reuse."""
    filler = jnp.full((nbytes // 4 + 1,), jnp.nan, jnp.float32)
    filler.block_until_ready()
    filler.delete()


@pytest.mark.parametrize("rows", [1, 4, 64])
def test_topk_select_matches_lax_top_k(rows):
    rng = np.random.default_rng(rows)
    width = 262_144
    # bf16 scores with many ties, a -inf tail beyond each row's visible length
    score = np.asarray(jnp.asarray(rng.standard_normal((rows, width)), jnp.bfloat16).astype(jnp.float32))
    visible = rng.integers(100, width, rows)
    visible[0] = 300  # fewer real values than k in the first row
    score = np.where(np.arange(width)[None, :] < visible[:, None], score, -np.inf).astype(np.float32)
    x = jnp.asarray(score)
    want_v, want_i = jax.jit(topk_reference, static_argnums=1)(x, TOPK)
    poison(rows * TOPK * 8)
    got_v, got_i = jax.jit(topk_select, static_argnums=1)(x, TOPK)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(got_v).view(np.uint32), np.asarray(want_v).view(np.uint32))


def test_topk_special_values_order():
    # NaN, signed zeros and infinities: the select keeps the float total order; lax.top_k on this backend must too
    rng = np.random.default_rng(0)
    x = rng.choice(np.array([0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 1.0], np.float32), (8, 4096))
    want_v, want_i = topk_reference(jnp.asarray(x), 64)
    got_v, got_i = jax.jit(topk_select, static_argnums=1)(jnp.asarray(x), 64)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))


def decode_problem(batch: int, seed: int, pool_rows_per_seq: int = 1024):
    """A decode step: per token [127 ring rows | its new row | 512 compressed rows], some -1; with several tokens
    the last one's list is all -1."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, HEADS, DIM)), jnp.bfloat16)
    ring = jnp.asarray(rng.standard_normal((batch * WINDOW, DIM)), jnp.bfloat16)
    new = jnp.asarray(rng.standard_normal((batch, DIM)), jnp.bfloat16)
    pool = jnp.asarray(rng.standard_normal((batch * pool_rows_per_seq, DIM)), jnp.bfloat16)
    seq = np.arange(batch)[:, None]
    ring_idx = seq * WINDOW + (rng.integers(0, WINDOW) + np.arange(WINDOW - 1)[None, :]) % WINDOW
    new_idx = batch * WINDOW + seq
    comp = np.sort(rng.choice(pool_rows_per_seq, (batch, TOPK)), axis=1) + seq * pool_rows_per_seq
    comp_idx = batch * WINDOW + batch + comp
    idx = np.concatenate([ring_idx, new_idx, comp_idx], axis=1).astype(np.int32)
    idx[rng.random(idx.shape) < 0.05] = -1
    if batch > 1:
        idx[-1, :] = -1
    sink = jnp.asarray(rng.standard_normal(HEADS), jnp.float32)
    return q, (ring, new, pool), jnp.asarray(idx), sink


@pytest.mark.parametrize("batch,config", [(1, TRITON()), (64, TRITON()),
                                          (64, TRITON(num_splits=1)), (64, TRITON(num_splits=5)),
                                          (5, TRITON(block_h=32, num_splits=1, num_warps=4))])
def test_sparse_attn_pallas_matches_reference(batch, config):
    q, sources, idx, sink = decode_problem(batch, seed=batch)
    scale = DIM ** -0.5
    want = np.asarray(jax.jit(sparse_attn_reference, static_argnums=4)(q, sources, idx, sink, scale), np.float32)
    kernel = jax.jit(lambda *a: sparse_attn_pallas(*a, scale, config=config))
    poison(batch * HEADS * DIM * 4 * 16)
    got = np.asarray(kernel(q, sources, idx, sink), np.float32)
    assert np.isfinite(got).all()
    assert batch == 1 or (got[-1] == 0).all()
    np.testing.assert_allclose(got, want, atol=4e-3, rtol=2e-2)
    assert np.abs(got - want).mean() < 2e-3 * np.abs(want).mean()


@pytest.mark.parametrize("batch,config", [(1, TRITON()), (64, TRITON()),
                                          (64, TRITON(num_splits=1)), (5, TRITON(num_splits=3)),
                                          (64, TRITON(num_stages=1))])
def test_sparse_attn_pallas_window_and_pool(batch, config):
    # the model's layout (attention.attend_lists): ring and new rows as one source, the pool as the other, from lane
    # first_T[t] on; short windows (a sequence's first 127 tokens) move the pool's lanes down, into a block that
    # reads both sources. Bits equal to the general walk over the three sources
    q, (ring, new, pool), idx, sink = decode_problem(batch, seed=batch + 100)
    idx = np.array(idx)  # a writable copy
    widths = np.full(batch, WINDOW, np.int32)
    widths[1::2] = np.array([1, 37, 64, 100, 127])[np.arange(len(widths[1::2])) % 5]
    for t, w in enumerate(widths):  # the window's first w lanes, then the compressed part
        idx[t] = np.concatenate([idx[t, :w], idx[t, WINDOW:], np.full(WINDOW - w, -1, np.int32)])
    idx = jnp.asarray(idx)
    scale = DIM ** -0.5
    want = np.asarray(jax.jit(sparse_attn_reference, static_argnums=4)(q, (ring, new, pool), idx, sink, scale),
                      np.float32)
    general = np.asarray(jax.jit(lambda *a: sparse_attn_pallas(*a, scale, config=config))(
        q, (ring, new, pool), idx, sink), np.float32)
    kernel = jax.jit(lambda q, s, i, k, f: sparse_attn_pallas(q, s, i, k, scale, first_T=f, config=config))
    window = jnp.concatenate([ring, new])
    poison(batch * HEADS * DIM * 4 * 16)
    got = np.asarray(kernel(q, (window, pool), idx, sink, jnp.asarray(widths)), np.float32)
    assert np.isfinite(got).all()
    assert batch == 1 or (got[-1] == 0).all()
    np.testing.assert_array_equal(got, general)
    np.testing.assert_allclose(got, want, atol=4e-3, rtol=2e-2)


def test_sparse_attn_pallas_tiny_model_heads():
    # the parity fixtures' tiny model: 4 heads of 64, padded to MIN_HEADS inside the kernel call
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((7, 4, 64)), jnp.bfloat16)
    sources = tuple(jnp.asarray(rng.standard_normal((n, 64)), jnp.bfloat16) for n in (32, 7, 200))
    idx = rng.integers(-1, 239, (7, 300)).astype(np.int32)
    sink = jnp.asarray(rng.standard_normal(4), jnp.float32)
    want = np.asarray(sparse_attn_reference(q, sources, jnp.asarray(idx), sink, 0.125), np.float32)
    poison(7 * 16 * 64 * 4 * 16)
    got = np.asarray(jax.jit(lambda *a: sparse_attn_pallas(*a, 0.125))(q, sources, jnp.asarray(idx), sink), np.float32)
    assert got.shape == want.shape and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=4e-3, rtol=2e-2)


ALL_CLUSTERS = sparse_attn_mgpu.CLUSTER_SIZES


@pytest.mark.parametrize("batch,splits,clusters,pdl", [
    (1, 1, (), False), (1, 5, (), False), (64, 1, (), False), (64, 2, (2,), False), (64, 2, (), False),
    (5, 3, (), False), (5, 1, (), False), (16, 8, ALL_CLUSTERS, False), (32, 4, ALL_CLUSTERS, False),
    (1, 8, ALL_CLUSTERS, False), (3, 4, ALL_CLUSTERS, False), (1, 1, (), True), (64, 2, (2,), True)])
def test_sparse_attn_mgpu_matches_reference(batch, splits, clusters, pdl):
    # the Mosaic GPU kernel itself (cp.async row gathers into the swizzled slots), over the three decode sources;
    # splits in ``clusters`` merge in the kernel across a cluster, the others in XLA (8 of the 10 blocks' lists
    # leave 3 splits empty); ``pdl``: launched as a programmatic dependent of the XLA kernel before it that writes
    # its queries (2 q, with half the scale: the same products)
    assert sparse_attn_mgpu.available()
    q, sources, idx, sink = decode_problem(batch, seed=batch + splits)
    scale = DIM ** -0.5
    want = np.asarray(jax.jit(sparse_attn_reference, static_argnums=4)(q, sources, idx, sink, scale), np.float32)
    kernel = jax.jit(lambda q, *a: sparse_attn_mgpu.sparse_attn_mgpu(
        (q * 2).astype(q.dtype), *a, scale / 2, splits=splits, cluster_splits=clusters, pdl=pdl))
    poison(batch * splits * HEADS * DIM * 4 * 4)
    got = np.asarray(kernel(q, sources, idx, sink), np.float32)
    assert np.isfinite(got).all()
    assert batch == 1 or (got[-1] == 0).all()
    np.testing.assert_allclose(got, want, atol=4e-3, rtol=2e-2)
    assert np.abs(got - want).mean() < 2e-3 * np.abs(want).mean()


@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("h,k,sizes", [(64, 128, (40, 300)), (128, 256, (500,)), (8, 512, (10, 3, 900))])
def test_sparse_attn_mgpu_shapes(h, k, sizes, dims):
    # K = 128 / 256 (4 and 2 rows a pass of the gathering threads), two head groups, padded heads, sources of
    # sizes that are not multiples of anything, lists of 150 lanes (a partial last block); the output dims in one
    # CTA and split over two (``dim_splits``)
    rng = np.random.default_rng(h + k)
    q = jnp.asarray(rng.standard_normal((3, h, k)), jnp.bfloat16)
    sources = tuple(jnp.asarray(rng.standard_normal((n, k)), jnp.bfloat16) for n in sizes)
    idx = rng.integers(-1, sum(sizes), (3, 150)).astype(np.int32)
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    scale = k ** -0.5
    want = np.asarray(sparse_attn_reference(q, sources, jnp.asarray(idx), sink, scale), np.float32)
    poison(3 * 3 * max(h, 64) * k * 4 * 4)
    got = np.asarray(jax.jit(lambda *a: sparse_attn_mgpu.sparse_attn_mgpu(*a, scale, splits=2, dim_splits=dims))(
        q, sources, jnp.asarray(idx), sink), np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=4e-3, rtol=2e-2)


def through_the_seam(batch: int, seed: int, splits: int = 1, **changes) -> list[np.ndarray]:
    """A decode problem (``decode_problem``) in the model's layout (ring and new rows as one source, the pool the
    other) through ``sparse_attn_pallas`` on the Mosaic GPU kernel, once per config change given as lists (e.g.
    ``mgpu_shared_scores=[False, True]``), output poisoned first; -> each output, float32."""
    q, (ring, new, pool), idx, sink = decode_problem(batch, seed=seed)
    sources = (jnp.concatenate([ring, new]), pool)
    outputs = []
    for values in zip(*changes.values()):
        config = SparseAttnConfig(engine="mgpu", mgpu_min_tokens=1, num_splits=splits,
                                  **dict(zip(changes, values)))
        poison(batch * splits * HEADS * DIM * 4 * 4)
        outputs.append(np.asarray(jax.jit(lambda *a, c=config: sparse_attn_pallas(*a, DIM ** -0.5, config=c))(
            q, sources, idx, sink), np.float32))
    return outputs


@pytest.mark.parametrize("batch", [1, 64])
def test_sparse_attn_mgpu_engine_window_and_pool(batch):
    # the seam: SparseAttnConfig(engine='mgpu') in the model's layout (ring and new rows as one source, the pool
    # the other), against the Triton kernel
    q, (ring, new, pool), idx, sink = decode_problem(batch, seed=batch + 200)
    sources = (jnp.concatenate([ring, new]), pool)
    scale = DIM ** -0.5
    triton = np.asarray(jax.jit(lambda *a: sparse_attn_pallas(*a, scale, config=TRITON()))(q, sources, idx, sink),
                        np.float32)
    poison(batch * HEADS * DIM * 4 * 16)
    mgpu = SparseAttnConfig(engine="mgpu", mgpu_min_tokens=1)
    got = np.asarray(jax.jit(lambda *a: sparse_attn_pallas(*a, scale, config=mgpu))(q, sources, idx, sink),
                     np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, triton, atol=4e-3, rtol=2e-2)


@pytest.mark.parametrize("batch,splits,clusters", [(1, 1, ()), (64, 2, (2,)), (64, 2, ()), (256, 1, ()),
                                                    (3, 10, ())])
def test_sparse_attn_mgpu_shared_scores(batch, splits, clusters):
    # warpgroup 0 alone computing the scores and softmax, P through shared memory (SparseAttnConfig.
    # mgpu_shared_scores, the default, through the seam): the same bits as each warpgroup computing them, with and
    # without the cluster merge, one block a split (10 splits) and ten
    plain, shared = through_the_seam(batch, batch + 300, splits, cluster_splits=[clusters] * 2,
                                     mgpu_shared_scores=[False, True])
    assert np.isfinite(shared).all()
    np.testing.assert_array_equal(shared, plain)


@pytest.mark.parametrize("batch,splits,clusters,dims", [(64, 1, (), 2), (64, 2, (2,), 2), (1, 10, (), 2),
                                                         (3, 1, (), 4), (16, 4, ALL_CLUSTERS, 2)])
def test_sparse_attn_mgpu_dim_splits(batch, splits, clusters, dims):
    # each head group's output dims split over ``dims`` CTAs, each computing the scores over the whole rows
    # (SparseAttnConfig.mgpu_dim_splits, through the seam): the same bits as one CTA, with one split, two merged in
    # a cluster, ten merged in XLA, four in a cluster of four
    whole, split = through_the_seam(batch, batch + 500, splits, cluster_splits=[clusters] * 2,
                                    mgpu_dim_splits=[1, dims])
    assert np.isfinite(split).all()
    np.testing.assert_array_equal(split, whole)


@pytest.mark.parametrize("batch,splits,clusters", [(64, 2, (2,)), (32, 4, ALL_CLUSTERS), (16, 8, ALL_CLUSTERS),
                                                    (3, 4, ALL_CLUSTERS)])
def test_sparse_attn_mgpu_wide_merge(batch, splits, clusters):
    # the cluster merge reading its tiles 16 bytes a load (SparseAttnConfig.mgpu_wide_merge, through the seam): the
    # same bits as 8 bytes a load, in pairs, clusters of four and eight, and four dim splits of clusters of four
    # (tiles 16 wide)
    narrow, wide = through_the_seam(batch, batch + 600, splits, cluster_splits=[clusters] * 2,
                                    mgpu_wide_merge=[False, True])
    assert np.isfinite(wide).all()
    np.testing.assert_array_equal(wide, narrow)


@pytest.mark.parametrize("batch,splits", [(64, 2), (3, 1)])
def test_sparse_attn_mgpu_timeline(batch, splits, tmp_path):
    # SparseAttnConfig.mgpu_trace_dir: the kernel with its steps timed (Mosaic GPU's on-device profiler) gives the
    # same bits as without, and each call writes a timeline in which every warpgroup enters each block's steps once
    # a block (640 lanes in ``splits`` parts: 10 / splits blocks) and the start and the output once, but for the
    # scores and softmax, which warpgroup 0 alone computes (shared scores, the default): half as many a trace
    plain, timed = through_the_seam(batch, batch + 400, splits, mgpu_trace_dir=["", str(tmp_path)])
    jax.effects_barrier()  # the timeline is written by a host callback
    np.testing.assert_array_equal(timed, plain)
    summary = kernel_regions.summarise(kernel_regions.load(str(tmp_path))[1])
    dims = sparse_attn._dim_splits(SparseAttnConfig(), batch * splits, DIM)  # CTAs a (token, split)
    assert summary["traces"] == batch * splits * dims * 2  # a trace a warpgroup, two warpgroups a CTA at K = 512
    blocks = 10 // splits
    for name, entries in {"start": 1, "output": 1, "meeting": blocks, "gather": blocks, "scores": blocks / 2,
                          "softmax": blocks / 2, "pv": blocks}.items():
        assert summary[name]["entries"] == entries, name
        assert summary[name]["cycles"] > 0, name


@pytest.mark.parametrize("k,sizes,parts", [(512, (300, 5000), 2), (64, (40, 7, 200), 1), (128, (1000,), 1),
                                           (256, (64, 64), 1), (128, (500,), 2)])
def test_row_gather(k, sizes, parts):
    # the kernels' cp.async row gather alone, through its swizzled tile and a TMA store: bit for bit the rows named,
    # zero rows for -1 and past the sources (if this fails, the gather's addresses are wrong, whatever else passes)
    rng = np.random.default_rng(k)
    sources = tuple(jnp.asarray(rng.standard_normal((n, k)), jnp.bfloat16) for n in sizes)
    idx = rng.integers(-1, sum(sizes) + 5, 192).astype(np.int32)
    rows = np.concatenate([np.asarray(src, np.float32) for src in sources])
    inside = (idx >= 0) & (idx < len(rows))
    want = np.where(inside[:, None], rows[np.clip(idx, 0, len(rows) - 1)], 0)
    poison(192 * k * 2 * 4)
    got = np.asarray(jax.jit(row_gather.gather_rows_mgpu, static_argnums=2)(sources, jnp.asarray(idx), parts),
                     np.float32)
    np.testing.assert_array_equal(got, want)
