"""The fp8 block-scaled linear at decode on Hopper's tensor cores (Mosaic GPU): ``linear_mgpu``.

Status (thirty-first session, on the H200): its GPU tests pass, and GPU parity with it on every linear it takes
(up to 32 rows then) equals the Triton kernel's to the printed digits. By GPU kernel time it loses to the Triton
kernel at one row (the 8 flash-slice linears 1.3-2.3x slower) and is mixed at 16, but at 64 rows it ran the 7 layer
linears in 156 us against 262 on the reference and 330 on the Triton kernel. So ``fp8_linear.KernelConfig`` routes
33-64 rows to it (``mgpu_min_tokens`` / ``mgpu_max_tokens``, 2 compute warpgroups), by default.

Why: at decode the fp8 linears are ~30 % of a flash-slice step at batch 1 (docs/benchmarks.md, eighteenth
session), and the Triton kernel (``fp8_linear``) reaches ~1.8 TB/s on the 42 MB linears and 1.9 TB/s on the Engram
``wkv``: it is bound by instruction issue. Here the weights stream by TMA and are decoded word-wise in registers
as wgmma's A operand, as ``fp4_wgmma`` does for the MXFP4 experts: the tokens are the B operand (one tile of up to
256 rows), the accumulator [O, tokens] in fp32.

The decode: a warpgroup loads a [64, 16] tile of uint32 words (4 e4m3 codes each) in the WGMMA layout, so thread
(row r, lane q) holds words 2q, 2q + 1, 8 + 2q and 9 + 2q of rows r and r + 8. Bytes 0 and 2 of a word (and bytes 1
and 3) become one bf16 pair with a shift-and-mask chain (``E4M3_MAGNITUDE_PAIR`` / ``E4M3_SIGN_PAIR``: each half is
the code's value times 2^-120, e4m3 subnormals on bf16 subnormals), then one bf16x2 multiply by 2^(s - 7) gives the
weight e4m3 * 2^(s - 127), exact for ue8m0 bytes s in ``SCALE_RANGE``: the fp8 linear's decode, validated on the
H200 in its Triton form. A word's bytes are not the K positions the fragment gives that thread, so the activations
take the matching order (``permute_k``). The fragment's first four column groups fall in one 32-wide scale block
and the last four in the next, so a register's scale follows from its column group alone.

Scales: the weight's 32 x 32 blocks, spread to one byte a row ([O, I/32], a small XLA pass over one layer's scales),
then read one word a row a step straight from GMEM (``fp4_wgmma.scale_words``), each step's a step ahead (carried
through the pipeline, as ``fp4_wgmma`` does; thirty-fourth session, on an H100: the flash-slice linears at 64 rows
3-6 % faster). With ``block_scales`` the blocks are read in place instead, two words a warpgroup a step, and no XLA
pass spreads them (off: on an H100 its GPU tests and parity passed, and flash-slice's decode step took the same time,
thirty-sixth session).

Split K: a CTA owns 64 (``warpgroups`` 1) or 128 rows and one of ``splits`` parts of K; the parts' fp32 partial
sums [splits, O, N] are added, transposed and rounded to bf16 in XLA (``splits`` chosen so that the grid has about
``target_ctas`` CTAs: the small linears, e.g. wkv 512 x 5120, would otherwise run on 8 CTAs).

Letters: T tokens, N token rows (T padded to a multiple of 8), I input features (K), O output features, L stacked
layers, W = I / 4 words, S = I / 128 pipeline steps (scale words a row), P splits of K.
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

from dijax.kernels import numerics, quant
from dijax.kernels.fp4_wgmma import (K_CHUNK, ROW_LAYOUT, ROWS_PER_WG, WARPGROUPS, available, interpret_operand,
                                     interpret_scratch, pipeline_depth, scale_words)
from dijax.kernels.stacked import LayerSlice, in_place, materialize

CODES_PER_WORD = 4
WORDS = K_CHUNK // CODES_PER_WORD  # words a row of one 64-wide K chunk
CHUNKS = 2  # K chunks a pipeline step (the decode of the second overlaps the first's wgmma)
STEP_K = CHUNKS * K_CHUNK
# Bytes 0 and 2 of a word shifted left by 4 (bytes 1 and 3 right by 4): their 7 magnitude bits on bf16's bits
# 10..4 of each half; the signs land on bits 15 and 31 (after a shift left by 8 for bytes 0 and 2).
E4M3_MAGNITUDE_PAIR, E4M3_SIGN_PAIR = 0x07F007F0, 0x80008000
E4M3_BIAS_FIX = 120  # each decoded half is the code's value times 2^-120 (bf16 bias 127 against e4m3's 7)
# ue8m0 bytes for which the weights are exact normal bf16 values: the smallest code (2^-9) times 2^(s - 127) stays
# >= 2^-126, and the multiplier 2^(s - 7) stays finite. fp8_linear's Triton kernel takes the same range.
SCALE_RANGE = (10, 134)
MAX_TOKENS = 256  # wgmma's N


def permute_k(x_TI: jax.Array) -> jax.Array:
    """The activations' K order the kernel's fragments expect: in each 64-wide chunk, position
    32g + 16p + 8h + 2q + e holds input feature 32g + 8q + 4h + p + 2e (g, p, h, e < 2; q < 4). [..., I] -> [..., I]."""
    *lead, k = x_TI.shape
    x = x_TI.reshape(*lead, k // K_CHUNK, 2, 4, 2, 2, 2)  # chunk, g, q, h, e, p
    n = len(lead)
    x = jnp.moveaxis(x, (n + 1, n + 2, n + 3, n + 4, n + 5), (n + 1, n + 4, n + 3, n + 5, n + 2))  # g, p, h, q, e
    return x.reshape(*lead, k)


def linear_reference(x_TI: jax.Array, weight_OI: jax.Array | LayerSlice, scale_BB: jax.Array | LayerSlice, *,
                     stages: int = 4, warpgroups: int = 1, target_ctas: int = 264, block_scales: bool = False,
                     quantised: bool = False, interpret: bool = False) -> jax.Array:
    """bf16(fq8(x) @ dequant(W).T): x bf16 [T, I], weight e4m3 [O, I], scale ue8m0 [ceil(O/32), I/32] (either may
    be a ``LayerSlice``) -> bf16 [T, O]; ``fp8_linear.fp8_linear_reference``'s semantics. ``quantised``: x holds
    ``quant.fq8``'s values already (not quantised again). ``stages``, ``warpgroups``, ``target_ctas``,
    ``block_scales`` and ``interpret`` are the kernel's and change nothing here."""
    del stages, warpgroups, target_ctas, block_scales, interpret
    w_OI = quant.dequant_fp8_weight(materialize(weight_OI), materialize(scale_BB))
    return numerics.einsum_bf16("ti,oi->to", x_TI if quantised else quant.fq8(x_TI), w_OI)


