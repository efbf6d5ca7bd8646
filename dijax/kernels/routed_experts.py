"""Routed SwiGLU experts (v41_spec §9) behind one seam: a pure-jnp reference and Pallas kernels, one signature.

``routed_experts(..., impl=)`` picks the implementation; the choice is static (part of the jit key):
  * 'reference': dequantise the experts to bf16 in XLA, then batched mat-vecs or ``ragged_dot`` (the semantics);
  * 'pallas': MXFP4 experts are read packed and decoded in registers by Triton-lowered ``pl.pallas_call`` kernels
    (interpret mode when the backend is not a GPU). Only the assigned experts' bytes are read.

Semantics shared by both: the activations come fake-quantised to fp8 (``quant.fq8``, 1 x 32 blocks: the caller's,
``dijax.model.moe`` or the collapse kernel before it, so that no step quantises them twice) and stay bf16 values
(any bf16 x gives the same arithmetic), so every product of an activation and a dequantised weight is exact in fp32; GEMMs accumulate in fp32 and
each GEMM output is rounded to bf16; ``h = silu(min(g, l)) * clip(u, +-l)`` times the routing weight, rounded to
bf16 and fq8'd, feeds w2; the X expert outputs of a token are summed in fp32 in expert-id order. The Pallas kernels
sum in another order, so they agree with the reference up to fp32 summation order (a bf16 ulp at rounding ties).

Padding: an assignment whose expert id is negative (-1) contributes exactly zero and reads no expert weights; its
routing weight is ignored. Padded tokens should be routed to -1 (a weight of 0 also gives a zero contribution, but
still reads that expert).

Stacked layers: the leaves of ``experts`` may be ``LayerSlice``s (dijax.kernels.stacked) of one layer of a
scanned stack of layers; the kernels then read that layer's experts in place (expert ids offset into the
flattened [layers * E] stack) and the reference gathers them from the stack, so no layer's experts are copied.

Why Triton-lowered ``pl.pallas_call`` and not Mosaic GPU: the kernels need a per-row gather of activations (tokens
of a tile come from anywhere in the batch) and a per-program expert index read from memory, which the Triton
lowering supports and Mosaic GPU does not on Hopper; MXFP4 has no Hopper tensor-core format either way, so the
codes are expanded to bf16 in registers before the tensor-core dot.

Letters: T tokens, D model dim, E experts, X experts per token, F expert width, A = T * X assignments, R rows of
the expert-sorted, tile-padded assignment layout, I tiles of that layout, W uint32 words of a packed weight row
(8 e2m1 codes each), B 32-wide scale blocks of a weight row.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dijax.kernels import bf16_pairs, fp4_wgmma, interpret_mode, numerics, poison, quant
from dijax.kernels.stacked import LayerSlice, in_place, materialize

IMPLS = ("reference", "pallas")
PATHS = ("gathered", "ragged")
GEMM_ENGINES = ("triton", "mgpu")
CODES_PER_WORD = 8
WORDS_PER_SCALE = 4  # 32 codes share one ue8m0 exponent
# A decoded code is e2m1 * 2^-14 (the float16 bit trick below); the scale multiplier puts the 2^14 back.
_F16_BIAS_FIX = 14


def swiglu(gate_f32: jax.Array, up_f32: jax.Array, limit: float) -> jax.Array:
    """``silu(min(g, l)) * clip(u, -l, l)`` (no clamp when ``limit`` <= 0). float32, any shape -> float32."""
    if limit > 0:
        up_f32 = jnp.clip(up_f32, -limit, limit)
        gate_f32 = jnp.minimum(gate_f32, limit)
    return jax.nn.silu(gate_f32) * up_f32


def expert_weights(experts: dict, name: str, expert_A: jax.Array | None = None) -> jax.Array:
    """Routed-expert weight ``name`` dequantised to bf16: all experts [E, out, in], or, given ``expert_A``, only
    those experts' (gathered while still packed, then dequantised) [A, out, in].

    Storage: MXFP4 ``uint8`` [E, out, in/2] with ue8m0 [E, out, in/32], or fp8 [E, out, in] with ue8m0 tiles;
    either may be a ``LayerSlice`` (its experts gathered straight from the stack).
    """
    w, scale = experts[name]["weight"], experts[name]["scale"]
    if expert_A is not None:
        w, scale = (a.flat()[a.index, expert_A] if isinstance(a, LayerSlice) else a[expert_A] for a in (w, scale))
    w, scale = materialize(w), materialize(scale)
    if w.dtype == jnp.uint8:
        return quant.dequant_fp4_weight(w, scale)
    return jax.vmap(quant.dequant_fp8_weight)(w, scale)


def routed_path(n_assignments: int, n_experts: int) -> str:
    """The reference's static path: 'gathered' when A <= E, else 'ragged'.

    Measured on an H200 at the real sizes (E = 384, 2304 x 5120 MXFP4 experts, docs/benchmarks.md): gathered takes
    0.44 / 2.5 / 9.2 ms a layer at A = 6 / 96 / 384, ragged 18.6 / 19.4 / 30.0 ms (it dequantises every expert).
    """
    return "gathered" if n_assignments <= n_experts else "ragged"


def _check_path(path: str) -> None:
    if path not in PATHS:
        raise ValueError(f"unknown routed-experts path {path!r} (expected 'gathered' or 'ragged')")


def _sum_slots(y_AD: jax.Array, valid_A: jax.Array, t: int, n_per_token: int) -> jax.Array:
    """Zero padding assignments, then sum each token's X bf16 outputs in fp32 in slot (expert-id) order."""
    y_AD = jnp.where(valid_A[:, None], y_AD, jnp.zeros((), y_AD.dtype))
    y_TXD = y_AD.reshape(t, n_per_token, y_AD.shape[-1])
    total_TD = jnp.zeros((t, y_AD.shape[-1]), jnp.float32)
    for i in range(n_per_token):
        total_TD = total_TD + y_TXD[:, i].astype(jnp.float32)
    return total_TD


