"""dijax.kernels.sparse_attn_mgpu in jax's Mosaic GPU interpreter (CPU) against the jnp reference.

The kernel needs a Hopper GPU (tests/gpu/test_attention_gpu.py runs it). Interpreted, its rows are gathered in
XLA (the interpreter runs no ``inline_mgpu``: the module docstring); the rest is the kernel's own: the two
warpgroups' K-halves, the slots and barriers, the score and PV products, the masks, the online softmax, the stores of
the splits' partials and their merge.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from dijax.kernels import cluster, row_gather
from dijax.kernels import sparse_attn as sa
from dijax.kernels import sparse_attn_mgpu as sm
from tests.test_kernels_sparse_attn import problem

pytestmark = pytest.mark.cost(40)


def check(q, sources, idx, sink, splits: int, interpret=True, shared_scores: bool = True,
          dim_splits: int = 1) -> np.ndarray:
    scale = q.shape[-1] ** -0.5
    want = np.asarray(sa.sparse_attn_reference(q, sources, jnp.asarray(idx), sink, scale), np.float32)
    got = np.asarray(sm.sparse_attn_mgpu(q, sources, jnp.asarray(idx), sink, scale, splits=splits,
                                         shared_scores=shared_scores, dim_splits=dim_splits, interpret=interpret),
                     np.float32)
    assert got.shape == want.shape and np.isfinite(got).all()
    # the scores sum two K-halves (another order than the reference's); splits round P relative to their own max
    np.testing.assert_allclose(got, want, atol=4e-3, rtol=2e-2)
    assert np.abs(got - want).mean() < 2e-3 * np.abs(want).mean()
    return got


def test_block_is_the_references():
    assert sm.ROWS == sa.BLOCK  # the kernel walks the reference's blocks of indices


@pytest.mark.parametrize("k,splits", [(512, 1), (512, 2), (128, 3)])
def test_two_sources_ragged_list(k, splits):
    # 150 lanes: three blocks, the last one part padding; uneven splits (3 blocks in 2 parts: 2 + 1 with padding);
    # K = 512: two warpgroups, each half of the output dims; K = 128: one
    q, sources, idx, sink = problem(3, 150, (40, 300), splits, 64, k)
    check(q, sources, idx, sink, splits)


@pytest.mark.parametrize("splits", [1, 2])
def test_three_sources_empty_blocks_and_rows(splits):
    # one split writes the output in the kernel (sink, division, bf16); two merge their partials in XLA
    q, sources, idx, sink = problem(4, 256, (100, 3, 500), 7, 64, 512)
    idx[1, :64] = -1  # a first block with nothing: the running max stays -1e30 until the next
    idx[2, 64:] = -1  # blocks with nothing after the first
    idx[3, :] = -1  # no row at all: zero
    idx[0, 5] = 700  # past the sources' 603 rows: a zero row with a score of 0, as the reference's gather gives
    got = check(q, sources, idx, sink, splits)
    assert (got[3] == 0).all()


@pytest.mark.parametrize("h,k", [(4, 64), (128, 256), (8, 512)])
def test_head_padding_and_groups(h, k):
    # fewer than 64 heads: zero queries pad the CTA's M (4 x 64: the parity fixtures' tiny model); 128 heads: two
    # head groups
    q, sources, idx, sink = problem(2, 100, (70, 200), h, h, k)
    check(q, sources, idx, sink, splits=1)


@pytest.mark.parametrize("sizes", [(40,), (40, 7, 200), (3, 0, 5, 9)])
def test_row_gather_locates_each_source(sizes):
    # the gather's source lookup, the same code the kernel runs in MLIR, here on numpy (the interpreter gathers in
    # XLA instead, so this is the CPU's only check of it: the H200 found rows past a second source misplaced)
    firsts = np.cumsum((0,) + sizes)
    index = np.arange(firsts[-1])
    which, local = row_gather.locate(index, firsts[:-1].tolist(), list(range(len(sizes))), np.where,
                                     np.greater_equal, np.subtract)
    want = np.searchsorted(firsts, index, side="right") - 1
    np.testing.assert_array_equal(which, want)
    np.testing.assert_array_equal(local, index - firsts[want])


def test_shape_errors_name_the_field():
    assert sm.shape_error(64, 512, 3) is None and sm.shape_error(4, 64, 1) is None
    assert [sm.warpgroups(k) for k in (64, 256, 512)] == [1, 1, 2]
    for k in (96, 192, 384, 768):  # 192 / 384: a row's 24 / 48 chunks do not divide the gathering threads
        assert "K must be" in sm.shape_error(64, k, 1)
    assert "H must be" in sm.shape_error(96, 128, 1)
    assert "kv_sources" in sm.shape_error(64, 128, 4)
    with pytest.raises(ValueError, match="K must be"):
        sm.sparse_attn_mgpu(*problem(1, 8, (10,), 0, 4, 96), 0.1, interpret=True)


def test_which_splits_merge_in_a_cluster():
    # pairs of splits merge in the kernel on the GPU; other counts, and every count in the interpreter (no
    # distributed shared memory there), go through flash_merge in XLA
    assert sm.merges_in_cluster(2, interpret=False)
    assert not any(sm.merges_in_cluster(s, interpret=False) for s in (1, 3, 4, 5, 10))
    assert sm.merges_in_cluster(4, interpret=False, cluster_splits=(2, 4))
    assert not sm.merges_in_cluster(2, interpret=False, cluster_splits=())
    assert not sm.merges_in_cluster(2, interpret=True)
    assert not sm.merges_in_cluster(2, interpret=plgpu.InterpretGPUParams())
    # sizes a cluster cannot take are refused by name, in the config and in the kernel's call
    assert sa.SparseAttnConfig(cluster_splits=[2, 4]).cluster_splits == (2, 4)
    with pytest.raises(ValueError, match="cluster_splits must hold split counts from"):
        sa.SparseAttnConfig(cluster_splits=(3,))
    with pytest.raises(ValueError, match="cluster_splits"):
        sm.sparse_attn_mgpu(*problem(1, 8, (10,), 0, 4, 64), 0.1, splits=2, cluster_splits=(16,), interpret=True)


def test_engine_is_validated_and_falls_back_off_the_gpu(monkeypatch):
    with pytest.raises(ValueError, match="engine must be one of"):
        sa.SparseAttnConfig(engine="cuda")
    with pytest.raises(ValueError, match="mgpu_min_tokens"):
        sa.SparseAttnConfig(mgpu_min_tokens=0)
    # off a GPU (interpret mode) the 'mgpu' engine takes the Triton kernel: the same values as the Triton engine
    q, sources, idx, sink = problem(2, 70, (50, 90), 3, 16, 64)
    args = (q, sources, jnp.asarray(idx), sink, 0.125)
    np.testing.assert_array_equal(np.asarray(sa.sparse_attn_pallas(*args, config=sa.SparseAttnConfig(engine="mgpu"))),
                                  np.asarray(sa.sparse_attn_pallas(*args, config=sa.SparseAttnConfig(engine="triton"))))
    # on a Hopper GPU (faked): from mgpu_min_tokens tokens on, shapes it takes, not interpreted
    monkeypatch.setattr(sm, "available", lambda: True)
    config = sa.SparseAttnConfig(engine="mgpu", mgpu_min_tokens=64)
    assert sa._mgpu_takes(config, 64, 64, 512, 3, interpret=False)
    assert not sa._mgpu_takes(config, 63, 64, 512, 3, interpret=False)
    assert not sa._mgpu_takes(config, 64, 64, 512, 3, interpret=True)
    assert not sa._mgpu_takes(config, 64, 64, 96, 3, interpret=False)
    assert not sa._mgpu_takes(sa.SparseAttnConfig(engine="triton"), 64, 64, 512, 3, interpret=False)


@pytest.mark.parametrize("k", [512, 64])
def test_no_race_in_the_slots(k):
    # the interpreter's happens-before race detector over the row slots' and index slots' refills and reads (it
    # raises on a race; leaving out the meeting before a slot is refilled, or copying block b + 2's indices before
    # it, makes it raise)
    q, sources, idx, sink = problem(2, 200, (40, 300), 5, 64, k)
    check(q, sources, idx, sink, 1, interpret=plgpu.InterpretGPUParams(detect_races=True))


@pytest.mark.parametrize("length,splits", [(300, 1), (300, 2), (64, 1)])
def test_shared_scores_are_the_same_arithmetic(length, splits):
    # warpgroup 0 alone computing each block's scores and softmax, P and the statistics handed over through shared
    # memory (``shared_scores``): the same bits as every warpgroup computing them, under the race detector (P's and
    # alpha's slot refilled each block after the meeting, the statistics read after the last P's barrier); one to
    # five blocks a split, a block with nothing
    q, sources, idx, sink = problem(2, length, (40, 300), 5, 64, 512)
    idx[1, :64] = -1
    plain = check(q, sources, idx, sink, splits, shared_scores=False)
    shared = check(q, sources, idx, sink, splits, interpret=plgpu.InterpretGPUParams(detect_races=True))
    np.testing.assert_array_equal(shared, plain)


@pytest.mark.parametrize("k,splits,dims", [(512, 1, 2), (512, 2, 4), (128, 3, 2)])
def test_split_output_dims_are_the_same_arithmetic(k, splits, dims):
    # each (token, split, head group) as ``dims`` CTAs, each computing the scores over the whole rows and the PV
    # product for its 1 / dims of every warpgroup's output dims (``dim_splits``): the same bits as one CTA, under
    # the race detector, with the list's splits merged in XLA beside it
    q, sources, idx, sink = problem(3, 150, (40, 300), splits, 64, k)
    idx[1, :64] = -1
    whole = check(q, sources, idx, sink, splits)
    split = check(q, sources, idx, sink, splits, interpret=plgpu.InterpretGPUParams(detect_races=True),
                  dim_splits=dims)
    np.testing.assert_array_equal(split, whole)


def test_dim_splits_are_validated_and_fill_the_wave(monkeypatch):
    # a warpgroup's share of the output dims stays whole 64-column tiles: K = 512 (two warpgroups of 256) takes 1,
    # 2 and 4; K = 64 only 1; the config names its field
    assert sm.dim_splits_error(512, 4) is None and "one of [1, 2, 4]" in sm.dim_splits_error(512, 8)
    assert "one of [1]" in sm.dim_splits_error(64, 2)
    with pytest.raises(ValueError, match="dim_splits must be one of"):
        sm.sparse_attn_mgpu(*problem(1, 8, (10,), 0, 4, 64), 0.1, dim_splits=2, interpret=True)
    with pytest.raises(ValueError, match="mgpu_dim_splits must be one of"):
        sa.SparseAttnConfig(mgpu_dim_splits=3)
    # the seam splits the list first, then the dims into what is left of the wave, as far as K and the config allow
    config = sa.SparseAttnConfig(engine="mgpu")
    assert config.mgpu_dim_splits == 4
    assert [sa._dim_splits(config, p, 512) for p in (1, 10, 33, 34, 66, 67, 128, 256)] == [4, 4, 4, 2, 2, 1, 1, 1]
    assert sa._dim_splits(config, 10, 64) == 1 and sa._dim_splits(config, 10, 256) == 4
    assert sa._dim_splits(sa.SparseAttnConfig(mgpu_dim_splits=2), 10, 512) == 2
    assert sa._dim_splits(sa.SparseAttnConfig(mgpu_dim_splits=1), 1, 512) == 1
    calls = []
    monkeypatch.setattr(sa, "_mgpu_takes", lambda *a: True)
    monkeypatch.setattr(sm, "sparse_attn_mgpu", lambda *a, **kw: calls.append(kw) or a[0])
    for t in (1, 5, 64, 256):  # 640 lanes: 10 blocks
        q, sources, idx, sink = problem(t, 640, (700,), 0, 64, 512)
        sa.sparse_attn_pallas(q, sources, jnp.asarray(idx), sink, 0.1, config=config)
    assert [(kw["splits"], kw["dim_splits"]) for kw in calls] == [(10, 4), (10, 2), (2, 1), (1, 1)]


def thread_elements(layout, shape: tuple[int, ...]) -> dict[tuple[int, tuple[int, ...]], tuple[int, ...]]:
    """{(thread of the warpgroup, register index): the array index of that register's first element} of a Mosaic
    GPU ``TiledLayout`` over ``shape``, by the arithmetic its ``thread_idxs`` emits as IR (in plain integers)."""
    contiguous = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    strides = layout.tiling.tile_strides(contiguous)
    tiled, rank = layout.tiled_tiling_shape, layout.tiled_tiling_rank
    tile_strides = strides[-rank:]

    def offset(index: int, dims) -> int:  # a warp or lane index spread over its dims, most significant first
        sizes = [tiled[d] if isinstance(d, int) else d.times for d in dims]
        place = [int(np.prod(sizes[i + 1:])) for i in range(len(sizes))]
        return sum((index // p) % n * tile_strides[d] for d, n, p in zip(dims, sizes, place) if isinstance(d, int))

    elements = {}
    for thread in range(128):
        base = offset(thread // 32 % 4, layout.warp_dims) + offset(thread % 32, layout.lane_dims)
        for reg in np.ndindex(layout.registers_shape(shape)):
            linear = base + sum(i * s for i, s in zip(reg, strides))
            elements[thread, reg] = tuple(int(i) for i in np.unravel_index(linear, shape))
    return elements


def test_wide_merge_rows_are_the_wgmma_rows():
    # cluster.merge_tiles relabels a row-layout value (ROW_LAYOUT, the WGMMA layout's rows) as its wide layout's
    # reduced rows before broadcasting it: right only while both put the same rows in the same registers of the same
    # threads (a guard for jax updates, whose layouts may change)
    # the model against the layouts' documented pictures: WGMMA lane 5 holds row 1, columns 2-3 (and row 9); the
    # wide layout's lane 1 holds row 0, columns 8-11 (its lanes 1 and 2 swap column groups)
    wgmma, wide = thread_elements(fa.WGMMA_LAYOUT, (64, 16)), thread_elements(cluster.WIDE_LAYOUT, (64, 16))
    assert sorted(v for (t, _), v in wgmma.items() if t == 5) == [(1, 2), (1, 10), (9, 2), (9, 10)]
    assert sorted(v for (t, _), v in wide.items() if t == 1) == [(0, 8), (8, 8)]
    assert sorted(v for (t, _), v in wide.items() if t == 2) == [(0, 4), (8, 4)]
    rows = thread_elements(fa.WGMMA_ROW_LAYOUT, (64,))
    assert rows == thread_elements(cluster.WIDE_LAYOUT.reduce((1,)), (64,))
    # and each thread's wide-layout elements lie in the rows it holds in the row layout
    for (t, _), (r, _) in wide.items():
        assert (r,) in {v for (u, _), v in rows.items() if u == t}
