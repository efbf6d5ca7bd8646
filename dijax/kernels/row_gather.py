"""Rows gathered by index into wgmma's shared-memory operand layout, with ``cp.async`` (Mosaic GPU, sm_90).

Mosaic GPU has no gather, and a TMA copy cannot address one row of a swizzled tile (a TMA gather, ``tile::gather4``,
is Blackwell's). Here each thread of the warpgroups that share a block copies 16-byte chunks of the rows itself
(``gather_rows``): the source address from the row's index, the destination address where Mosaic GPU's own tiled
copies put that chunk in a tile with the tiling (8, 64) and the 128-byte swizzle (``TILED``): a 16-byte chunk's
index within its 128-byte line, XOR the line's index within its 1024-byte group (its ``transfer_tiled``). An index
outside the sources reads nothing and fills its row with zeros (``cp.async``'s source size 0).

The copies are asynchronous: each thread closes its group of copies (``commit_group``), waits for its own groups
(``wait_group``), and then the threads that read the tile need ``plgpu.commit_smem()`` (the proxy fence that shows
the writes to wgmma, and a warpgroup barrier) and, across warpgroups, a barrier every thread arrives on. The Mosaic
GPU interpreter runs none of this (no ``inline_mgpu``): a kernel's interpret mode stores the rows itself.

Used by ``sparse_attn_mgpu`` (attention rows) and ``indexer_mgpu`` (index keys). Letters: R = ``ROWS`` rows a
block, K row width (bf16 elements), P parts of K (one a warpgroup).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, gpu, llvm, nvvm
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # rows a block
COPY_BYTES = 16  # one cp.async
WARPGROUP = 128  # threads
TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # wgmma's operand layout in shared memory


def interpreter(interpret: bool | plgpu.InterpretGPUParams) -> plgpu.InterpretGPUParams | None:
    """A kernel's ``plgpu.kernel(interpret=...)`` for its ``interpret`` argument: None (run on the GPU), the
    interpreter's default parameters (True), or the ``InterpretGPUParams`` given (e.g. ``detect_races=True``)."""
    if not interpret:
        return None
    return interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams()


