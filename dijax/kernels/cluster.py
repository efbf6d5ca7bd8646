"""The CTAs of a thread-block cluster (sm_90) in Mosaic GPU: their meeting, and WGMMA-layout tiles that one CTA
writes to its own shared memory and another reads (distributed shared memory).

A kernel launched with ``plgpu.kernel(cluster=(n,), cluster_names=(name,))`` runs its CTAs in groups of n on
neighbouring multiprocessors, each able to read the others' shared memory. The tiles here are laid out
[S, R, W + pad] (``tiles_shape``): tile s holds columns [s W, (s + 1) W) of an R x (S W) array, row-major with its
rows W + pad elements apart, so that CTA s of the cluster reads tile s of every CTA (``load_peer_tile``): each CTA
reduces its 1 / S of the columns over all S CTAs, in CTA order: ``load_peer_tile`` reads one such tile in the WGMMA
layout (8 bytes a thread a load), ``merge_tiles`` reads and weighs all of them in a wider layout (16 bytes a load).

Why the padding: in the WGMMA layout a warp's transfer covers 8 rows x 8 columns (4 lanes a row, 2 fp32 each). With
rows W x 4 bytes apart and W a multiple of 32, all 8 rows fall in the same 8 of the 32 banks: every store and load
takes eight shared-memory wavefronts where two would do. With the rows 8 banks apart (W + pad = 8 mod 32
elements), a transfer's 8 rows cover all 32 banks twice over, once a wavefront, and it is conflict-free
(``optimized=True`` checks it when the kernel is built). ``merge_tiles`` loads 16 bytes a lane (a warp's 8 rows x
16 columns, 4 consecutive fp32 a lane), a quarter of a warp (two rows' 16 columns) a wavefront: those two rows must
lie 16 banks apart (``tiles_shape(..., wide=True)``), and the WGMMA layout's stores then alternate which 8-column
tile a half of the warp writes first (Mosaic GPU's staggered transfer plan) to stay conflict-free.

Why raw pointers: ``plgpu.cluster_ref`` maps a reference to a peer's shared memory, but in jax 0.11.2 its Warpgroup
lowering fails on any reference at a nonzero offset (the mapped memref drops the offset its type still carries), so
only whole allocations can be read that way (a kernel's [R] row statistics: ``plgpu.load(plgpu.cluster_ref(ref,
...))``). Here the mapping is done on the raw memrefs in ``inline_mgpu`` (``mosaic.gpu.utils.get_cluster_ref``), and
the slices are taken after it.

The cluster is one-dimensional (its CTAs along CUDA's x). GPU only: the Mosaic GPU interpreter has no distributed
shared memory and runs no ``inline_mgpu``. Letters: R rows (a multiple of 64), S tiles (CTAs of the cluster), W
columns a tile (a multiple of 8).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, gpu, llvm
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from dijax.kernels.fp4_wgmma import ROW_LAYOUT

# ``merge_tiles``' layout: the WGMMA layout's rows, 4 consecutive columns a thread (a warp's 8 x 16 columns); the
# tile widths it takes are multiples of WIDE_COLUMNS
WIDE_LAYOUT = mgpu.WGMMA_LAYOUT_UPCAST_2X
WIDE_COLUMNS = 16


def tiles_shape(tiles: int, rows: int, width: int, wide: bool = False) -> tuple[int, int, int]:
    """The shape of a CTA's fp32 tiles in shared memory for ``store_tiles``: [S, R, W + pad], the pad putting
    consecutive rows 8 banks apart, or 16 for ``merge_tiles`` (``wide``; module docstring)."""
    return tiles, rows, width + ((16 if wide else 8) - width) % 32


def sync() -> None:
    """Every thread of every CTA of the cluster meets here: each thread's shared-memory writes before it are seen
    by every thread's reads after it, in any CTA. All threads of all CTAs must reach it."""
    arrive()
    wait()


@plgpu.inline_mgpu()
def arrive(ctx) -> None:
    """The first half of ``sync``: this thread has arrived (``barrier.cluster.arrive`` with release: its
    shared-memory accesses before it are done for whoever waits). Every thread's next ``wait`` ends once all threads
    of all CTAs have arrived; between the two it may go on with work of its own."""
    del ctx
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "barrier.cluster.arrive.release.aligned;", "",
                    has_side_effects=True)


@plgpu.inline_mgpu()
def wait(ctx) -> None:
    """The second half of ``sync``: wait until every thread of every CTA has arrived (with acquire)."""
    del ctx
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "barrier.cluster.wait.acquire.aligned;", "",
                    has_side_effects=True)