def routed_experts_reference(experts: dict, x_TD: jax.Array, weights_TX: jax.Array, experts_TX: jax.Array,
                             limit: float, path: str | None = None) -> jax.Array:
    """Sum over each token's experts of ``w_e * expert_e(x)``, in expert-id order, in fp32. -> float32 [T, D].

    experts: stacked {'w1','w2','w3': {'weight': [E, ...], 'scale': [E, ...]}}; x_TD bf16, fq8'd (module
    docstring); weights_TX float32; experts_TX int32, ascending per token (-1 = padding, module docstring). Two
    paths, chosen statically from the
    shapes by ``routed_path`` (``path`` forces one):
      * 'gathered' (A <= E, e.g. decode steps): the A assigned experts' packed weights and scales are gathered and
        only those are dequantised, then each assignment is a batched matrix-vector product. Memory traffic is A
        expert matrices instead of E (a decode step of one token touches X of the model's 384 experts);
      * 'ragged' (A > E, e.g. prefill): all E experts are dequantised once, assignments are sorted by expert and
        run as grouped GEMMs (``ragged_dot``); here every expert is likely used and the weights are shared.
    Both paths round every GEMM output to bf16 alike and sum the X experts of a token in expert-id order.
    """
    t, _ = x_TD.shape
    n_per_token = experts_TX.shape[1]
    n_experts = experts["w1"]["weight"].shape[0]
    valid_A = experts_TX.reshape(-1) >= 0
    expert_A = jnp.maximum(experts_TX.reshape(-1), 0)  # padding computes expert 0 at weight 0, zeroed at the end
    path = path or routed_path(expert_A.shape[0], n_experts)
    _check_path(path)
    token_A = jnp.arange(expert_A.shape[0]) // n_per_token
    weights_A = jnp.where(valid_A, weights_TX.reshape(-1), np.float32(0))
    if path == "gathered":  # assignment a = t * X + i is (token t, slot i): no reordering
        order_A = None

        def matmul(lhs_AI: jax.Array, name: str) -> jax.Array:
            return numerics.einsum_bf16("ai,aoi->ao", lhs_AI, expert_weights(experts, name, expert_A))
    else:  # assignments sorted by expert, one group per expert
        order_A = jnp.argsort(expert_A, stable=True)
        token_A, weights_A = token_A[order_A], weights_A[order_A]
        group_sizes_E = jnp.bincount(expert_A, length=n_experts).astype(jnp.int32)

        def matmul(lhs_AI: jax.Array, name: str) -> jax.Array:
            w_EIO = jnp.swapaxes(expert_weights(experts, name), 1, 2)
            return jax.lax.ragged_dot(lhs_AI, w_EIO, group_sizes_E, precision=jax.lax.Precision.HIGHEST,
                                      preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    x_AD = x_TD[token_A]
    g_AF = matmul(x_AD, "w1").astype(jnp.float32)
    u_AF = matmul(x_AD, "w3").astype(jnp.float32)
    h_AF = swiglu(g_AF, u_AF, limit) * weights_A[:, None]
    y_AD = matmul(quant.fq8(h_AF.astype(jnp.bfloat16)), "w2")
    if order_A is not None:
        y_AD = jnp.zeros_like(y_AD).at[order_A].set(y_AD)
    return _sum_slots(y_AD, valid_A, t, n_per_token)


# ---------------------------------------------------------------------------------------------------------------
# Pallas kernels


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tiles and Triton launch parameters of the routed-experts kernels. Every size is a power of two; a size that
    does not divide its dimension is halved until it does.

    matvec_*: the few-tokens kernels (one assignment per program, fp32 FMAs). They take fp32 activations (exact bf16
      values; 20 KB a token) instead of converting bf16 in every K step, and convert each float16 half of a decoded
      pair straight from its register (inline PTX, ``decode_pair``'s ``asm``). In the sm_90 build
      (tools/kernel_report.py, T = 16) the two cut the K-step loops from 1357 to 1182 instructions (gate-up) and
      from 718 to 598 (down); the mat-vecs are issue-bound on the H200 (docs/benchmarks.md, ninth session). On the
      H200 the same values bit for bit, and the gathered path 1.13x faster at T = 1 (151.9 -> 134.3 us) and 1.05x
      at T = 16 (813 -> 774 us) at the real sizes (eleventh session). Loading each K step's weights a step ahead
      (the sampler's thresholds kernel gained from it) did not pay here: H100, forty-second session, GPU time 74.2
      against 75.6 us at T = 1 and 764.7 against 744.7 at T = 16 (removed). Where ``matvec_rows`` holds whole
      32-wide scale blocks (the default) the gate-up kernel writes h as the down kernel reads it (fq8'd,
      phase-major, float32), which took XLA two launches a layer (forty-second session). Programs taking one
      expert's assignments together (sorted into tiles, the expert's words decoded once for all) lost on an H100
      (fifty-fourth session, GPU kernel time: T = 16 979.7 / 1826.2 us with groups of 2 / 4 against 748.3 a program
      an assignment, T = 64 3127.9 / 5576.5 against 2861.5; the same bits): the kernel is bound by its
      instructions a code, not by the bytes the repeated experts add (removed);
    gemm_*: the grouped GEMM over expert-sorted tiles of ``gemm_rows`` assignments (tensor cores);
    gemm_engine: the ragged path's GEMMs: 'triton' (the grouped GEMM kernels here: tiles of tokens, gathered
      activations, the weights' tiles dequantised into a bf16 dot) or 'mgpu' (dijax.kernels.fp4_wgmma: wgmma with
      the weights decoded in registers as the A operand, tiles fitted to each expert, the SwiGLU and the
      combine in XLA); 'mgpu' falls back to 'triton' off a compute-capability-9 GPU or for sizes it does not take.
      On the H200 (thirty-first session, with tiles fitted to each expert and the outputs untransposed) 'mgpu'
      took the layer at 8192 tokens in 12.59 ms against 14.81 (35.0 % of the floor against 29.7 %) and lost at
      decode sizes (T = 64: 2.85 against 2.34 ms), so it runs from ``mgpu_min_assignments`` (T x X) on;
    mgpu_min_assignments: the fewest assignments the ragged path runs on 'mgpu' (below, 'triton'). The crossover
      lies between the measured 384 (lost) and 49152 (won); 24576 is 64 rows an expert of 384 on average;
    mgpu_sizes / mgpu_stages / mgpu_chunks / mgpu_warpgroups: fp4_wgmma's tile sizes (``fit_tiles``: each
      expert's rows in tiles of the largest, then one of the smallest size that covers the rest; only the sizes A
      can use are compiled, ``fit_sizes``), stages, chunks and compute warpgroups a CTA;
    mgpu_overlap: fp4_wgmma's ``overlap`` (a step's last wgmma runs on into the next step's decode);
    mgpu_lone_max: up to this many assignments (decode up to 4 tokens of 6 experts) each takes a tile of its own
      (``lone_tiles``) instead of ``fit_tiles``' expert-sorted layout: two small XLA ops instead of a sort and
      ~10 more, at the price of reading an expert twice when two assignments share it (as the mat-vecs do);
    gathered_max: the Pallas implementation takes the mat-vec path while A <= this. On the H200 at the real sizes
      (E = 384, 2304 x 5120, X = 6) the mat-vec path took 0.83 ms at A = 96 against 1.24 ms for the GEMM, and
      3.13 against 3.08 ms at A = 384;
    poison: kernel outputs start NaN-filled instead of uninitialised (tests: an element no program writes shows).
    """
    matvec_rows: int = 32
    matvec_words: int = 64
    matvec_warps: int = 4
    matvec_stages: int = 3
    gemm_rows_min: int = 16
    gemm_rows_max: int = 64
    gemm_cols: int = 128
    gemm_words: int = 16
    gemm_warps: int = 4
    gemm_stages: int = 3
    gemm_engine: str = "mgpu"
    mgpu_min_assignments: int = 24576
    mgpu_sizes: tuple[int, ...] = (8, 16, 32, 64, 128, 192, 256)
    mgpu_stages: int = 4
    mgpu_chunks: int = 2
    mgpu_warpgroups: int = 2
    mgpu_overlap: bool = False
    mgpu_lone_max: int = 24
    gathered_max: int = 96
    poison: bool = False

    def __post_init__(self):
        sizes = ("matvec_rows", "matvec_words", "gemm_rows_min", "gemm_rows_max", "gemm_cols", "gemm_words")
        for name in sizes:
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"routed_experts KernelConfig.{name} must be a power of two, got {value}")
        if self.gemm_cols < quant.FP8_BLOCK:  # the gate-up epilogue fake-quantises whole 32-wide blocks
            raise ValueError(f"routed_experts KernelConfig.gemm_cols must be >= {quant.FP8_BLOCK}, "
                             f"got {self.gemm_cols}")
        if self.gemm_rows_min > self.gemm_rows_max:
            raise ValueError(f"routed_experts KernelConfig.gemm_rows_min ({self.gemm_rows_min}) must be <= "
                             f"gemm_rows_max ({self.gemm_rows_max})")
        for name in ("matvec_warps", "gemm_warps"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise ValueError(f"routed_experts KernelConfig.{name} must be one of (1, 2, 4, 8, 16), "
                                 f"got {getattr(self, name)}")
        if not self.mgpu_sizes or any(n % 8 or not 8 <= n <= 256 for n in self.mgpu_sizes):
            raise ValueError(f"routed_experts KernelConfig.mgpu_sizes must be multiples of 8 in [8, 256], "
                             f"got {self.mgpu_sizes}")
        for name, allowed in (("mgpu_chunks", (1, 2)), ("mgpu_warpgroups", fp4_wgmma.WARPGROUPS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"routed_experts KernelConfig.{name} must be one of {allowed}, "
                                 f"got {getattr(self, name)}")
        if self.mgpu_min_assignments < 0:
            raise ValueError(f"routed_experts KernelConfig.mgpu_min_assignments must be >= 0, "
                             f"got {self.mgpu_min_assignments}")
        if self.gemm_engine not in GEMM_ENGINES:
            raise ValueError(f"routed_experts KernelConfig.gemm_engine must be one of {GEMM_ENGINES}, "
                             f"got {self.gemm_engine!r}")
        for name in ("matvec_stages", "gemm_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"routed_experts KernelConfig.{name} must be >= 1, got {getattr(self, name)}")


CONFIG = KernelConfig()


def _block(dim: int, preferred: int, name: str, minimum: int = 1) -> int:
    """The largest power of two <= ``preferred`` that divides ``dim``; ValueError below ``minimum``."""
    block = preferred
    while block > 1 and dim % block:
        block //= 2
    if block < minimum:
        raise ValueError(f"{name}={dim} has no power-of-two tile >= {minimum} dividing it")
    return block


def pack_words(packed_u8: jax.Array) -> jax.Array:
    """MXFP4 bytes uint8 [..., in/2] -> uint32 words [..., in/8]: nibble j of word w is code 8 w + j.

    (Little-endian bytes, low nibble first. Words keep every pointer offset of a 384-expert stack inside int32.)
    """
    n = packed_u8.shape[-1]
    if n % 4:
        raise ValueError(f"packed expert rows of {n} bytes are not a multiple of 4 (in must be a multiple of 8)")
    return jax.lax.bitcast_convert_type(packed_u8.reshape(*packed_u8.shape[:-1], n // 4, 4), jnp.uint32)


def phase_major(x_TD: jax.Array) -> jax.Array:
    """Columns reordered so that column ``j * D/8 + w`` holds element ``8 w + j`` (code j of word w). [T, D]."""
    t, d = x_TD.shape
    return x_TD.reshape(t, d // CODES_PER_WORD, CODES_PER_WORD).swapaxes(1, 2).reshape(t, d)


def _pair_bits(words_u32: jax.Array, j: int) -> jax.Array:
    """Nibbles ``j`` and ``j + 4`` of each word as a float16 pair's bits (``decode_pair``), uint32."""
    v = words_u32 >> (4 * j)
    return ((v & 0x00070007) << 9) | ((v & 0x00080008) << 12)


