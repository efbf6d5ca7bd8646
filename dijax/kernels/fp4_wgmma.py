"""MXFP4 expert weights times token tiles on Hopper's tensor cores (Mosaic GPU): ``grouped_gemm_t``.

Status: correct and timed on the H200 (docs/benchmarks.md, twenty-eighth session); the model does not call it yet.
It is the first tensor-core kernel whose operand layouts we control, the building block of issue 12's prefill path.
Rates (H200, jax 0.11.2; docs/benchmarks.md's measured bf16 ceiling is 790 TFLOP/s):
  * one expert's weights, F x K = 36864 x 5120 (the prototype of this kernel, 4 stages): 391 TFLOP/s with 128
    tokens a tile, 549 with 256; a dense 4608 x 5120 x 4096: 675 (XLA's bf16 dot of already-decoded weights: 769);
  * grouped at prefill 8192 (``tools/bench_kernels.py --only fp4_wgmma``): ~257 TFLOP/s of real work, against the
    Triton grouped GEMM's 236-239. ``tile_layout`` pads each expert to whole 128-row tiles (a third of the work
    here), and each K step waits for its own wgmma (no overlap of decode and tensor cores inside a warpgroup):
    the two things to fix before the model takes it.

Why transposed: wgmma takes its A operand from registers, so the MXFP4 weights are decoded there (codes -> bf16
times the block scale) and the tokens are the B operand, read by TMA into shared memory. The weights are read in
their stored layout, as uint32 words of 8 codes: in each 64-wide K step a warpgroup loads a [64, 8] word tile in
the WGMMA layout, so thread (row r, lane q) holds words 2q and 2q + 1 of rows r and r + 8, and each word decodes to
bf16 pairs with two masks and two shifts (``bf16_pairs``' bit trick on whole words, not per code). A word's nibbles
are not the K positions wgmma's fragment gives that thread, so the activations take the matching order instead:
``permute_k`` (one gather, which the grouped path pays anyway to sort tokens by expert). One thread's codes of a K
step all fall in one 32-wide scale block (lanes 0-1 the first, 2-3 the second), so its scale is one select.

Letters: E experts, F output features (weight rows), K input features, H = K / 2 packed bytes, W = K / 8 words,
B = K / 32 scale blocks, R token rows (tiles of ``tile_n``), I tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from dijax.kernels import quant

K_STEP = 64  # K per pipeline step: one [64, 64] bf16 A fragment a warpgroup
ROWS_PER_WG = 64  # wgmma's M
ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)  # one value a row of a WGMMA-layout tile
WARPGROUPS = 2  # compute warpgroups a CTA (each its own 64 weight rows), plus one issuing the TMA copies


def permute_k(x_RK: jax.Array) -> jax.Array:
    """The activations' K order the kernel's fragments expect: in each 64-wide chunk, position
    16j + 8h + 2q + e holds input feature 16q + 8h + 4e + j (j, q < 4; h, e < 2). [..., K] -> [..., K]."""
    *lead, k = x_RK.shape
    x = x_RK.reshape(*lead, k // K_STEP, 4, 2, 2, 4)  # chunk, q, h, e, j
    n = len(lead)
    x = jnp.moveaxis(x, (n + 1, n + 2, n + 3, n + 4), (n + 3, n + 2, n + 4, n + 1))  # chunk, j, h, q, e
    return x.reshape(*lead, k)


def grouped_gemm_t_reference(w_EFH: jax.Array, s_EFB: jax.Array, x_RK: jax.Array, tile_expert_I: jax.Array, *,
                             tile_n: int = 128) -> jax.Array:
    """bf16 y_FR [F, R]: tile i of x_RK (natural K order) times expert tile_expert_I[i]'s MXFP4 weight (uint8 codes
    w_EFH [E, F, K/2], ue8m0 s_EFB [E, F, K/32]), transposed; zeros where the expert is negative."""
    n_tiles = tile_expert_I.shape[0]
    e_I = jnp.maximum(tile_expert_I, 0)
    w_IFK = quant.dequant_fp4_weight(w_EFH[e_I], s_EFB[e_I])
    x_INK = x_RK.reshape(n_tiles, tile_n, -1)
    y_FIN = jnp.einsum("ifk,ink->fin", w_IFK, x_INK, preferred_element_type=jnp.float32)
    y_FIN = jnp.where(tile_expert_I[None, :, None] >= 0, y_FIN, 0.0)
    return y_FIN.reshape(y_FIN.shape[0], -1).astype(jnp.bfloat16)


def grouped_gemm_t_mgpu(w_EFH: jax.Array, s_EFB: jax.Array, x_RK: jax.Array, tile_expert_I: jax.Array, *,
                        tile_n: int = 128, stages: int = 4) -> jax.Array:
    """``grouped_gemm_t_reference`` as one Mosaic GPU kernel (a GPU of compute capability 9.0). Tiles with a
    negative expert are left unwritten. F must be a multiple of 128, K of 64, R of ``tile_n`` (<= 256). Exact for
    ue8m0 bytes <= 128 (the scale multiplier 2^(s - 1) is a bf16; released checkpoints sit near 119); the engine's
    scale-range check (dijax.kernels.scale_range) must cover it before the model calls it.

    The wrapper views the codes as uint32 words, permutes x's K (``permute_k``) and transposes the scales to
    [E, K/32, F] (each step's scales of 128 rows are then one 128-byte TMA row); those two are XLA passes.
    """
    n_experts, f, h = w_EFH.shape
    k = 2 * h
    n_tiles = tile_expert_I.shape[0]
    if tile_n % 8 or not 8 <= tile_n <= 256:
        raise ValueError(f"grouped_gemm_t: tile_n must be a multiple of 8 in [8, 256] (wgmma's N), got {tile_n}")
    if f % (WARPGROUPS * ROWS_PER_WG) or k % K_STEP or x_RK.shape != (n_tiles * tile_n, k):
        raise ValueError(f"grouped_gemm_t: F {f} must be a multiple of 128, K {k} of 64, and x [R, K] with R = "
                         f"tiles x tile_n, got x {x_RK.shape}, {n_tiles} tiles of {tile_n}")
    w_EFW = lax.bitcast_convert_type(w_EFH.reshape(n_experts, f, k // 8, 4), jnp.uint32)
    s_EBF = jnp.swapaxes(s_EFB, 1, 2)
    return _call(w_EFW, s_EBF, permute_k(x_RK), tile_expert_I.astype(jnp.int32), tile_n=tile_n, stages=stages)


@functools.partial(jax.jit, static_argnames=("tile_n", "stages"))
def _call(w_EFW, s_EBF, x_RK, tile_expert_I, *, tile_n: int, stages: int):
    f, k = w_EFW.shape[1], w_EFW.shape[2] * 8
    cta_rows = WARPGROUPS * ROWS_PER_WG

    def kernel(tile_expert_ref, w_gmem, s_gmem, x_gmem, y_gmem, y_smem):
        m, i = lax.axis_index("m"), lax.axis_index("i")
        e = tile_expert_ref[i]

        def step(_, w_smem, x_smem, s_smem, acc_ref):
            wg = lax.axis_index("wg")
            rows = pl.ds(wg * ROWS_PER_WG, ROWS_PER_WG)
            words = plgpu.load(w_smem.at[rows], layout=plgpu.Layout.WGMMA)
            s_lo, s_hi = (plgpu.load(s_smem.at[b, rows], layout=ROW_LAYOUT).astype(jnp.uint16) for b in range(2))
            plgpu.wgmma(acc_ref, _decode(words, s_lo, s_hi), x_smem.T)
            plgpu.wgmma_wait(0)
            return acc_ref

        def epilogue(run_pipeline):
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((ROWS_PER_WG, tile_n), jnp.float32))
            def _(acc_ref):
                run_pipeline(acc_ref)
                wg = lax.axis_index("wg")
                y_smem[wg] = acc_ref[...].astype(jnp.bfloat16)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(y_smem.at[wg], y_gmem.at[pl.ds(m * cta_rows + wg * ROWS_PER_WG, ROWS_PER_WG),
                                                                 pl.ds(i * tile_n, tile_n)])
                plgpu.wait_smem_to_gmem(0)

        spec = plgpu.BlockSpec
        pipeline = plgpu.emit_pipeline_warp_specialized(
            step, grid=(k // K_STEP,), memory_registers=40, wg_axis="wg", num_compute_wgs=WARPGROUPS,
            max_concurrent_steps=stages, compute_context=epilogue,
            in_specs=[spec((cta_rows, K_STEP // 8), lambda s: (0, s),
                           transforms=(plgpu.TilingTransform((8, 8)), plgpu.SwizzleTransform(32))),
                      spec((tile_n, K_STEP), lambda s: (0, s),
                           transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))),
                      spec((2, cta_rows), lambda s: (s, 0))])

        @pl.when(e >= 0)
        def _():
            pipeline(w_gmem.at[e, pl.ds(m * cta_rows, cta_rows)], x_gmem.at[pl.ds(i * tile_n, tile_n)],
                     s_gmem.at[e, :, pl.ds(m * cta_rows, cta_rows)])

    run = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((f, x_RK.shape[0]), jnp.bfloat16),
        grid=(f // cta_rows, tile_expert_I.shape[0]), grid_names=("m", "i"), num_threads=WARPGROUPS + 1,
        thread_name="wg", scratch_types=dict(y_smem=plgpu.SMEM((WARPGROUPS, ROWS_PER_WG, tile_n), jnp.bfloat16)),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return run(tile_expert_I, w_EFW, s_EBF, x_RK)


@plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, ROW_LAYOUT, ROW_LAYOUT),
                   return_type=plgpu.ShapeDtypeStruct((64, 64), jnp.bfloat16, layout=plgpu.Layout.WGMMA))
def _decode(ctx, words, s_lo, s_hi):
    """The register-level decode (Mosaic GPU's own arrays): words uint32 [64, 8] in the WGMMA layout and the rows'
    two ue8m0 bytes of this K step (uint16 [64] each) -> bf16 [64, 64] in the WGMMA layout, in ``permute_k``'s
    K order."""
    del ctx
    i32, bf16 = ir.IntegerType.get_signless(32), ir.BF16Type.get()
    layout = mgpu.WGMMA_LAYOUT
    lane_q = arith.remui(mgpu.utils.thread_idx(), arith.constant(i32, 4))
    first_block = arith.cmpi(arith.CmpIPredicate.ult, lane_q, arith.constant(i32, 2))
    # 2^(s - 1) as bf16: times a decoded code (e2m1 * 2^-126) it is e2m1 * 2^(s - 127)
    lo, hi = (((s + 126) << 7).bitcast(bf16).broadcast_in_dim((64, 16), (0,), layout) for s in (s_lo, s_hi))
    scale = np.empty(lo.registers.shape, dtype=object)
    for idx, reg in np.ndenumerate(lo.registers):
        scale[idx] = arith.select(first_block, reg, hi.registers[idx])
    out = np.empty(layout.registers_shape((64, 64)), dtype=object)
    const = lambda reg, v: vector.broadcast(reg.type, arith.constant(i32, v))
    for j in range(4):  # nibbles j and j + 4 of each word: columns 16j .. 16j + 15 of the fragment
        regs = np.empty(layout.registers_shape((64, 16)), dtype=object)
        for idx, reg in np.ndenumerate(words.registers):  # vector<2 x i32>: the thread's words 2q and 2q + 1
            v = arith.shrui(reg, const(reg, 4 * j)) if j else reg
            bits = arith.ori(arith.shli(arith.andi(v, const(reg, 0x00070007)), const(reg, 6)),
                             arith.shli(arith.andi(v, const(reg, 0x00080008)), const(reg, 12)))
            pairs = vector.bitcast(ir.VectorType.get([4], bf16), bits)
            for h in range(2):  # word 2q + h -> the fragment's column tile h (columns 8h + 2q, 8h + 2q + 1)
                regs[(idx[0], h, *idx[2:])] = vector.extract_strided_slice(
                    ir.VectorType.get([2], bf16), pairs, [2 * h], [2], [1])
        tile = mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)
        tile = tile * mgpu.FragmentedArray(_registers=scale, _layout=layout, _is_signed=None)
        for idx, reg in np.ndenumerate(tile.registers):
            out[(idx[0], 2 * j + idx[1], *idx[2:])] = reg
    return mgpu.FragmentedArray(_registers=out, _layout=layout, _is_signed=None)
