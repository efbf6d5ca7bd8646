"""MXFP4 expert weights times token tiles on Hopper's tensor cores (Mosaic GPU): ``grouped_gemm_t``.

Status: correct and timed on the H200 (docs/benchmarks.md, twenty-eighth session). The routed experts' ragged path
runs on it with ``routed_experts.KernelConfig.gemm_engine='mgpu'``, which is off by default: GPU parity holds, but
the XLA passes around its transposed outputs make the layer slower than the Triton kernels (20.6 against 14.7 ms at
8192 tokens). It is the first tensor-core kernel whose operand layouts we control, and the building block of issue
12's prefill path. Rates (H200, jax 0.11.2; docs/benchmarks.md's measured bf16 ceiling is 790 TFLOP/s):
  * one expert's weights, F x K = 36864 x 5120 (the prototype of this kernel, 4 stages, one K chunk a step): 391
    TFLOP/s with 128 tokens a tile, 549 with 256; a dense 4608 x 5120 x 4096: 675 (XLA's bf16 dot of
    already-decoded weights: 769);
  * grouped at prefill 8192 (128-token tiles, 4 stages, 2 K chunks a step): 266 TFLOP/s of real work on the gate-up
    weights, 260 on the down weight; the Triton grouped GEMMs run at 236-239. ``tile_layout`` pads each expert to
    whole 128-row tiles (a third of the work here).

Why transposed: wgmma takes its A operand from registers, so the MXFP4 weights are decoded there (codes -> bf16
times the block scale) and the tokens are the B operand, read by TMA into shared memory. The weights are read in
their stored layout, as uint32 words of 8 codes (``routed_experts.pack_words``, a bitcast): in each 64-wide K
step a warpgroup loads a [64, 8] word tile in the WGMMA layout, so thread (row r, lane q) holds words 2q and
2q + 1 of rows r and r + 8, and each word decodes to bf16 pairs with two masks and two shifts (``bf16_pairs``' bit
trick on whole words, not per code). A word's nibbles are not the K positions wgmma's fragment gives that thread,
so the activations take the matching order instead: ``permute_k`` (one gather, which the grouped path pays anyway
to sort tokens by expert). One thread's codes of a K step all fall in one 32-wide scale block (lanes 0-1 the first,
2-3 the second), so its scale is one select.

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

K_CHUNK = 64  # K of one [64, 64] bf16 A fragment (one decode, one wgmma)
# The decoded weights are e2m1 * 2^(s - 127 - SCALE_SHIFT) (bf16, exact and normal for ue8m0 bytes s in
# SCALE_RANGE); the fp32 accumulator is multiplied back by 2^SCALE_SHIFT. routed_experts' Triton grouped GEMM
# takes the same shift and range (routed_experts.GEMM_SCALE_RANGE is this), so the engine's check covers both.
SCALE_SHIFT = 32
SCALE_RANGE = (SCALE_SHIFT + 2, 128 + SCALE_SHIFT)
ROWS_PER_WG = 64  # wgmma's M
ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)  # one value a row of a WGMMA-layout tile
COL_LAYOUT = plgpu.Layout.WGMMA.reduce(0)  # one value a column of a WGMMA-layout tile
WARPGROUPS = 2  # compute warpgroups a CTA (each its own 64 weight rows), plus one issuing the TMA copies


def permute_k(x_RK: jax.Array) -> jax.Array:
    """The activations' K order the kernel's fragments expect: in each 64-wide chunk, position
    16j + 8h + 2q + e holds input feature 16q + 8h + 4e + j (j, q < 4; h, e < 2). [..., K] -> [..., K]."""
    *lead, k = x_RK.shape
    x = x_RK.reshape(*lead, k // K_CHUNK, 4, 2, 2, 4)  # chunk, q, h, e, j
    n = len(lead)
    x = jnp.moveaxis(x, (n + 1, n + 2, n + 3, n + 4), (n + 3, n + 2, n + 4, n + 1))  # chunk, j, h, q, e
    return x.reshape(*lead, k)


def grouped_gemm_t_reference(w_EFW: jax.Array, s_EFB: jax.Array, x_RK: jax.Array, tile_expert_I: jax.Array, *,
                             tile_n: int = 128, stages: int = 4, chunks: int = 2) -> jax.Array:
    """bf16 y_FR [F, R]: tile i of x_RK (natural K order) times expert tile_expert_I[i]'s MXFP4 weight (uint32 words
    w_EFW [E, F, K/8], nibble j of word w the code of k = 8w + j, as ``routed_experts.pack_words`` gives them;
    ue8m0 s_EFB [E, F, K/32]), transposed; zeros where the expert is negative. ``stages`` and ``chunks`` are the
    kernel's and change nothing here."""
    del stages, chunks
    n_tiles = tile_expert_I.shape[0]
    e_I = jnp.maximum(tile_expert_I, 0)
    w = w_EFW[e_I]
    w_IFH = lax.bitcast_convert_type(w, jnp.uint8).reshape(*w.shape[:-1], -1)
    w_IFK = quant.dequant_fp4_weight(w_IFH, s_EFB[e_I])
    x_INK = x_RK.reshape(n_tiles, tile_n, -1)
    y_FIN = jnp.einsum("ifk,ink->fin", w_IFK, x_INK, preferred_element_type=jnp.float32)
    y_FIN = jnp.where(tile_expert_I[None, :, None] >= 0, y_FIN, 0.0)
    return y_FIN.reshape(y_FIN.shape[0], -1).astype(jnp.bfloat16)