def widths(threads: int) -> tuple[int, ...]:
    """The row widths K (bf16 elements, multiples of 64) whose 16-byte chunks ``threads`` threads split evenly."""
    return tuple(k for k in (64, 128, 256, 512, 1024) if threads % (k // 8) == 0 and ROWS % (threads // (k // 8)) == 0)


def commit_group(interpret: bool = False) -> None:
    """``cp.async.commit_group``: close this thread's group of copies (an empty one where it issued none). Nothing
    when ``interpret`` (the interpreter runs no ``inline_mgpu``; a kernel's interpret mode stores its rows itself)."""
    if not interpret:
        _commit_group()


@plgpu.inline_mgpu()
def _commit_group(ctx) -> None:
    del ctx
    nvvm.cp_async_commit_group()


def wait_group(pending: int, interpret: bool = False) -> None:
    """``cp.async.wait_group pending``: all but this thread's last ``pending`` groups have landed. Nothing when
    ``interpret``."""
    if interpret:
        return

    @plgpu.inline_mgpu()
    def wait(ctx) -> None:
        del ctx
        nvvm.cp_async_wait_group(pending)
    wait()


def read_only_ref(transforms: tuple = ()) -> plgpu.RefType:
    """``inline_mgpu``'s type of a reference its code only reads. From jax 0.12.1 a ``RefType`` is read and written
    unless told otherwise, and a kernel's inputs must not be written (they are arrays, not Refs); before, the type
    had no such fields."""
    if "write" in {field.name for field in dataclasses.fields(plgpu.RefType)}:
        return plgpu.RefType(transforms, write=False)
    return plgpu.RefType(transforms)


def gather_rows(idx_ref, *refs, sizes: tuple[int, ...], threads: int) -> None:
    """Start the ``cp.async`` copies of one block of ``ROWS`` rows: row r of the block is row ``idx_ref[r]`` (GMEM
    or SMEM int32 [R]) of the sources' concatenation (``refs[:-1]``, GMEM bf16 [``sizes``[i], K]), copied into the tile
    ``refs[-1]`` (SMEM bf16 [P, R, K / P] or [R, K], ``TILED``; part p holds the columns [p K / P, (p + 1) K / P)).

    ``threads``: the threads that share the block, each running this: the CTA's 128 P compute threads, or 128 for
    a warpgroup filling a tile of its own (thread index taken modulo 128). Thread i copies the 16-byte chunk
    ``i mod (K / 8)`` of the rows ``i div (K / 8)`` + multiples of ``threads / (K / 8)``: consecutive threads copy
    consecutive bytes of one row. K must be in ``widths(threads)``."""
    k = refs[0].shape[-1]
    tile_shape = refs[-1].shape
    parts = tile_shape[0] if len(tile_shape) == 3 else 1
    part = k // parts
    chunks = k * 2 // COPY_BYTES  # 16-byte chunks a row
    if k not in widths(threads) or part % 64:
        raise ValueError(f"gather_rows: row width K={k} in {parts} parts must be one of {widths(threads)} for "
                         f"{threads} threads, each part a multiple of 64")
    step = threads // chunks  # rows a pass of the threads
    bases = np.cumsum((0,) + tuple(sizes)).tolist()

    @plgpu.inline_mgpu(arg_types=(read_only_ref(),) * len(refs) + (plgpu.RefType(TILED),))
    def gather(ctx, idx, *refs):
        del ctx
        *srcs, dst = refs
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        c32 = lambda v: arith.constant(i32, v)
        tid = arith.remui(arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x)), c32(threads))
        first = arith.divui(tid, c32(chunks))
        col = arith.muli(arith.remui(tid, c32(chunks)), c32(8))  # the chunk's first element in the row
        # where the chunk lies in a row of the tile: its part, 64-wide column tile, 16-byte index in the tile
        col_in = arith.remui(col, c32(part))
        sixteenth = arith.remui(arith.divui(col_in, c32(8)), c32(8))
        tile_base = arith.addi(arith.muli(arith.divui(col, c32(part)), c32(ROWS * part * 2)),
                               arith.muli(arith.divui(col_in, c32(64)), c32(1024)))
        idx_ptr = mgpu_utils.memref_ptr(idx)  # shared memory's own address space, or generic: made global
        if not mgpu_utils.is_smem_ref(idx):
            idx_ptr = _global(idx_ptr)
        src_ptrs = [_global(mgpu_utils.memref_ptr(src)) for src in srcs]
        dst_ptr = mgpu_utils.memref_ptr(dst)
        rows = [arith.addi(first, c32(r)) for r in range(0, ROWS, step)]
        # every index loaded before the first copy: a copy's shared-memory writes could alias an index in shared
        # memory, so a load after it would wait for it (a load's latency a copy)
        indices = [llvm.load(i32, mgpu_utils.getelementptr(idx_ptr, [row], i32)) for row in rows]
        for row, index in zip(rows, indices):
            valid = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, index, c32(0)),
                               arith.cmpi(arith.CmpIPredicate.slt, index, c32(bases[-1])))
            # the source the row lives in and its row there; outside them, row 0 of the first (nothing is read)
            src, local = locate(arith.select(valid, index, c32(0)), bases[:-1], src_ptrs, arith.select,
                                lambda a, b: arith.cmpi(arith.CmpIPredicate.sge, a, c32(b)),
                                lambda a, b: arith.subi(a, c32(b)))
            element = arith.addi(arith.muli(arith.extui(i64, local), arith.constant(i64, k)), arith.extui(i64, col))
            src_addr = mgpu_utils.getelementptr(src, [element], ir.BF16Type.get())
            line = arith.remui(row, c32(8))
            offset = arith.addi(
                arith.addi(tile_base, arith.muli(arith.divui(row, c32(8)), c32(part // 64 * 1024))),
                arith.addi(arith.muli(line, c32(128)), arith.muli(arith.xori(sixteenth, line), c32(COPY_BYTES))))
            dst_addr = mgpu_utils.getelementptr(dst_ptr, [offset], ir.IntegerType.get_signless(8))
            size = arith.select(valid, c32(COPY_BYTES), c32(0))
            nvvm.cp_async_shared_global(dst_addr, src_addr, COPY_BYTES, nvvm.LoadCacheModifierKind.CG,
                                        cp_size=size)

    gather(idx_ref, *refs)


def locate(index, firsts, choices, select, at_least, minus):
    """The source of a row of the sources' concatenation and its row there, as a chain of selects: (``choices[i]``,
    ``index - firsts[i]``) for the last i with ``index >= firsts[i]`` (``firsts``: the sources' first rows, from 0).
    The operations are arguments so that the kernel's MLIR (``arith``) and a CPU test's numpy run this same code."""
    choice, local = choices[0], index
    for first, other in zip(firsts[1:], choices[1:]):
        past = at_least(index, first)
        choice = select(past, other, choice)
        local = select(past, minus(index, first), local)
    return choice, local


def gather_rows_mgpu(sources: tuple[jax.Array, ...], idx_L: jax.Array, parts: int = 1) -> jax.Array:
    """``gather_rows`` alone, as a kernel of ``parts`` warpgroups: each block of ``ROWS`` indices gathered into a
    tile, then the tile stored by TMA (which undoes the swizzle Mosaic GPU's layout puts on it). -> bf16 [L, K], row
    l the sources' row ``idx_L[l]``, zero outside them. For the GPU test that checks the gather's addresses apart
    from any kernel that uses it; L a multiple of ``ROWS``; a GPU of compute capability 9.0."""
    (length,), k = idx_L.shape, sources[0].shape[-1]
    sizes, part = tuple(src.shape[0] for src in sources), k // parts

    def kernel(idx_gmem, *refs):
        *src_gmems, out_gmem = refs
        b, wg = lax.axis_index("b"), lax.axis_index("wg")

        def body(tile_smem, meeting):
            gather_rows(idx_gmem.at[pl.ds(b * ROWS, ROWS)], *src_gmems, tile_smem, sizes=sizes,
                        threads=parts * WARPGROUP)
            commit_group()
            wait_group(0)
            plgpu.commit_smem()
            plgpu.barrier_arrive(meeting)  # every thread's copies landed
            plgpu.barrier_wait(meeting)
            plgpu.copy_smem_to_gmem(tile_smem.at[wg], out_gmem.at[pl.ds(b * ROWS, ROWS), pl.ds(wg * part, part)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(body, plgpu.SMEM((parts, ROWS, part), jnp.bfloat16, transforms=TILED),
                      plgpu.Barrier(num_arrivals=parts), collective_axes="wg")

    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((length, k), jnp.bfloat16), grid=(length // ROWS,), grid_names=("b",),
        num_threads=parts, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(idx_L.astype(jnp.int32), *sources)


def _global(ptr: ir.Value) -> ir.Value:
    """A generic pointer into GMEM as a global-space (address space 1) one, as ``cp.async`` takes it."""
    return llvm.addrspacecast(llvm.PointerType.get(address_space=1), ptr)