def shape_error(t: int, o: int, i: int, warpgroups: int) -> str | None:
    """Why the kernel cannot take T = ``t`` tokens, O = ``o``, I = ``i`` and ``warpgroups`` (None when it can)."""
    if not 1 <= t <= MAX_TOKENS:
        return f"fp8 linear_mgpu: T must be in [1, {MAX_TOKENS}] (wgmma's N), got {t}"
    if warpgroups not in WARPGROUPS:
        return f"fp8 linear_mgpu: warpgroups must be one of {WARPGROUPS}, got {warpgroups}"
    if o % (warpgroups * ROWS_PER_WG) or i % STEP_K:
        return (f"fp8 linear_mgpu: O {o} must be a multiple of {warpgroups * ROWS_PER_WG} and I {i} of {STEP_K}")
    return None


def splits_for(ctas: int, steps: int, target: int) -> int:
    """The fewest parts of ``steps`` pipeline steps (a divisor of it) giving ``ctas * parts >= target``."""
    return next((p for p in range(1, steps + 1) if steps % p == 0 and ctas * p >= target), steps)


def linear_mgpu(x_TI: jax.Array, weight_OI: jax.Array | LayerSlice, scale_BB: jax.Array | LayerSlice, *,
                stages: int = 4, warpgroups: int = 1, target_ctas: int = 264, block_scales: bool = False,
                quantised: bool = False, interpret: bool = False) -> jax.Array:
    """``linear_reference`` as one Mosaic GPU kernel (a GPU of compute capability 9.0; module docstring), plus the
    XLA passes around it: fq8 and ``permute_k`` of x, the scales spread to rows, the splits' sum. ``shape_error``
    lists the shapes it takes; exact for scale bytes in ``SCALE_RANGE``. A ``LayerSlice`` weight is read in place
    (its layer index is an operand). ``block_scales``: the kernel reads the scales' 32 x 32 blocks in their stored
    layout, in place like the weight (two words a warpgroup a step, each thread taking its rows' block), instead
    of XLA spreading one layer's scales to rows every call (a launch a linear: 54 in a flash-slice decode step at
    64 rows); off by default (``fp8_linear.KernelConfig``). ``quantised``: x holds ``quant.fq8``'s values already
    (XLA's fq8 pass is skipped; the same bits). ``interpret``: run in the Mosaic GPU
    interpreter (``fp4_wgmma``'s interpret mode: the register decode replaced by its logical values)."""
    t, i = x_TI.shape
    o = weight_OI.shape[0]
    error = shape_error(t, o, i, warpgroups)
    if error:
        raise ValueError(error)
    if block_scales:
        [w_stack, s_stack], layer = in_place([weight_OI, scale_BB])  # s_stack [L, O/32, I/32]
    else:
        [w_stack], layer = in_place([weight_OI])
        s_stack = jnp.repeat(materialize(scale_BB), quant.FP8_BLOCK, axis=0)[None, :o]  # [1, O, I/32]
    words_LOW = lax.bitcast_convert_type(
        lax.bitcast_convert_type(w_stack, jnp.uint8).reshape(*w_stack.shape[:-1], i // CODES_PER_WORD,
                                                            CODES_PER_WORD), jnp.uint32)
    n = -(-t // 8) * 8
    x_NI = permute_k(jnp.pad(x_TI if quantised else quant.fq8(x_TI), ((0, n - t), (0, 0))))
    steps = i // STEP_K
    splits = splits_for(o // (warpgroups * ROWS_PER_WG), steps, target_ctas)
    y_PON = _call(words_LOW, scale_words(s_stack, CHUNKS), x_NI, layer.reshape(1).astype(jnp.int32),
                  splits=splits, stages=stages, warpgroups=warpgroups, block_scales=block_scales,
                  interpret=interpret)
    return jnp.sum(y_PON, axis=0).T[:t].astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("splits", "stages", "warpgroups", "block_scales", "interpret"))
def _call(w_LOW, s_LRS, x_NI, layer_1, *, splits: int, stages: int, warpgroups: int, block_scales: bool,
          interpret: bool):
    """The kernel: float32 partial sums [splits, O, N] of the weight's rows (layer ``layer_1[0]`` of the stack)
    times x's N rows, each split over its part of K. The scale words s_LRS: the layer's rows' [1, O, S], or with
    ``block_scales`` the stack's 32-row blocks [L, O/32, S]. ``stages`` is capped where shared memory needs it."""
    o, i = w_LOW.shape[1], w_LOW.shape[2] * CODES_PER_WORD
    n = x_NI.shape[0]
    cta_rows = warpgroups * ROWS_PER_WG
    per_split = i // STEP_K // splits  # pipeline steps a CTA

    def kernel(layer_ref, w_gmem, s_gmem, *refs, y_smem, a_smem=None):
        *block_gmem, x_gmem, y_gmem = refs  # block_gmem: with block_scales only
        m, part = lax.axis_index("m"), lax.axis_index("p")
        layer = layer_ref[0]

        def scales(step_index):
            """The compute warpgroup's rows' scale words of this split's pipeline step ``step_index`` (GMEM): with
            ``block_scales`` its two 32-row blocks' words, rows 0-31 (warps 0-1 in the WGMMA layout) the first's."""
            wg, step = lax.axis_index("wg"), part * per_split + step_index
            row0 = m * cta_rows + wg * ROWS_PER_WG
            if not block_scales:
                return plgpu.load(s_gmem.at[0, pl.ds(row0, ROWS_PER_WG), step], layout=ROW_LAYOUT, optimized=False)
            block = row0 // quant.FP8_BLOCK
            first, second = s_gmem[layer, block, step], s_gmem[layer, block + 1, step]
            # each row's block (0 or 1) loaded, not an iota: jax 0.11.2 fails to infer the iota's layout at one
            # compute warpgroup (sm_90 build, tools/mgpu_build.py)
            block_R = plgpu.load(block_gmem[0], layout=ROW_LAYOUT, optimized=False)
            return jnp.where(block_R == 0, first, second)

        def step(indices, *refs):
            *w_smems, x_smem, (acc_ref, s_step) = refs  # this step's scale words came with the carry
            s_next = scales(jnp.minimum(indices[0] + 1, per_split - 1))  # the next step's, loaded a step ahead
            wg = lax.axis_index("wg")
            rows = pl.ds(wg * ROWS_PER_WG, ROWS_PER_WG)
            for c, w_smem in enumerate(w_smems):
                words = plgpu.load(w_smem.at[rows], layout=plgpu.Layout.WGMMA)
                s_lo, s_hi = ((lax.shift_right_logical(s_step, np.uint32(8 * (2 * c + b))) & np.uint32(0xFF))
                              .astype(jnp.uint16) for b in range(2))
                a = (_decode(words, s_lo, s_hi) if a_smem is None
                     else interpret_operand(a_smem.at[wg, c], _decode_values(words, s_lo, s_hi)))
                plgpu.wgmma(acc_ref, a, x_smem.at[:, pl.ds(c * K_CHUNK, K_CHUNK)].T)
            plgpu.wgmma_wait(0)
            return acc_ref, s_next

        def epilogue(run_pipeline):
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((ROWS_PER_WG, n), jnp.float32))
            def _(acc_ref):
                run_pipeline((acc_ref, scales(0)))
                wg = lax.axis_index("wg")
                y_smem[wg] = acc_ref[...]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(y_smem.at[wg], y_gmem.at[part, pl.ds(m * cta_rows + wg * ROWS_PER_WG,
                                                                            ROWS_PER_WG)])
                plgpu.wait_smem_to_gmem(0)

        spec = plgpu.BlockSpec
        words_spec = [spec((cta_rows, WORDS), lambda s, c=c: (0, CHUNKS * s + c),
                           transforms=(plgpu.TilingTransform((8, WORDS)), plgpu.SwizzleTransform(4 * WORDS)))
                      for c in range(CHUNKS)]
        pipeline = plgpu.emit_pipeline_warp_specialized(
            step, grid=(per_split,), memory_registers=40, wg_axis="wg", num_compute_wgs=warpgroups,
            max_concurrent_steps=pipeline_depth(stages, CHUNKS * cta_rows * WORDS * 4 + n * STEP_K * 2,
                                                warpgroups * ROWS_PER_WG * n * 4),
            compute_context=epilogue,
            in_specs=[*words_spec, spec((n, STEP_K), lambda s: (0, s),
                                        transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))])
        k_words = per_split * STEP_K // CODES_PER_WORD
        words = w_gmem.at[layer, pl.ds(m * cta_rows, cta_rows), pl.ds(part * k_words, k_words)]
        pipeline(*([words] * CHUNKS), x_gmem.at[:, pl.ds(part * per_split * STEP_K, per_split * STEP_K)])

    run = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((splits, o, n), jnp.float32),
        grid=(o // cta_rows, splits), grid_names=("m", "p"), num_threads=warpgroups + 1, thread_name="wg",
        scratch_types=dict(y_smem=plgpu.SMEM((warpgroups, ROWS_PER_WG, n), jnp.float32),
                           **interpret_scratch(interpret, warpgroups, CHUNKS)),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    # with block_scales: a warpgroup's row -> its scale block (0 or 1)
    blocks = [jnp.arange(ROWS_PER_WG, dtype=jnp.int32) // quant.FP8_BLOCK] if block_scales else []
    return run(layer_1, w_LOW, s_LRS, *blocks, x_NI)


def _decode_values(words, s_lo, s_hi):
    """``_decode``'s tile from logical arrays (interpret mode): words uint32 [64, 16], the rows' two scale bytes ->
    bf16 [64, 64]: the codes in natural order (code 4w + b is byte b of word w, block k // 32) times 2^(s - 127),
    then put in ``permute_k``'s order, as the fragment holds them."""
    shift = lax.broadcasted_iota(jnp.uint32, (ROWS_PER_WG, WORDS, CODES_PER_WORD), 2) * jnp.uint32(8)
    codes = ((words[:, :, None] >> shift) & jnp.uint32(0xFF)).reshape(ROWS_PER_WG, K_CHUNK).astype(jnp.int32)
    exponent, mantissa = (codes >> 3) & 15, (codes & 7).astype(jnp.float32)
    magnitude = jnp.where(exponent == 0, mantissa * 2.0 ** -9,
                          jnp.exp2((exponent - 7).astype(jnp.float32)) * (1 + mantissa / 8))
    value = jnp.where(codes >= 128, -magnitude, magnitude)
    first = lax.broadcasted_iota(jnp.int32, (ROWS_PER_WG, K_CHUNK), 1) < 32
    s = jnp.where(first, s_lo[:, None], s_hi[:, None]).astype(jnp.float32)
    return permute_k(value * jnp.exp2(s - 127)).astype(jnp.bfloat16)


@plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, ROW_LAYOUT, ROW_LAYOUT),
                   return_type=plgpu.ShapeDtypeStruct((64, 64), jnp.bfloat16, layout=plgpu.Layout.WGMMA))