def shape_error(f: int, k: int, tile_n: int, chunks: int) -> str | None:
    """Why the kernel cannot take F = ``f`` weight rows, K = ``k``, ``tile_n`` and ``chunks`` (None when it can)."""
    if tile_n % 8 or not 8 <= tile_n <= 256:
        return f"grouped_gemm_t: tile_n must be a multiple of 8 in [8, 256] (wgmma's N), got {tile_n}"
    if chunks not in (1, 2):
        return f"grouped_gemm_t: chunks must be 1 or 2, got {chunks}"
    if f % (WARPGROUPS * ROWS_PER_WG) or k % (chunks * K_CHUNK):
        return (f"grouped_gemm_t: F {f} must be a multiple of {WARPGROUPS * ROWS_PER_WG} and K {k} of "
                f"{chunks * K_CHUNK} ({chunks} chunks of {K_CHUNK})")
    return None


def available() -> bool:
    """Whether the default device can run the kernel: a GPU of compute capability 9.x (wgmma)."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")


def grouped_gemm_t_mgpu(w_EFW: jax.Array, s_EFB: jax.Array, x_RK: jax.Array, tile_expert_I: jax.Array, *,
                        tile_n: int = 128, stages: int = 4, chunks: int = 2) -> jax.Array:
    """``grouped_gemm_t_reference`` as one Mosaic GPU kernel (a GPU of compute capability 9.0). Tiles with a
    negative expert are left unwritten. ``shape_error`` lists the sizes it takes; exact for ue8m0 bytes in
    ``SCALE_RANGE``. ``stages``: pipeline depth; ``chunks``: 64-wide K chunks a pipeline step (1 or 2: with 2, the
    decode of the second overlaps the first's wgmma).

    The wrapper permutes x's K (``permute_k``) and transposes the scales to [E, K/32, F] (a step's scales of 128
    rows are then 128-byte TMA rows): two XLA passes.
    """
    f, k = w_EFW.shape[1], 8 * w_EFW.shape[2]
    error = shape_error(f, k, tile_n, chunks)
    if error:
        raise ValueError(error)
    if x_RK.shape != (tile_expert_I.shape[0] * tile_n, k):
        raise ValueError(f"grouped_gemm_t: x must be [tiles x tile_n, K] = [{tile_expert_I.shape[0] * tile_n}, {k}], "
                         f"got {x_RK.shape}")
    return _call(w_EFW, jnp.swapaxes(s_EFB, 1, 2), permute_k(x_RK), tile_expert_I.astype(jnp.int32), tile_n=tile_n,
                 stages=stages, chunks=chunks)


@functools.partial(jax.jit, static_argnames=("tile_n", "stages", "chunks"))
def _call(w_EFW, s_EBF, x_RK, tile_expert_I, *, tile_n: int, stages: int, chunks: int):
    f, k = w_EFW.shape[1], w_EFW.shape[2] * 8
    cta_rows = WARPGROUPS * ROWS_PER_WG

    def kernel(tile_expert_ref, w_gmem, s_gmem, x_gmem, y_gmem, y_smem):
        m, i = lax.axis_index("m"), lax.axis_index("i")
        e = tile_expert_ref[i]

        def step(_, *refs):
            *w_smems, x_smem, s_smem, acc_ref = refs
            wg = lax.axis_index("wg")
            rows = pl.ds(wg * ROWS_PER_WG, ROWS_PER_WG)
            for c, w_smem in enumerate(w_smems):  # issue each chunk's wgmma, then decode the next one
                words = plgpu.load(w_smem.at[rows], layout=plgpu.Layout.WGMMA)
                s_lo, s_hi = (plgpu.load(s_smem.at[2 * c + b, rows], layout=ROW_LAYOUT).astype(jnp.uint16)
                              for b in range(2))
                plgpu.wgmma(acc_ref, _decode(words, s_lo, s_hi), x_smem.at[:, pl.ds(c * K_CHUNK, K_CHUNK)].T)
            plgpu.wgmma_wait(0)
            return acc_ref

        def epilogue(run_pipeline):
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((ROWS_PER_WG, tile_n), jnp.float32))
            def _(acc_ref):
                run_pipeline(acc_ref)
                wg = lax.axis_index("wg")
                y_smem[wg] = (acc_ref[...] * np.float32(2.0 ** SCALE_SHIFT)).astype(jnp.bfloat16)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(y_smem.at[wg], y_gmem.at[pl.ds(m * cta_rows + wg * ROWS_PER_WG, ROWS_PER_WG),
                                                                 pl.ds(i * tile_n, tile_n)])
                plgpu.wait_smem_to_gmem(0)

        spec = plgpu.BlockSpec
        words_spec = [spec((cta_rows, K_CHUNK // 8), lambda s, c=c: (0, chunks * s + c),
                           transforms=(plgpu.TilingTransform((8, 8)), plgpu.SwizzleTransform(32)))
                      for c in range(chunks)]
        pipeline = plgpu.emit_pipeline_warp_specialized(
            step, grid=(k // (chunks * K_CHUNK),), memory_registers=40, wg_axis="wg", num_compute_wgs=WARPGROUPS,
            max_concurrent_steps=stages, compute_context=epilogue,
            in_specs=[*words_spec,
                      spec((tile_n, chunks * K_CHUNK), lambda s: (0, s),
                           transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))),
                      spec((2 * chunks, cta_rows), lambda s: (s, 0))])

        @pl.when(e >= 0)
        def _():
            words = w_gmem.at[e, pl.ds(m * cta_rows, cta_rows)]
            pipeline(*([words] * chunks), x_gmem.at[pl.ds(i * tile_n, tile_n)],
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
    # 2^(s - 1 - SCALE_SHIFT) as bf16: times a decoded code (e2m1 * 2^-126) it is e2m1 * 2^(s - 127 - SCALE_SHIFT)
    lo, hi = (((s + (126 - SCALE_SHIFT)) << 7).bitcast(bf16).broadcast_in_dim((64, 16), (0,), layout)
              for s in (s_lo, s_hi))
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