def store_tiles(x_RC: jax.Array, tiles_ref) -> None:
    """Write the fp32 WGMMA-layout array ``x_RC`` (R x S W) into this CTA's ``tiles_ref`` (SMEM fp32
    ``tiles_shape(S, R, W)``, row-major padded tiles: module docstring)."""
    s = tiles_ref.shape[0]
    w = x_RC.shape[1] // s

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def store(ctx, x, ref):
        del ctx
        for tile in range(s):
            x[:, tile * w:(tile + 1) * w].store_untiled(_tile(ref, tile, w), optimized=True)

    store(x_RC, tiles_ref)


def load_peer_tile(tiles_ref, peer: int, width: int) -> jax.Array:
    """The tile of CTA ``peer`` (its index in the cluster) that this CTA reduces: tile ``c`` of that CTA's
    ``tiles_ref`` (SMEM fp32 ``tiles_shape(S, R, W)``, written there by ``store_tiles`` before a ``sync``), c this
    CTA's index; W = ``width``. -> fp32 [R, W], WGMMA layout."""
    r, w = tiles_ref.shape[1], width

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                       return_type=plgpu.ShapeDtypeStruct((r, w), jnp.float32, layout=plgpu.Layout.WGMMA))
    def load(ctx, ref):
        del ctx
        index = ir.IndexType.get()
        remote = mgpu_utils.get_cluster_ref(ref, gpu.Dimension.x, arith.constant(index, peer), generic=False)
        tile = _tile(remote, gpu.cluster_block_id(gpu.Dimension.x), w)
        return mgpu.FragmentedArray.load_untiled(tile, layout=mgpu.WGMMA_LAYOUT, optimized=True)

    return load(tiles_ref)


def merge_tiles(tiles_ref, weights_S: list[jax.Array], den_R: jax.Array, width: int) -> jax.Array:
    """This CTA's 1 / S of the columns merged over the cluster: sum over CTAs p, in CTA order, of tile c of CTA p's
    ``tiles_ref`` (SMEM fp32 ``tiles_shape(S, R, W, wide=True)``, written by ``store_tiles`` before a ``sync``; c
    this CTA's index) times ``weights_S[p]`` (fp32 [R] a row, ``ROW_LAYOUT``), divided by ``den_R`` (fp32 [R]) and
    rounded to bf16: what ``load_peer_tile``'s tiles, weighed and added in that order, give, with the tiles read 16
    bytes a load (4 consecutive fp32 of a row a thread: ``WIDE_LAYOUT``, whose rows are the WGMMA layout's, so a
    row's value broadcasts the same way). W = ``width``, a multiple of ``WIDE_COLUMNS``. -> bf16 [R, W], WGMMA
    layout."""
    r, w = tiles_ref.shape[1], width
    if w % WIDE_COLUMNS:
        raise ValueError(f"merge_tiles: width must be a multiple of {WIDE_COLUMNS}, got {w}")

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), [ROW_LAYOUT] * len(weights_S), ROW_LAYOUT),
                       return_type=plgpu.ShapeDtypeStruct((r, w), jnp.bfloat16, layout=plgpu.Layout.WGMMA))
    def merge(ctx, ref, weights, den):
        del ctx
        index = ir.IndexType.get()
        merged = None
        for peer, weight in enumerate(weights):
            remote = mgpu_utils.get_cluster_ref(ref, gpu.Dimension.x, arith.constant(index, peer), generic=False)
            tile = _tile(remote, gpu.cluster_block_id(gpu.Dimension.x), w)
            part = mgpu.FragmentedArray.load_untiled(tile, layout=WIDE_LAYOUT, optimized=True) * _rows(weight, r, w)
            merged = part if merged is None else merged + part
        out = merged / _rows(den, r, w)
        return out.astype(ir.BF16Type.get()).to_layout(mgpu.WGMMA_LAYOUT)

    return merge(tiles_ref, list(weights_S), den_R)


def _rows(x_R, rows: int, width: int):
    """The row-layout fp32 ``x_R`` (a value a row: ``ROW_LAYOUT``) broadcast along [rows, width] in
    ``WIDE_LAYOUT``. Its rows' layout is the WGMMA layout's, written as lanes (row, 2, 2) where the WGMMA row layout
    writes (row, 4): the same registers on the same threads (tests/test_kernels_sparse_attn_mgpu.py checks it),
    relabelled for the broadcast (which compares the layouts as written)."""
    rows_layout = WIDE_LAYOUT.reduce((1,))
    relabelled = mgpu.FragmentedArray(_registers=x_R.registers, _layout=rows_layout, _is_signed=x_R.is_signed)
    return relabelled.broadcast_in_dim((rows, width), (0,), WIDE_LAYOUT)


def _tile(ref, tile, width: int):
    """Tile ``tile`` (an int or an index value) of the raw tiles memref ``ref``, its padding cut off: [R, W]."""
    return mgpu_utils.memref_slice(ref, (tile, slice(None), slice(0, width)))