def _decode(ctx, words, s_lo, s_hi):
    """The register-level decode (Mosaic GPU's own arrays): words uint32 [64, 16] in the WGMMA layout and the rows'
    two ue8m0 bytes of this K chunk (uint16 [64] each) -> bf16 [64, 64] in the WGMMA layout, in ``permute_k``'s K
    order: word-register column group g (words 8g + 2q, 8g + 2q + 1), byte pair p, word h of the two -> fragment
    column group 4g + 2p + h."""
    del ctx
    i32, bf16 = ir.IntegerType.get_signless(32), ir.BF16Type.get()
    layout = mgpu.WGMMA_LAYOUT
    # 2^(s - 7) as bf16: times a decoded code (e4m3 * 2^-120) it is e4m3 * 2^(s - 127)
    scales = [((s + E4M3_BIAS_FIX) << 7).bitcast(bf16).broadcast_in_dim((64, 64), (0,), layout) for s in (s_lo, s_hi)]
    out = np.empty(layout.registers_shape((64, 64)), dtype=object)
    const = lambda reg, v: vector.broadcast(reg.type, arith.constant(i32, v))
    for idx, reg in np.ndenumerate(words.registers):  # vector<2 x i32>: the thread's words 8g + 2q and 8g + 2q + 1
        g = idx[1]
        magnitude, sign = const(reg, E4M3_MAGNITUDE_PAIR), const(reg, E4M3_SIGN_PAIR)
        pair_bits = [  # bytes (0, 2), then (1, 3)
            arith.ori(arith.andi(arith.shli(reg, const(reg, 4)), magnitude),
                      arith.andi(arith.shli(reg, const(reg, 8)), sign)),
            arith.ori(arith.andi(arith.shrui(reg, const(reg, 4)), magnitude), arith.andi(reg, sign))]
        for p, bits in enumerate(pair_bits):
            pairs = vector.bitcast(ir.VectorType.get([4], bf16), bits)
            for h in range(2):
                column_group = 4 * g + 2 * p + h
                out[(idx[0], column_group, *idx[2:])] = vector.extract_strided_slice(
                    ir.VectorType.get([2], bf16), pairs, [2 * h], [2], [1])
    scale = np.empty(out.shape, dtype=object)
    for idx in np.ndindex(out.shape):  # column groups 0-3: the chunk's first scale block, 4-7 its second
        scale[idx] = scales[idx[1] // 4].registers[idx]
    tile = mgpu.FragmentedArray(_registers=out, _layout=layout, _is_signed=None)
    return tile * mgpu.FragmentedArray(_registers=scale, _layout=layout, _is_signed=None)