def _half_to_f32_asm(bits_u32: jax.Array, half: int) -> jax.Array:
    """Float16 ``half`` (0 low, 1 high) of each 32-bit word converted to float32 on the GPU by one ``cvt`` straight
    from the pair register. (Converting through uint16 and float16 arrays lets Triton pack the halves of two
    neighbouring words into one register first: a ``PRMT`` per pair that this skips.)"""
    [out] = pltriton.elementwise_inline_asm(
        f"{{ .reg .b16 lo, hi; mov.b32 {{lo, hi}}, $1; cvt.f32.f16 $0, {('lo', 'hi')[half]}; }}",
        args=[jax.lax.bitcast_convert_type(bits_u32, jnp.int32)], constraints="=f,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(bits_u32.shape, jnp.float32)])
    return out


def decode_pair(words_u32: jax.Array, j: int, asm: bool = False) -> tuple[jax.Array, jax.Array]:
    """Nibbles ``j`` and ``j + 4`` (j < 4) of each word as float32 ``e2m1 * 2^-14``, by integer bit operations.

    The 3 magnitude bits (2 exponent, 1 mantissa) land on float16's exponent/mantissa boundary (bits 11..9) and the
    sign on bit 15: e2m1 and float16 then differ only by their exponent bias (1 vs 15), and e2m1's subnormal (0.5)
    is float16's subnormal too, so the float16 is exact for all 16 codes and the factor is 2^-14 for all. The two
    nibbles sit 16 bits apart, so one shift-and-mask chain builds both float16s at once: the decode's integer work
    is what bounds the kernels on the H200 (one code at a time: 1.10 ms at T = 16, X = 6; two: 0.83 ms).
    ``asm``: convert each half with inline PTX (``_half_to_f32_asm``; GPU lowering only), same values.
    """
    bits = _pair_bits(words_u32, j)
    if asm:
        return _half_to_f32_asm(bits, 0), _half_to_f32_asm(bits, 1)
    low = jax.lax.bitcast_convert_type((bits & 0xFFFF).astype(jnp.uint16), jnp.float16)
    high = jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.float16)
    return low.astype(jnp.float32), high.astype(jnp.float32)


def scale_multiplier(scale_u8: jax.Array) -> jax.Array:
    """ue8m0 exponent bytes s -> float32 ``2^(s - 127 + 14)`` built from the bits (undoes ``decode_pair``'s 2^-14).

    Exact for s in [1, 240]: real MXFP4 scales sit near 2^-8, far inside.
    """
    return quant.ue8m0_pow2(scale_u8, _F16_BIAS_FIX)


def _compiler_params(warps: int, stages: int):
    return pltriton.CompilerParams(num_warps=warps, num_stages=stages)


def _weight_tiles(w_refs, s_refs, e, r0, rows: int, w0, words: int) -> tuple:
    """Expert e's rows [r0, r0+rows) of each weight: (words [rows, words] uint32, scales [rows, words/4] uint8)."""
    return tuple((w_ref[e, pl.ds(r0, rows), pl.ds(w0, words)],
                  s_ref[e, pl.ds(r0, rows), pl.ds(w0 // WORDS_PER_SCALE, words // WORDS_PER_SCALE)])
                 for w_ref, s_ref in zip(w_refs, s_refs))


def _matvec_partial(w_RW: jax.Array, s_RB: jax.Array, x_J: list[jax.Array], asm: bool) -> jax.Array:
    """One K step of a decode mat-vec: weight words w_RW [rows, words] with their ue8m0 bytes s_RB dotted with the
    8 phase slices x_J (float32 [words] each). Scales are applied per 32-code block to the block sums.
    ``asm``: ``decode_pair``'s inline-PTX conversions. -> f32 [rows]."""
    rows, words = w_RW.shape
    p_RW = jnp.zeros((rows, words), jnp.float32)
    for j in range(CODES_PER_WORD // 2):
        low, high = decode_pair(w_RW, j, asm)
        p_RW = p_RW + low * x_J[j][None, :] + high * x_J[j + 4][None, :]
    block_RB = p_RW.reshape(rows, words // WORDS_PER_SCALE, WORDS_PER_SCALE).sum(axis=-1)
    return (block_RB * scale_multiplier(s_RB)).sum(axis=-1)


def _weighted_swiglu(g_f32: jax.Array, u_f32: jax.Array, limit: float, weight: jax.Array) -> jax.Array:
    """The reference's roundings: w1 / w3 outputs to bf16, SwiGLU in fp32 times the routing weight, to bf16."""
    g_f32, u_f32 = g_f32.astype(jnp.bfloat16).astype(jnp.float32), u_f32.astype(jnp.bfloat16).astype(jnp.float32)
    return (swiglu(g_f32, u_f32, limit) * weight).astype(jnp.bfloat16)


def _gate_up_matvec_kernel(expert_ref, offset_ref, weight_ref, x_ref, w1_ref, s1_ref, w3_ref, s3_ref, h_ref, *,
                           n_per_token: int, limit: float, rows: int, words: int, n_words: int, asm: bool,
                           quantised: bool):
    """Program (a, f): h[a, f-block] = swiglu(w1 x, w3 x) * weight for assignment a, or zeros for padding (expert
    -1). Expert e's weights are entry e + offset_ref[0] of the stacks (``_expert_stacks``).
    ``quantised``: h goes out as the down kernel reads it, ``fq8``'d (the program's rows are whole 32-wide scale
    blocks) and phase-major in float32, h_ref [A, 8, F/8] (``_store_phase_major``); else bf16, h_ref [A, F]."""
    a, r0 = pl.program_id(0), pl.program_id(1) * rows
    e = expert_ref[a]

    def store(h_R):
        if quantised:
            _store_phase_major(h_ref, a, r0, quant.fq8_tiles([h_R.astype(jnp.float32)[None, :]])[0][0])
        else:
            h_ref[a, pl.ds(r0, rows)] = h_R

    @pl.when(e >= 0)
    def _():
        t, e_stack = a // n_per_token, e + offset_ref[0]

        def step(k, acc):
            w0 = k * words
            x_J = [x_ref[t, pl.ds(j * n_words + w0, words)] for j in range(CODES_PER_WORD)]
            (w1_RW, s1_RB), (w3_RW, s3_RB) = _weight_tiles((w1_ref, w3_ref), (s1_ref, s3_ref), e_stack, r0, rows, w0,
                                                           words)
            return acc[0] + _matvec_partial(w1_RW, s1_RB, x_J, asm), acc[1] + _matvec_partial(w3_RW, s3_RB, x_J, asm)

        zeros = jnp.zeros((rows,), jnp.float32)
        g, u = jax.lax.fori_loop(0, n_words // words, step, (zeros, zeros))
        store(_weighted_swiglu(g, u, limit, weight_ref[a]))

    @pl.when(e < 0)
    def _():
        store(jnp.zeros((rows,), jnp.bfloat16))


def _store_phase_major(h_ref, a, r0, h_R: jax.Array) -> None:
    """Rows [r0, r0 + R) of assignment a's h (bf16 [R], R a multiple of 8) into h_ref float32 [A, 8, F/8], which
    is ``phase_major``'s [A, F] (element 8w + j at [a, j, w]): [R/8 words, 8 codes] transposed."""
    words = h_R.shape[0] // CODES_PER_WORD
    h_ref[a, :, pl.ds(r0 // CODES_PER_WORD, words)] = h_R.astype(jnp.float32).reshape(words, CODES_PER_WORD).T


def _down_matvec_kernel(expert_ref, offset_ref, h_ref, w2_ref, s2_ref, y_ref, *, rows: int, words: int,
                        n_words: int, asm: bool):
    """Program (a, d): y[a, d-block] = w2 h[a] rounded to bf16, or zeros for padding (experts as the gate-up
    kernel's)."""
    a, r0 = pl.program_id(0), pl.program_id(1) * rows
    e = expert_ref[a]

    @pl.when(e >= 0)
    def _():
        e_stack = e + offset_ref[0]

        def step(k, acc):
            w0 = k * words
            h_J = [h_ref[a, pl.ds(j * n_words + w0, words)] for j in range(CODES_PER_WORD)]
            [(w2_RW, s2_RB)] = _weight_tiles((w2_ref,), (s2_ref,), e_stack, r0, rows, w0, words)
            return acc + _matvec_partial(w2_RW, s2_RB, h_J, asm)

        y = jax.lax.fori_loop(0, n_words // words, step, jnp.zeros((rows,), jnp.float32))
        y_ref[a, pl.ds(r0, rows)] = y.astype(jnp.bfloat16)

    @pl.when(e < 0)
    def _():
        y_ref[a, pl.ds(r0, rows)] = jnp.zeros((rows,), jnp.bfloat16)


def pair_major(x_TD: jax.Array, words: int) -> jax.Array:
    """Columns reordered for the grouped GEMM's pair-major K steps of ``words`` packed words (8 * words columns):
    inside step k, pair j (codes j and j + 4 of each word, j < 4) owns 2 * words columns, column 2 w + h holding
    element 8 (k words + w) + j + 4 h. [T, D] -> [T, D]."""
    t, d = x_TD.shape
    return x_TD.reshape(t, d // (CODES_PER_WORD * words), words, 2, 4).transpose(0, 1, 4, 2, 3).reshape(t, d)


# The grouped GEMM's weights carry an extra 2^-_GEMM_SHIFT, which its epilogue multiplies back (exact in fp32):
# it moves the range of scale bytes whose weight tiles are exact normal bf16 values from [2, 128] to [34, 160].
# One shift for both grouped GEMMs (this module's Triton kernels and dijax.kernels.fp4_wgmma), so that one scale
# range, checked once at engine start (dijax.kernels.scale_range), covers whichever ``gemm_engine`` runs.
_GEMM_SHIFT = fp4_wgmma.SCALE_SHIFT
_GEMM_UNSHIFT = np.float32(2.0 ** _GEMM_SHIFT)
GEMM_SCALE_RANGE = fp4_wgmma.SCALE_RANGE  # ue8m0 bytes the grouped GEMM's GPU forms are exact for


def gemm_scale_bits(scale_u8: jax.Array) -> jax.Array:
    """ue8m0 bytes s -> uint32 holding the bf16 ``2^(s - 1 - _GEMM_SHIFT)`` in both halves (a bf16x2 multiplier).

    ``_pair_bits_bf16`` gives ``e2m1 * 2^-126``; times this it is the weight ``e2m1 * 2^(s - 127)`` times
    ``2^-_GEMM_SHIFT``, exact and normal for s in ``GEMM_SCALE_RANGE``. (Real MXFP4 scales sit
    near 2^-8, s = 119.)
    """
    e = scale_u8.astype(jnp.uint32) + np.uint32(126 - _GEMM_SHIFT)
    return bf16_pairs.pow2_pair(e)


def _pair_bits_bf16(words_u32: jax.Array, j: int) -> jax.Array:
    """Nibbles ``j`` and ``j + 4`` of each word as a bf16 pair's bits, each ``e2m1 * 2^-126``, uint32.

    The 3 magnitude bits go to bf16's bits 8..6 (exponent's low 2 bits, mantissa's top bit) and the sign to bit 15:
    e2m1 and bf16 then differ only by their exponent bias (1 vs 127); e2m1's subnormal (0.5) lands on a bf16
    subnormal, so all 16 codes are exact."""
    v = words_u32 >> (4 * j)
    return ((v & 0x00070007) << 6) | ((v & 0x00080008) << 12)


def _dequant_pairs(w_NW: jax.Array, s_NB: jax.Array, asm: bool) -> list[jax.Array]:
    """Weight words w_NW [cols, words] with their ue8m0 bytes s_NB dequantised to 4 bf16 tiles [cols, 2 words],
    times 2^-_GEMM_SHIFT (exact values; ``gemm_scale_bits``), tile j holding codes j and j + 4 of each word side by
    side: the column order ``pair_major`` gives the activations, so no tile is interleaved back into natural order
    (that interleave cost the gate-up GEMM 72 registers in its sm_90 build and the layer 6-11 % on the H200 at
    T >= 64: docs/benchmarks.md, ninth session).

    ``asm`` (GPU): each code pair decoded straight to bf16 bits and scaled by one ``mul.bf16x2``. Otherwise the
    same bits through float32 (``decode_pair``; the CPU flushes the bf16 subnormals that the GPU form goes through).
    """
    if asm:
        scale_NW = bf16_pairs.repeat_blocks(gemm_scale_bits(s_NB), 1, WORDS_PER_SCALE)
        pairs = [bf16_pairs.scaled_pair_asm(_pair_bits_bf16(w_NW, j), scale_NW) for j in range(CODES_PER_WORD // 2)]
    else:
        scale_NW = bf16_pairs.repeat_blocks(quant.ue8m0_pow2(s_NB, _F16_BIAS_FIX - _GEMM_SHIFT), 1, WORDS_PER_SCALE)
        pairs = [tuple((v * scale_NW).astype(jnp.bfloat16) for v in decode_pair(w_NW, j))
                 for j in range(CODES_PER_WORD // 2)]
    return [bf16_pairs.side_by_side(*pair) for pair in pairs]


def _dots_nt(acc_MN: jax.Array, lhs: list[jax.Array], rhs: list[jax.Array]) -> jax.Array:
    """acc + the ``bf16_pairs.dot_nt`` of each (lhs, rhs) pair, added to acc one at a time: summing the dots first
    and adding once cost the gate-up GEMM 65 more registers in its sm_90 build (tools/kernel_report.py)."""
    for lhs_MK, rhs_NK in zip(lhs, rhs):
        acc_MN = acc_MN + bf16_pairs.dot_nt(lhs_MK, rhs_NK)
    return acc_MN


def _gate_up_gemm_kernel(tile_expert_ref, token_ref, weight_ref, x_ref, w1_ref, s1_ref, w3_ref, s3_ref, h_ref, *,
                         limit: float, rows: int, cols: int, words: int, n_words: int, asm: bool):
    """Program (i, n): tile i's rows (one expert's assignments, gathered from x by token) times w1 / w3 columns
    [n*cols, (n+1)*cols), SwiGLU, routing weight, fq8 (cols hold whole 32-wide blocks) -> h rows of tile i: the
    down GEMM's input, so XLA's fq8 pass over h (a read, a write and an amax pass of [R, F] bf16: ~0.3 ms a layer
    at 8192 tokens on the H200) is gone. Tiles past the last expert do nothing.
    x is in ``pair_major`` order: each K step runs 4 dots per weight, one per code pair."""
    i, n0 = pl.program_id(0), pl.program_id(1) * cols
    e = tile_expert_ref[i]

    @pl.when(e >= 0)
    def _():
        token_M = token_ref[pl.ds(i * rows, rows)]

        def step(k, acc):
            w0 = k * words
            tiles = _weight_tiles((w1_ref, w3_ref), (s1_ref, s3_ref), e, n0, cols, w0, words)
            x_J = [x_ref[token_M, pl.ds(w0 * CODES_PER_WORD + 2 * j * words, 2 * words)]
                   for j in range(CODES_PER_WORD // 2)]
            return tuple(_dots_nt(a, x_J, _dequant_pairs(*tile, asm)) for a, tile in zip(acc, tiles))

        zeros = jnp.zeros((rows, cols), jnp.float32)
        g, u = (a * _GEMM_UNSHIFT for a in jax.lax.fori_loop(0, n_words // words, step, (zeros, zeros)))
        weight_M1 = weight_ref[pl.ds(i * rows, rows)][:, None]
        h_MN = _weighted_swiglu(g, u, limit, weight_M1).astype(jnp.float32)
        h_ref[pl.ds(i * rows, rows), pl.ds(n0, cols)] = quant.fq8_tiles([h_MN])[0]  # w2's input, quantised here


def _down_gemm_kernel(tile_expert_ref, h_ref, w2_ref, s2_ref, y_ref, *, rows: int, cols: int, words: int,
                      n_words: int, asm: bool):
    """Program (i, n): y rows of tile i, columns [n*cols, (n+1)*cols) = h rows (``pair_major`` order) times w2,
    rounded to bf16."""
    i, n0 = pl.program_id(0), pl.program_id(1) * cols
    e = tile_expert_ref[i]

    @pl.when(e >= 0)
    def _():
        def step(k, acc):
            w0 = k * words
            [tile] = _weight_tiles((w2_ref,), (s2_ref,), e, n0, cols, w0, words)
            h_J = [h_ref[pl.ds(i * rows, rows), pl.ds(w0 * CODES_PER_WORD + 2 * j * words, 2 * words)]
                   for j in range(CODES_PER_WORD // 2)]
            return _dots_nt(acc, h_J, _dequant_pairs(*tile, asm))

        y = jax.lax.fori_loop(0, n_words // words, step, jnp.zeros((rows, cols), jnp.float32)) * _GEMM_UNSHIFT
        y_ref[pl.ds(i * rows, rows), pl.ds(n0, cols)] = y.astype(jnp.bfloat16)


def gemm_rows(n_assignments: int, n_experts: int, config: KernelConfig = CONFIG) -> int:
    """Rows per grouped-GEMM tile: twice the average group size A / E as a power of two, within the config's
    bounds. Every tile dequantises its expert's whole weight slice (the kernels' main cost), so tiles should rarely
    split a group: at A / E = 16 (T = 1024), 32-row tiles decode a third less than 16-row ones."""
    mean = max(1, -(-n_assignments // n_experts))
    return int(min(config.gemm_rows_max, max(config.gemm_rows_min, pl.next_power_of_2(2 * mean))))


# How the tile layouts search their sorted ends: every query against every end in one fused comparison and sum
# (at most ~800 tiles x 384 experts), not jnp.searchsorted's default binary search, a while loop of log2(E) trips of
# ~5 kernels each: 315 of the 1036 launches of a flash-slice decode step at batch 64 (tools/deviceless.py). The
# results are the same integers.
SEARCH = "compare_all"


# Up to this many assignments (decode up to ~170 tokens of 6 experts) the tile layouts compare every pair instead
# of sorting and scattering: an assignment's place among its expert's, the experts' sizes and each row's assignment
# are fused comparisons and sums ([A, A], [E, A], [R, A]: a few million compares at most), where the sort, the
# bincount and the scatters were kernels of their own (tools/deviceless.py counts the launches). The results are
# the same integers.
COMPARE_MAX = 1024


def _expert_places(key_A: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array]:
    """(sizes_E int32 [E], place_A int32 [A]): each expert's assignments, and each assignment's place in the
    stable sort by ``key_A`` (expert, or ``n_experts`` for padding, which sorts last and counts in no expert). Up to
    ``COMPARE_MAX`` assignments by comparisons, past it by a sort and its inverse."""
    n_assign = key_A.shape[0]
    a_A = jnp.arange(n_assign, dtype=jnp.int32)
    if n_assign <= COMPARE_MAX:
        sizes_E = jnp.sum(key_A[None, :] == jnp.arange(n_experts, dtype=key_A.dtype)[:, None], axis=1,
                          dtype=jnp.int32)
        place_A = jnp.sum((key_A[None, :] < key_A[:, None])
                          | ((key_A[None, :] == key_A[:, None]) & (a_A[None, :] < a_A[:, None])), axis=1,
                          dtype=jnp.int32)
        return sizes_E, place_A
    sizes_E = jnp.bincount(key_A, length=n_experts + 1)[:n_experts].astype(jnp.int32)
    order_A = jnp.argsort(key_A, stable=True).astype(jnp.int32)
    return sizes_E, jnp.zeros((n_assign,), jnp.int32).at[order_A].set(a_A)


def _row_slots(row_A: jax.Array, n_rows: int) -> jax.Array:
    """slot_R int32 [n_rows]: the assignment whose row (``row_A``, distinct; ``n_rows`` for none) each row is, -1
    where none is. Up to ``COMPARE_MAX`` assignments by comparisons, past it by a scatter."""
    a_A = jnp.arange(row_A.shape[0], dtype=jnp.int32)
    if row_A.shape[0] <= COMPARE_MAX:
        hit_RA = row_A[None, :] == jnp.arange(n_rows, dtype=jnp.int32)[:, None]
        return jnp.max(jnp.where(hit_RA, a_A[None, :], -1), axis=1)
    return jnp.full((n_rows,), -1, jnp.int32).at[row_A].set(a_A, mode="drop")


def _assignment_rows(key_A: jax.Array, n_experts: int, place_A: jax.Array, sizes_E: jax.Array,
                     first_row_E: jax.Array, n_rows: int, n_per_token: int):
    """(token_R, slot_R, pos_A) of a layout giving expert e's assignments rows ``first_row_E[e]`` onwards, in their
    order: each valid assignment's row is its expert's first plus its place among the expert's assignments;
    padding assignments get none (their pos_A is the last row, which they do not hold)."""
    e_A = jnp.minimum(key_A, n_experts - 1)
    assign_start_E = jnp.cumsum(sizes_E) - sizes_E
    row_A = jnp.where(key_A < n_experts, first_row_E[e_A] + place_A - assign_start_E[e_A], n_rows)
    slot_R = _row_slots(row_A, n_rows)
    return jnp.maximum(slot_R, 0) // n_per_token, slot_R, jnp.minimum(row_A, n_rows - 1)


def tile_layout(expert_A: jax.Array, n_experts: int, n_per_token: int, rows: int):
    """Assignments sorted by expert into tiles of ``rows`` rows, each tile one expert's (zero-padded) rows.

    Returns (tile_expert_I int32 [I] (-1 for tiles past the last expert), token_R int32 [R] (0 on padding rows),
    slot_R int32 [R] (assignment index, -1 on padding rows), pos_A int32 [A] (each assignment's row)).
    I = min(A, ceil(A / rows) + min(E, A)) bounds the tiles of any routing statically (a tile holds at least one
    assignment); R = I * rows. Within an expert the assignments keep their order (a stable sort by expert:
    ``_expert_places``).
    """
    n_assign = expert_A.shape[0]
    key_A = jnp.where(expert_A >= 0, expert_A, n_experts)  # padding sorts last, into a group no tile runs
    sizes_E, place_A = _expert_places(key_A, n_experts)
    tiles_E = (sizes_E + rows - 1) // rows
    tile_end_E = jnp.cumsum(tiles_E)
    n_tiles = min(n_assign, -(-n_assign // rows) + min(n_experts, n_assign))
    tile_expert_I = jnp.searchsorted(tile_end_E, jnp.arange(n_tiles), side="right",
                                     method=SEARCH).astype(jnp.int32)
    tile_expert_I = jnp.where(tile_expert_I < n_experts, tile_expert_I, -1)
    token_R, slot_R, pos_A = _assignment_rows(key_A, n_experts, place_A, sizes_E, (tile_end_E - tiles_E) * rows,
                                              n_tiles * rows, n_per_token)
    return tile_expert_I, token_R, slot_R, pos_A


def fit_sizes(sizes: tuple[int, ...], n_assignments: int) -> tuple[int, ...]:
    """The tile sizes ``fit_tiles`` can pick when no expert has more than ``n_assignments`` rows: those below it and
    the smallest that holds it (all of them when none does). At decode (A = 6) that is one size, (8,): one
    compiled pipeline instead of one per size."""
    sizes = sorted(set(sizes))
    holds = [n for n in sizes if n >= n_assignments]
    return tuple(n for n in sizes if n < n_assignments) + tuple(holds[:1])


def fit_rows(sizes: tuple[int, ...], n_assignments: int, n_experts: int) -> int:
    """A static bound on the rows ``fit_tiles`` lays out (a multiple of 8): an expert with c rows takes pad(c)
    rows (whole tiles of the largest size, then the smallest size holding the rest), so for any alpha >= 1 the
    sum over at most n = min(E, A) experts is <= alpha * A + n * max(0, max_c pad(c) - alpha * c). The bound is the
    least over a grid of alphas. alpha = 1 is the plain A + n * (largest gap - 1); larger alphas bound many lone
    assignments (decode at batch 64: A = 384 over 384 experts, sizes from 8: 3072 rows, not 24576)."""
    sizes = sorted(set(sizes))
    c = np.arange(1, sizes[-1] + 1)
    pad_c = np.asarray(sizes)[np.searchsorted(sizes, c)]
    alphas = np.unique(np.concatenate([[1.0], pad_c / c, np.arange(8, 65) / 8]))
    alphas = alphas[alphas >= 1]
    n = min(n_experts, n_assignments)
    excess = np.maximum(0, (pad_c[None, :] - alphas[:, None] * c[None, :]).max(axis=1))
    bound = int(np.floor((alphas * n_assignments + n * excess).min() + 1e-6))
    return -(-bound // 8) * 8


def fit_tiles(expert_A: jax.Array, n_experts: int, n_per_token: int, sizes: tuple[int, ...]):
    """Assignments sorted by expert into tiles fitted to each expert: tiles of the largest of ``sizes`` while more
    rows are left than it holds, then one tile of the smallest size that holds the rest (``fp4_wgmma``'s tiles).

    Returns (tiles_I3 int32 [I, 3]: (expert or -1, first row, rows) each, token_R int32 [R] (0 on padding rows),
    slot_R int32 [R] (assignment index, -1 on padding rows), pos_A int32 [A] (each assignment's row)). Static
    bounds: I = ceil(A / max(sizes)) + min(E, A); R = ``fit_rows``. Rows past the last tile belong to no tile.
    """
    sizes = sorted(set(sizes))
    big = sizes[-1]
    n_assign = expert_A.shape[0]
    key_A = jnp.where(expert_A >= 0, expert_A, n_experts)
    count_E, place_A = _expert_places(key_A, n_experts)
    full_E = count_E // big
    rest_E = count_E - full_E * big
    sizes_S = jnp.asarray(sizes, jnp.int32)
    fit_E = jnp.minimum(jnp.searchsorted(sizes_S, rest_E, method=SEARCH), len(sizes) - 1)
    last_E = jnp.where(rest_E > 0, sizes_S[fit_E], 0)
    tiles_E = full_E + (rest_E > 0)
    rows_E = full_E * big + last_E
    tile_end_E = jnp.cumsum(tiles_E)
    tile_start_E, row_start_E = tile_end_E - tiles_E, jnp.cumsum(rows_E) - rows_E
    n_tiles = -(-n_assign // big) + min(n_experts, n_assign)
    n_rows = fit_rows(tuple(sizes), n_assign, n_experts)
    t_I = jnp.arange(n_tiles, dtype=jnp.int32)
    e_I = jnp.searchsorted(tile_end_E, t_I, side="right", method=SEARCH).astype(jnp.int32)
    used_I = e_I < n_experts
    e_c = jnp.minimum(e_I, n_experts - 1)
    j_I = t_I - tile_start_E[e_c]
    tiles_I3 = jnp.stack([jnp.where(used_I, e_I, -1), jnp.where(used_I, row_start_E[e_c] + j_I * big, 0),
                          jnp.where(used_I, jnp.where(j_I < full_E[e_c], big, last_E[e_c]), 0)], axis=1)
    token_R, slot_R, pos_A = _assignment_rows(key_A, n_experts, place_A, count_E, row_start_E, n_rows, n_per_token)
    return tiles_I3.astype(jnp.int32), token_R, slot_R, pos_A


LONE_ROWS = 8  # wgmma's smallest N: a lone assignment's tile


def lone_tiles(expert_A: jax.Array, n_per_token: int):
    """``fit_tiles``' outputs for a tile per assignment: assignment a is row ``LONE_ROWS * a`` (its tile's first;
    the other rows are padding: token 0, slot -1), in order, so nothing is sorted. R = LONE_ROWS * A, I = A;
    padding assignments (-1) give unused tiles."""
    n_assign = expert_A.shape[0]
    a_I = jnp.arange(n_assign, dtype=jnp.int32)
    valid_I = expert_A >= 0
    tiles_I3 = jnp.stack([jnp.where(valid_I, expert_A, -1), a_I * LONE_ROWS, jnp.where(valid_I, LONE_ROWS, 0)],
                         axis=1).astype(jnp.int32)
    r_R = jnp.arange(n_assign * LONE_ROWS, dtype=jnp.int32)
    a_R = r_R // LONE_ROWS
    first_R = (r_R % LONE_ROWS == 0) & valid_I[a_R]
    slot_R = jnp.where(first_R, a_R, -1)
    token_R = jnp.where(first_R, a_R // n_per_token, 0)
    return tiles_I3, token_R, slot_R, a_I * LONE_ROWS


def pallas_path(n_assignments: int, config: KernelConfig = CONFIG) -> str:
    """The Pallas implementation's static path: 'gathered' (mat-vec kernels) while A <= config.gathered_max, else
    'ragged' (grouped GEMM over expert-sorted tiles)."""
    return "gathered" if n_assignments <= config.gathered_max else "ragged"


def routed_experts_pallas(experts: dict, x_TD: jax.Array, weights_TX: jax.Array, experts_TX: jax.Array,
                          limit: float, path: str | None = None) -> jax.Array:
    """``routed_experts_reference`` with MXFP4 experts read packed and decoded in registers. -> float32 [T, D].

    Same arguments and semantics (module docstring). Paths, chosen statically by ``pallas_path`` (``path`` forces):
      * 'gathered': one program per (assignment, row block) reads that assignment's expert rows (uint32 words of
        8 codes and their ue8m0 bytes), decodes them with integer bit operations and accumulates fp32 FMAs; w1 and
        w3 share the activation loads and are fused with the SwiGLU, its clamps and the routing weight; then w2;
      * 'ragged': assignments are sorted by expert into tiles of ``gemm_rows`` rows; one program per (tile,
        column block) gathers its tokens' activations, dequantises the expert's weight tile to bf16 in registers
        and runs tensor-core dots (bf16 x bf16, fp32 accumulation); w1 / w3 fused with the SwiGLU, then w2.
    fp8-stored experts ([E, out, in] float8_e4m3fn) take the reference path.
    """
    if experts["w1"]["weight"].dtype != jnp.uint8:
        return routed_experts_reference(experts, x_TD, weights_TX, experts_TX, limit, path)
    path = path or pallas_path(experts_TX.size, CONFIG)
    _check_path(path)
    return _routed_experts_call(experts, x_TD, weights_TX, experts_TX, limit=limit, path=path, config=CONFIG,
                                interpret=interpret_mode())


@functools.partial(jax.jit, static_argnames=("limit", "path", "config", "interpret"))
def _routed_experts_call(experts: dict, x_TD: jax.Array, weights_TX: jax.Array, experts_TX: jax.Array, *,
                         limit: float, path: str, config: KernelConfig, interpret: bool) -> jax.Array:
    """The kernel launches of ``routed_experts_pallas`` on ``path``, jitted: the MoE layers of one shape share one
    trace and lowering per step shape; ``config`` is part of the key."""
    t, d = x_TD.shape
    n_per_token = experts_TX.shape[1]
    n_experts, f, _ = experts["w1"]["weight"].shape
    expert_A = experts_TX.reshape(-1).astype(jnp.int32)
    n_assign = expert_A.shape[0]
    for name, size in (("dim", d), ("moe_inter_dim", f)):
        if size % 32:
            raise ValueError(f"{name}={size} must be a multiple of 32 (the MXFP4 scale block)")
    ((w1, s1), (w3, s3), (w2, s2)), offset = _expert_stacks(experts)
    weights_A = weights_TX.reshape(-1).astype(jnp.float32)
    call = functools.partial(_call, poisoned=config.poison, interpret=interpret)
    if path == "gathered":
        rows_f, rows_d = _block(f, config.matvec_rows, "moe_inter_dim"), _block(d, config.matvec_rows, "dim")
        words_d = _block(d // 8, config.matvec_words, "dim/8", WORDS_PER_SCALE)
        words_f = _block(f // 8, config.matvec_words, "moe_inter_dim/8", WORDS_PER_SCALE)
        params = _compiler_params(config.matvec_warps, config.matvec_stages)
        # the stack offset is added in the kernels: with the router's -1 for padding tokens (``router.route``'s
        # valid_T) no XLA launch sits between the router and the mat-vecs
        offset_1 = jnp.reshape(offset, (1,)).astype(jnp.int32)
        asm = not interpret  # the inline-PTX conversions only lower for a GPU
        # the down kernel's input (fq8, phase-major, float32) straight from the gate-up kernel where each program's
        # rows are whole scale blocks (the default); else XLA's two launches make it
        quantised = rows_f % quant.FP8_BLOCK == 0
        h = call(functools.partial(_gate_up_matvec_kernel, n_per_token=n_per_token, limit=limit, rows=rows_f,
                                   words=words_d, n_words=d // 8, asm=asm, quantised=quantised),
                 (n_assign, CODES_PER_WORD, f // CODES_PER_WORD) if quantised else (n_assign, f),
                 (n_assign, f // rows_f), params, "routed_gate_up_matvec",
                 expert_A, offset_1, weights_A, phase_major(x_TD).astype(jnp.float32), w1, s1, w3, s3,
                 dtype=jnp.float32 if quantised else jnp.bfloat16)
        h_AF = h.reshape(n_assign, f) if quantised else phase_major(quant.fq8(h)).astype(jnp.float32)
        y_AD = call(functools.partial(_down_matvec_kernel, rows=rows_d, words=words_f, n_words=f // 8, asm=asm),
                     (n_assign, d), (n_assign, d // rows_d), params, "routed_down_matvec", expert_A, offset_1, h_AF,
                     w2, s2)
        return _sum_slots(y_AD, expert_A >= 0, t, n_per_token)

    if (config.gemm_engine == "mgpu" and n_assign >= config.mgpu_min_assignments
            and _mgpu_takes(d, f, config, interpret)):
        return _ragged_mgpu(((w1, s1), (w3, s3), (w2, s2)), offset, x_TD, weights_A, expert_A, n_experts,
                            n_per_token, limit, config)
    rows = gemm_rows(n_assign, n_experts, config)
    tile_expert_I, token_R, weight_R, pos_A = _stack_tiles(expert_A, weights_A, n_experts, n_per_token, rows, offset)
    n_rows, n_tiles = token_R.shape[0], tile_expert_I.shape[0]
    cols_f = _block(f, config.gemm_cols, "moe_inter_dim", quant.FP8_BLOCK)  # whole fq8 blocks (epilogue)
    cols_d = _block(d, config.gemm_cols, "dim", 16)
    words_d = _block(d // 8, config.gemm_words, "dim/8", 2)
    words_f = _block(f // 8, config.gemm_words, "moe_inter_dim/8", 2)
    params = _compiler_params(config.gemm_warps, config.gemm_stages)
    h_RF = call(functools.partial(_gate_up_gemm_kernel, limit=limit, rows=rows, cols=cols_f, words=words_d,
                                   n_words=d // 8, asm=not interpret),
                 (n_rows, f), (n_tiles, f // cols_f), params, "routed_gate_up_gemm",
                 tile_expert_I, token_R, weight_R, pair_major(x_TD, words_d), w1, s1, w3, s3)
    y_RD = call(functools.partial(_down_gemm_kernel, rows=rows, cols=cols_d, words=words_f, n_words=f // 8,
                                   asm=not interpret),
                 (n_rows, d), (n_tiles, d // cols_d), params, "routed_down_gemm",
                 tile_expert_I, pair_major(h_RF, words_f), w2, s2)
    return _sum_slots(y_RD[pos_A], expert_A >= 0, t, n_per_token)


def _stack_tiles(expert_A, weights_A, n_experts: int, n_per_token: int, rows: int, offset):
    """``tile_layout`` for the kernels: (tile_expert_I with ids in the flattened expert stack (``_expert_stacks``'
    offset added; -1 kept), token_R, weight_R float32 [R] (each row's routing weight, 0 on padding rows), pos_A)."""
    tile_expert_I, token_R, slot_R, pos_A = tile_layout(expert_A, n_experts, n_per_token, rows)
    return _in_stack(tile_expert_I, offset), token_R, _row_weights(slot_R, weights_A), pos_A


def _in_stack(expert_I: jax.Array, offset) -> jax.Array:
    """Expert ids in the flattened expert stack (``_expert_stacks``' offset added); -1 kept."""
    return jnp.where(expert_I >= 0, expert_I + offset, -1)


def _row_weights(slot_R: jax.Array, weights_A: jax.Array) -> jax.Array:
    """float32 [R]: each row's routing weight (its assignment's), 0 on padding rows (slot -1)."""
    return jnp.where(slot_R >= 0, weights_A[jnp.maximum(slot_R, 0)], np.float32(0))


def _mgpu_takes(d: int, f: int, config: KernelConfig, interpret: bool) -> bool:
    """Whether ``_ragged_mgpu`` can run the layer: a compute-capability-9 GPU (not interpreted) and sizes
    fp4_wgmma takes for w1 / w3 ([F, D]) and w2 ([D, F])."""
    if interpret or not fp4_wgmma.available():
        return False
    return all(fp4_wgmma.shape_error(rows, k, config.mgpu_sizes, config.mgpu_chunks, config.mgpu_warpgroups) is None
               for rows, k in ((f, d), (d, f)))


def _ragged_mgpu(stacks, offset, x_act_TD, weights_A, expert_A, n_experts: int, n_per_token: int, limit: float,
                 config: KernelConfig) -> jax.Array:
    """The ragged path on ``fp4_wgmma``: assignments in expert-sorted tiles fitted to each expert (``fit_tiles``),
    or, for at most ``mgpu_lone_max`` assignments, a tile each (``lone_tiles``: no sort); each GEMM one kernel
    ([R, F], rounded to bf16 as the reference rounds every GEMM output), the SwiGLU, routing weight and fq8 of h in
    XLA, then w2 and the combine. -> float32 [T, D]."""
    ((w1, s1), (w3, s3), (w2, s2)) = stacks
    t = x_act_TD.shape[0]
    if expert_A.shape[0] <= config.mgpu_lone_max:
        sizes = (LONE_ROWS,)
        tiles_I3, token_R, slot_R, pos_A = lone_tiles(expert_A, n_per_token)
    else:
        sizes = fit_sizes(config.mgpu_sizes, expert_A.shape[0])
        tiles_I3, token_R, slot_R, pos_A = fit_tiles(expert_A, n_experts, n_per_token, sizes)
    tiles_I3 = tiles_I3.at[:, 0].set(_in_stack(tiles_I3[:, 0], offset))
    weight_R = _row_weights(slot_R, weights_A)
    gemm = functools.partial(fp4_wgmma.grouped_gemm_t_mgpu, tiles_I3=tiles_I3, sizes=sizes,
                             stages=config.mgpu_stages, chunks=config.mgpu_chunks,
                             warpgroups=config.mgpu_warpgroups, overlap=config.mgpu_overlap)
    # padding rows read token 0 (finite) at weight 0
    g_RF, u_RF = gemm(w1, s1, x_act_TD, rows_R=token_R), gemm(w3, s3, x_act_TD, rows_R=token_R)
    h_RF = swiglu(g_RF.astype(jnp.float32), u_RF.astype(jnp.float32), limit) * weight_R[:, None]
    y_RD = gemm(w2, s2, quant.fq8(h_RF.astype(jnp.bfloat16)))
    return _sum_slots(y_RD[pos_A], expert_A >= 0, t, n_per_token)


def _expert_stacks(experts: dict) -> tuple[list[tuple[jax.Array, jax.Array]], jax.Array]:
    """([(packed words uint32 [L * E, out, in / 8], scales uint8 [L * E, out, in / 32]) of w1, w3, w2], the offset
    of this layer's experts in them): ``LayerSlice`` experts read in place from their stacks flattened over the
    layers, or plain experts (L = 1, offset 0); ``stacked.in_place`` decides for all six at once, since the kernels
    index every matrix by one expert id."""
    names = ("w1", "w3", "w2")
    words = [experts[n]["weight"] for n in names]
    words = [LayerSlice(pack_words(w.stack), w.index, w.ndim) if isinstance(w, LayerSlice) else pack_words(w)
             for w in words]
    stacks, layer = in_place(words + [experts[n]["scale"] for n in names])
    flat = [a.reshape(-1, *a.shape[2:]) for a in stacks]  # [L, E, ...] -> [L * E, ...]
    return list(zip(flat[:3], flat[3:])), layer * stacks[0].shape[1]


def _call(kernel, out_shape: tuple[int, ...], grid: tuple[int, int], params, name: str, *args, poisoned: bool,
          interpret: bool, dtype=jnp.bfloat16) -> jax.Array:
    """One ``pallas_call`` with one output (bf16 unless ``dtype``); when ``poisoned`` the output starts NaN-filled
    (dijax.kernels.poison), so elements that no program writes stay NaN."""
    return poison.pallas_call(kernel, *args, out_shape=jax.ShapeDtypeStruct(out_shape, dtype),
                              poison=poisoned, grid=grid, compiler_params=params, name=name, interpret=interpret)


_IMPLEMENTATIONS = {"reference": routed_experts_reference, "pallas": routed_experts_pallas}


def routed_experts(experts: dict, x_TD: jax.Array, weights_TX: jax.Array, experts_TX: jax.Array, limit: float,
                   *, impl: str = "reference", path: str | None = None) -> jax.Array:
    """The routed-experts seam: ``impl`` in IMPLS picks the implementation (static). -> float32 [T, D].

    Arguments as ``routed_experts_reference``; ``path`` forces that implementation's path ('gathered'/'ragged').
    """
    if impl not in _IMPLEMENTATIONS:
        raise ValueError(f"routed-experts impl must be one of {IMPLS}, got {impl!r}")
    return _IMPLEMENTATIONS[impl](experts, x_TD, weights_TX, experts_TX, limit, path)
