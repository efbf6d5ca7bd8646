"""The fp8 block-scaled linear (v41_spec §12): ``bf16(fq8(x) @ dequant(W).T)`` behind one signature.

``fp8_linear(x, weight, scale, impl=)``, and ``fp8_linears(x, [(weight, scale), ...], impl=)`` for linears that share
their input (one kernel launch for all on the Pallas path); the choice is static (part of the step's jit key):
  * 'reference': fake-quantise x (``quant.fq8``), dequantise the whole weight to bf16 in XLA, one fp32-accumulated
    GEMM (the semantics; three XLA kernels and a bf16 copy of the weight per call);
  * 'pallas': one Triton-lowered ``pl.pallas_call`` per call. Each program owns a [rows x cols] output tile and
    one of ``splits`` parts of K, walks its part in slices, fake-quantises its activation slice in registers
    (per-32 amax, power-of-two scale from the bits, e4m3 rounding by float arithmetic), decodes its e4m3 weight
    codes two at a time straight to bf16 bits with integer bit operations, applies the 32 x 32 tile scales with
    one ``mul.rn.bf16x2`` per pair, and runs two tensor-core bf16 dots per slice with fp32 accumulation. The
    weight is read once, as bytes. Split K (flash-decoding style) keeps a decode step's grid wide enough to fill
    the GPU when O / cols tiles are few: the splits' fp32 partial sums are added in XLA. (Fake-quantising x once
    in XLA before the kernel instead was no faster on the H200: docs/benchmarks.md, eighteenth session.)

Numerics: every fake-quantised activation and every dequantised weight is a bf16 value, so each product is exact in
fp32 and both implementations sum the same exact products in fp32; only the summation order differs (a bf16 ulp
at rounding ties of the output). On the GPU the weights are exact normal bf16 values for ue8m0 exponent bytes
``SCALE_RANGE`` = [10, 134] (2^-117 .. 2^7; real scales sit near 2^-8, s = 119; the parity fixtures' at 114..123);
the interpreted kernel (CPU) is exact for every byte 0..246. An engine whose checkpoint leaves ``SCALE_RANGE``
serves the linears with the reference instead (``scale_range.exact_kernels``).

Stacked layers: ``weight`` and ``scale`` may be ``LayerSlice``s (dijax.kernels.stacked), one layer of a scanned
stack of layers. The kernel then reads that layer's rows of the stack in place (the layer index is an operand), so
the scan never copies the weight out of the stack; the reference takes the slice.

Why integer decoding of the weight: Mosaic GPU's e4m3 -> bf16 needs PTX ISA 9.2 (the H200 image has 9.0), and at
decode shapes the kernel is bound by instruction issue, so the instructions per weight code set its speed. Bytes 0
and 2 of a uint32 word of codes (and bytes 1 and 3) are 16 bits apart: one shift-and-mask chain moves both codes'
7 magnitude bits onto bf16's exponent / mantissa boundary (bits 10..4) and their signs onto bits 15 and 31, so each
half is the e4m3 value times 2^-120 for every code (e4m3 subnormals land on bf16 subnormals), and one
``mul.rn.bf16x2`` by the bf16 pair ``2^(s - 7)`` gives both weights (``pair_bits`` / ``scale_pair``). The
activations are loaded in the matching column order: tile A holds K positions 4w and 4w + 2 side by side, tile B
4w + 1 and 4w + 3 (``pair_columns``). XLA on the CPU flushes bf16 subnormals, so the interpreted kernel decodes
through float16 and float32 (``decode_e4m3``) to the same values.

Letters: T tokens (rows of x), I input features, O output features, B 32-wide scale blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dijax.kernels import bf16_pairs, fp8_wgmma, interpret_mode, numerics, poison, prefetch, quant
from dijax.kernels.quant import FP8_BLOCK
from dijax.kernels.stacked import LayerSlice, in_place, materialize

IMPLS = ("reference", "pallas")
ENGINES = ("triton", "mgpu")
MIN_DOT = 16  # Triton's dot needs every dimension >= 16
CODES_PER_WORD = 4  # e4m3 codes per uint32 word of the kernel's weight view
_F16_BIAS_FIX = 8  # ``decode_e4m3``: a code's float16 is value * 2^-8 (float16 bias 15 against e4m3's 7)
# ue8m0 bytes whose weights the GPU kernels form exactly as normal bf16 values (both engines decode alike:
# ``pair_bits`` is fp8_wgmma's decode, each bf16 half the code's value times 2^-120)
SCALE_RANGE = fp8_wgmma.SCALE_RANGE


MATVEC_ROWS = (1, 2, 4, 8, 16, 32)  # the mat-vec's output rows a program: each divides FP8_BLOCK


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tiles and Triton launch parameters. Sizes are powers of two; ``cols`` (``wide_cols``) and ``depth`` are
    halved until they divide their dimension (never below 32, the scale block). ``rows`` grows to cover up to
    ``rows_max`` tokens. K is split into the fewest parts (a divisor of its slices) that give ``target_programs``
    programs. Steps of more than ``max_tokens`` tokens take the reference (XLA's dequantisation, then cuBLAS:
    faster on the H200 once the GEMM is compute bound, see docs/benchmarks.md), except those in the 'mgpu'
    engine's own range (``engine`` below).

    ``depth`` 256 (K slices of 256 codes: twice the bytes in flight per load) against 128, on the H200 at the
    flash-slice shapes (twentieth session): the 7 layer linears sum 114 against 131 us at T = 1, 153 against 153
    at T = 16; the Engram ``wkv`` (25600 x 6144, 157 MB) 82 against 111 us at T = 1.

    ``wide_cols`` from ``wide_from`` tokens: every column program reads all of x's rows, so wider column tiles
    read them fewer times. At T = 16 (the same run) 128 columns against 64: the 7 layer linears sum 129 against
    153 us, the Engram ``wkv`` 114 against 133 us; at T = 1, where x is one row, 64 columns stay faster (114
    against 122 us; the ``wkv`` 82 against 95 us).

    ``fuse``: ``fp8_linears`` runs linears of one input as one launch. On the H200 (twenty-seventh session) that
    took 21-28 launches off a flash-slice decode step and left its time unchanged (B=1 and 16, fused against a
    launch each, one machine); off is for A/B runs.

    ``engine``: 'triton' (this module's kernel) or 'mgpu' (dijax.kernels.fp8_wgmma: the weights decoded in
    registers as wgmma's A operand, streamed by TMA; one launch a linear, ``mgpu_warpgroups`` compute warpgroups a
    CTA, ``mgpu_stages`` deep). 'mgpu' falls back to 'triton' off a compute-capability-9 GPU, when interpreted, or
    for shapes it does not take (``fp8_wgmma.shape_error``), and outside ``mgpu_min_tokens`` to ``mgpu_max_tokens``
    rows (past ``max_tokens`` the Triton kernel hands over to the reference: 'mgpu' has its own range). On the H200
    (thirty-first session, GPU kernel time) 'mgpu' lost at T = 1 (the 8 flash-slice linears 1.3-2.3x slower) and
    was mixed at 16, but at T = 64 it ran the 7 layer linears in 156 us (2 warpgroups) against 262 us on the
    reference (where ``max_tokens`` = 32 sends them) and 330 us on the Triton kernel, the Engram ``wkv`` in 94
    against 274 and 689 us: docs/benchmarks.md. ``mgpu_block_scales``: its kernel reads the weight's scale blocks
    in place (``fp8_wgmma.linear_mgpu``'s ``block_scales``; off: its GPU tests and parity pass, but on an H100 the
    flash-slice decode step at B=64 took the same time with it, 53 launches fewer, thirty-sixth session).

    ``take_quantised``: where a caller passes activations that are ``quant.fq8``'s values already (``quantised``:
    the MoE's shared expert takes the collapse kernel's fq8 output) the Triton kernel loads them as they are instead
    of fake-quantising each slice in registers: the same bits (fq8 is idempotent). Every column program quantises
    the whole slice of x again, padded rows included (16 rows at one token), and that work is a third of the kernel:
    its sm_90 build at one token is 1184 SASS instructions against 1856 (wq_b) and 1208 against 1880 (wo_b), 1400
    against 2072 at 16 tokens (shared w1; the kernel alone built by tools/kernel_report.py's ``build``, forty-second
    session). On an H100 (forty-third session, ``bench_kernels --only fp8_linear --quantised --timing device``, x
    fq8'd, GPU kernel time without / with): at 16 tokens wq_b 30.7 / 29.2 us, wo_b 32.3 / 29.6, wkv 5.5 / 4.8, the
    Engram ``wkv`` 114.1 / 103.8; at one token 1-4 % less. GPU parity with it on: the verdicts without it (only
    the issue-8 prefix rows fail).

    ``matvec``: a one-token launch takes the mat-vec kernel (``_matvec_kernel``) where its K is at least
    ``matvec_min_in`` and its weights hold at least ``matvec_min_codes`` codes: no tensor-core dot, so no 16-row
    tile of which 15 rows are padding and no decoded tile passing through shared memory; each program owns
    ``matvec_rows`` output rows and all of K (no split, no XLA sum after it), decodes its codes with the hardware's
    e4m3-pair conversion and accumulates fp32 FMAs, loading each K step's codes a step ahead. ``matvec_rows``: a
    power of two up to 32 (so it divides every weight's outputs, multiples of 32); ``matvec_words``: uint32 words (4
    codes each) a program loads a step, all its rows together; ``matvec_warps``: its Triton warps. On an H100
    (forty-fourth session, ``tools/bench_kernels.py --only fp8_linear --tokens 1 --timing device`` with tilings as
    variants, docs/benchmarks.md: GPU kernel time at T = 1, dot kernel / mat-vec with 8 rows and 2048 words): wo_b
    26.1 / 20.5 us, the Engram wkv 82.5 / 64.9, the shared w1 11.1 / 9.4, where it lost on short K or few outputs:
    wq_b (K 1280) 22.9 / 39.6, the shared w2 (K 2304) 8.9 / 14.8, wq_a 7.2 / 8.0, wkv 4.2 / 5.5; hence the two
    thresholds (wo_b, the Engram wkv, the shared w1 + w3 take it; wq_b, wq_a + wkv, w2 do not). Flash-slice decode
    B=1 with it (one process, two rounds, another H100): 2.598 / 2.618 ms back to back against 2.732 / 2.657. Every
    tiling of the sweep lost where every one-token launch took it (B=1 2.82 against 2.65-2.71 ms). GPU parity with
    it on every launch: the verdicts without it. XLA's own one-token mat-vec (the codes, their scales and x as an
    elementwise product and one sum a weight) beat both kernels on the small linears alone (wq_a 4.2 against 7.2
    us), but not as a step, on every small linear or only on the inputs that come fq8'd (forty-fifth and
    forty-sixth sessions, H100: B=1 2.652 / 2.633 ms against 2.647 / 2.619); removed.

    poison: outputs start NaN-filled (tests: an element no program writes shows)."""
    rows_max: int = 64
    cols: int = 64
    wide_cols: int = 128
    wide_from: int = 16
    depth: int = 256
    warps: int = 4
    stages: int = 3
    target_programs: int = 264  # two per multiprocessor of an H200: K is split until the grid has this many
    max_tokens: int = 32
    fuse: bool = True
    engine: str = "mgpu"
    mgpu_warpgroups: int = 2
    mgpu_stages: int = 4
    mgpu_min_tokens: int = 33
    mgpu_max_tokens: int = 64
    mgpu_block_scales: bool = False
    take_quantised: bool = True
    matvec: bool = True
    matvec_rows: int = 8
    matvec_words: int = 2048
    matvec_warps: int = 4
    matvec_min_in: int = 4096
    matvec_min_codes: int = 1 << 24
    poison: bool = False

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"fp8_linear KernelConfig.engine must be one of {ENGINES}, got {self.engine!r}")
        if self.mgpu_warpgroups not in fp8_wgmma.WARPGROUPS:
            raise ValueError(f"fp8_linear KernelConfig.mgpu_warpgroups must be one of {fp8_wgmma.WARPGROUPS}, "
                             f"got {self.mgpu_warpgroups}")
        if self.mgpu_stages < 1:
            raise ValueError(f"fp8_linear KernelConfig.mgpu_stages must be >= 1, got {self.mgpu_stages}")
        if self.matvec_rows not in MATVEC_ROWS:
            raise ValueError(f"fp8_linear KernelConfig.matvec_rows must be one of {MATVEC_ROWS} (powers of two "
                             f"dividing FP8_BLOCK, so every weight's outputs), got {self.matvec_rows}")
        if not 1 <= self.mgpu_min_tokens <= self.mgpu_max_tokens:
            raise ValueError(f"fp8_linear KernelConfig.mgpu_min_tokens must be in [1, mgpu_max_tokens = "
                             f"{self.mgpu_max_tokens}], got {self.mgpu_min_tokens}")


CONFIG = KernelConfig()


Weight = jax.Array | LayerSlice


def fp8_linear_reference(x_TI: jax.Array, weight_OI: Weight, scale_BB: Weight, quantised: bool = False) -> jax.Array:
    """The reference: x [T, I] bf16, weight [O, I] float8_e4m3fn, scale uint8 [ceil(O/32), I/32] -> bf16 [T, O].
    ``quantised``: x is ``quant.fq8``'s values already, so it is not quantised again (which would give it back)."""
    w_OI = quant.dequant_fp8_weight(materialize(weight_OI), materialize(scale_BB))
    return numerics.einsum_bf16("ti,oi->to", x_TI if quantised else quant.fq8(x_TI), w_OI)


def decode_e4m3(codes: jax.Array) -> jax.Array:
    """e4m3 codes (integers 0..255, any shape) -> float32 ``value * 2^-8`` by integer bit operations (exact; NaN
    not kept): the 7 magnitude bits land on float16's exponent / mantissa boundary."""
    c = codes.astype(jnp.int32)
    bits = ((c & 0x7F) << 7) | ((c & 0x80) << 8)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def scale_multiplier(scale_u8: jax.Array) -> jax.Array:
    """ue8m0 bytes s -> float32 ``2^(s - 127 + 8)``, undoing ``decode_e4m3``'s 2^-8 (exact for s <= 246)."""
    return quant.ue8m0_pow2(scale_u8, _F16_BIAS_FIX)


def pair_bits(words_u32: jax.Array, j: int) -> jax.Array:
    """Bytes j and j + 2 (j < 2) of each uint32 word of e4m3 codes -> a bf16 pair's bits (uint32), each half the
    code's value times 2^-120 (module docstring)."""
    magnitude, sign = np.uint32(fp8_wgmma.E4M3_MAGNITUDE_PAIR), np.uint32(fp8_wgmma.E4M3_SIGN_PAIR)
    if j == 0:
        return ((words_u32 << 4) & magnitude) | ((words_u32 << 8) & sign)
    return ((words_u32 >> 4) & magnitude) | (words_u32 & sign)


def scale_pair(scale_u8: jax.Array) -> jax.Array:
    """ue8m0 bytes s -> uint32 holding the bf16 ``2^(s - 7)`` in both halves: ``pair_bits`` times it is the weight
    ``e4m3 * 2^(s - 127)`` (exact for s in ``SCALE_RANGE``)."""
    return bf16_pairs.pow2_pair(scale_u8.astype(jnp.uint32) + np.uint32(fp8_wgmma.E4M3_BIAS_FIX))


def pair_columns(depth: int) -> tuple[jax.Array, jax.Array]:
    """The K offsets inside a ``depth``-wide slice of the columns of tiles A and B (``dequant_pairs``'s order):
    column 2 w + h of tile A is K position 4 w + 2 h, of tile B 4 w + 2 h + 1. Two int32 [depth / 2]."""
    c = jnp.arange(depth // 2, dtype=jnp.int32)
    col_a = CODES_PER_WORD * (c // 2) + 2 * (c % 2)
    return col_a, col_a + 1


def dequant_pairs(words_NW: jax.Array, scale_BB: jax.Array, asm: bool) -> list[jax.Array]:
    """Weight words [cols, words] (4 e4m3 codes each) with their tile scales [cols/32, words/8] -> tiles A and B,
    bf16 [cols, 2 words] (``pair_columns``' order), the exact dequantised weights.

    ``asm`` (GPU): ``pair_bits`` times ``scale_pair`` by one ``mul.rn.bf16x2`` per pair (exact for scale bytes in
    ``SCALE_RANGE``). Otherwise the same values through float16 and float32 (exact for s <= 246): XLA on the CPU
    flushes the bf16 subnormals the GPU form passes through."""
    words_per_block = words_NW.shape[1] // scale_BB.shape[1]
    if asm:
        scale_NW = bf16_pairs.repeat_blocks(scale_pair(scale_BB), FP8_BLOCK, words_per_block)
        pairs = [bf16_pairs.scaled_pair_asm(pair_bits(words_NW, j), scale_NW) for j in range(2)]
    else:
        scale_NW = bf16_pairs.repeat_blocks(scale_multiplier(scale_BB), FP8_BLOCK, words_per_block)
        pairs = [tuple((decode_e4m3((words_NW >> (8 * (j + 2 * h))) & 0xFF) * scale_NW).astype(jnp.bfloat16)
                       for h in range(2)) for j in range(2)]
    return [bf16_pairs.side_by_side(*pair) for pair in pairs]


def _kernel(layer_ref, x_ref, *refs, n_tokens: int, rows: int, cols: int, depth: int, n_depth: int, asm: bool,
            bounds: tuple[int, ...], quantise: bool):
    """Program (n, m, k): output rows [m*rows, (m+1)*rows) (masked past the last token), columns [n*cols, ...) of
    the weights' outputs side by side, over K slices [k*n_depth, (k+1)*n_depth) of ``depth``. ``refs``: each
    weight's words [L, O_i, I/4] and each one's scale stack, read at layer ``layer_ref[0]``, then the output: bf16
    [T, sum O_i], or with split K the fp32 partial sums [splits, T, sum O_i]. Column tiles [bounds[i],
    bounds[i+1]) belong to weight i; x bf16 [T, I] is shared, fake-quantised slice by slice (``quantise``) or
    already ``quant.fq8``'s values."""
    n_weights = len(bounds) - 1
    w_refs, s_refs, o_ref = refs[:n_weights], refs[n_weights:2 * n_weights], refs[-1]
    n, m0 = pl.program_id(0), pl.program_id(1) * rows
    layer, split = layer_ref[0], pl.program_id(2)  # (program ids are read here: ``pl.when`` branches cannot)
    first = split * n_depth
    row_R = m0 + jnp.arange(rows)
    live_R1 = (row_R < n_tokens)[:, None]
    safe_R1 = jnp.minimum(row_R, n_tokens - 1)[:, None]
    live_RH = jnp.broadcast_to(live_R1, (rows, depth // 2))
    words = depth // CODES_PER_WORD

    def tile(w_ref, s_ref, n0):  # this program's tile from the columns [n0, n0 + cols) of one weight
        def step(k, acc):
            k0 = (first + k) * depth
            x_tiles = [pltriton.load(x_ref.at[safe_R1, (k0 + col_H)[None, :]], mask=live_RH, other=0)
                       for col_H in pair_columns(depth)]
            if quantise:
                x_tiles = quant.fq8_tiles([x.astype(jnp.float32) for x in x_tiles])
            words_NW = w_ref[layer, pl.ds(n0, cols), pl.ds(k0 // CODES_PER_WORD, words)]
            scale_BB = s_ref[layer, pl.ds(n0 // FP8_BLOCK, cols // FP8_BLOCK),
                             pl.ds(k0 // FP8_BLOCK, depth // FP8_BLOCK)]
            for x_RH, w_NH in zip(x_tiles, dequant_pairs(words_NW, scale_BB, asm)):
                acc = acc + bf16_pairs.dot_nt(x_RH, w_NH)
            return acc

        acc = jax.lax.fori_loop(0, n_depth, step, jnp.zeros((rows, cols), jnp.float32))
        col_N = n * cols + jnp.arange(cols)
        # masked rows keep their own (out-of-range) indices: interpret mode drops them, where clamped duplicates
        # would write stale values over a live row
        index = (row_R[:, None], col_N[None, :])
        if len(o_ref.shape) == 3:  # split K: this split's plane of fp32 partial sums
            index = (jnp.full((rows, 1), split),) + index
        pltriton.store(o_ref.at[index], acc.astype(o_ref.dtype), mask=jnp.broadcast_to(live_R1, (rows, cols)))

    _each_weight(tile, n, bounds, w_refs, s_refs, cols)


def _each_weight(tile, n, bounds: tuple[int, ...], w_refs, s_refs, size: int) -> None:
    """Program ``n``'s ``tile(w_ref, s_ref, first output)`` on the weight whose tiles of ``size`` outputs
    [bounds[i], bounds[i + 1]) hold it: one ``pl.when`` branch a weight (a program reads one weight's tile)."""
    if len(w_refs) == 1:
        tile(w_refs[0], s_refs[0], n * size)
        return
    for i, (w_ref, s_ref) in enumerate(zip(w_refs, s_refs)):
        pl.when((n >= bounds[i]) & (n < bounds[i + 1]))(functools.partial(tile, w_ref, s_ref, (n - bounds[i]) * size))


def _tile(dim: int, preferred: int) -> int:
    """The largest power of two <= ``preferred`` dividing ``dim``, or 0 below the 32-wide scale block."""
    block = preferred
    while block >= FP8_BLOCK and dim % block:
        block //= 2
    return block if block >= FP8_BLOCK else 0


def k_splits(programs: int, n_slices: int, target: int) -> int:
    """The fewest parts of ``n_slices`` K slices (a divisor of it) giving ``programs * parts >= target``."""
    for parts in range(1, n_slices + 1):
        if n_slices % parts == 0 and programs * parts >= target:
            return parts
    return n_slices


def pallas_supports(x_TI: jax.Array, *weights: Weight) -> bool:
    """Shapes the kernel takes: fp8 weights, O and I multiples of 32 (the scale tiles), at most
    ``CONFIG.max_tokens`` rows of x."""
    return (x_TI.shape[0] <= CONFIG.max_tokens
            and all(w.dtype == jnp.float8_e4m3fn and w.shape[0] % FP8_BLOCK == 0 and w.shape[1] % FP8_BLOCK == 0
                    for w in weights))


def _mgpu_takes(x_TI: jax.Array, weights: list[Weight], interpret: bool) -> bool:
    """Whether ``CONFIG.engine='mgpu'`` runs these linears on fp8_wgmma: a compute-capability-9 GPU, not
    interpreted, fp8 weights of shapes it takes, ``CONFIG.mgpu_min_tokens`` to ``CONFIG.mgpu_max_tokens`` rows."""
    if (CONFIG.engine != "mgpu" or interpret or not fp8_wgmma.available()
            or not CONFIG.mgpu_min_tokens <= x_TI.shape[0] <= CONFIG.mgpu_max_tokens):
        return False
    return all(w.dtype == jnp.float8_e4m3fn
               and fp8_wgmma.shape_error(x_TI.shape[0], w.shape[0], w.shape[1], CONFIG.mgpu_warpgroups) is None
               for w in weights)


def fp8_linear_pallas(x_TI: jax.Array, weight_OI: Weight, scale_BB: Weight, interpret: bool | None = None,
                      quantised: bool = False) -> jax.Array:
    """``fp8_linear_reference`` in one Pallas kernel (module docstring); other shapes take the reference.

    x_TI bf16 [T, I] (any leading shape is flattened by ``fp8_linear``); weight [O, I] e4m3; scale uint8
    [O/32, I/32] (either may be a ``LayerSlice``, read in place). -> bf16 [T, O]. ``interpret``: run the kernel
    interpreted (default: off a GPU); ``quantised``: as ``fp8_linears_pallas``'."""
    [y_TO] = fp8_linears_pallas(x_TI, [(weight_OI, scale_BB)], interpret=interpret, quantised=quantised)
    return y_TO


def _join(ys: list[jax.Array], joined: bool) -> list[jax.Array]:
    """``ys``, or with ``joined`` their one concatenation along the output features."""
    return [jnp.concatenate(ys, axis=-1)] if joined and len(ys) > 1 else ys


def fp8_linears_reference(x_TI: jax.Array, pairs: list[tuple[Weight, Weight]], joined: bool = False,
                          quantised: bool = False) -> list[jax.Array]:
    """``fp8_linear_reference`` of one x by each (weight, scale) pair. -> [bf16 [T, O_i]], or with ``joined`` one
    bf16 [T, sum O_i] (the outputs side by side). ``quantised``: as ``fp8_linear_reference``'s."""
    return _join([fp8_linear_reference(x_TI, weight_OI, scale_BB, quantised) for weight_OI, scale_BB in pairs],
                 joined)


def fp8_linears_pallas(x_TI: jax.Array, pairs: list[tuple[Weight, Weight]], joined: bool = False,
                       interpret: bool | None = None, quantised: bool = False) -> list[jax.Array]:
    """``fp8_linears_reference`` in one kernel launch: the weights' column tiles side by side in one grid (each
    program reads one weight's tile), so linears that share their input (wq_a and wkv, the shared expert's w1 and
    w3) cost one launch, and with split K one sum. Each output tile is computed as ``fp8_linear_pallas`` computes
    it alone; only the split count can differ (the grid is wider, so K may be split less), which changes the fp32
    order of the splits' sum. Weights the kernel cannot take together (or all, with ``CONFIG.fuse`` off) run one
    launch each (or on the reference). ``joined``: as ``fp8_linears_reference``'s; the one launch's output is
    that already (no copy). ``quantised``: x holds ``quant.fq8``'s values already (the kernel may skip its own
    fake-quantisation: ``KernelConfig.take_quantised``); the result is the same either way."""
    weights = [weight_OI for weight_OI, _ in pairs]
    if _mgpu_takes(x_TI, weights, interpret_mode(interpret)):
        return _join([fp8_wgmma.linear_mgpu(x_TI, weight_OI, scale_BB, stages=CONFIG.mgpu_stages,
                                            warpgroups=CONFIG.mgpu_warpgroups, target_ctas=CONFIG.target_programs,
                                            block_scales=CONFIG.mgpu_block_scales, quantised=quantised)
                      for weight_OI, scale_BB in pairs], joined)
    supported = pallas_supports(x_TI, *weights)
    if len(pairs) > 1 and not (CONFIG.fuse and supported):
        return _join([fp8_linear_pallas(x_TI, weight_OI, scale_BB, interpret, quantised)
                      for weight_OI, scale_BB in pairs], joined)
    if not supported:
        return fp8_linears_reference(x_TI, pairs, joined, quantised)
    if x_TI.shape[0] == 0:
        return _join([jnp.zeros((0, w.shape[0]), jnp.bfloat16) for w in weights], joined)
    call = _fp8_matvec_call if _matvec_takes(x_TI, weights, CONFIG) else _fp8_linear_call
    y_TO = call(x_TI, tuple(weights), tuple(scale for _, scale in pairs), config=CONFIG,
                interpret=interpret_mode(interpret), quantise=not (quantised and CONFIG.take_quantised))
    if joined:
        return [y_TO]
    bounds = np.cumsum([0] + [w.shape[0] for w in weights])
    return [y_TO[:, bounds[i]:bounds[i + 1]] for i in range(len(weights))]


def _stacks_in_place(weights: tuple[Weight, ...], scales: tuple[Weight, ...]):
    """(each weight's stack as uint32 words [L, O_i, I/4] (4 codes a word, little-endian: a bitcast, no copy), each
    scale stack [L, O_i/32, I/32], the layer index int32 []): what a kernel launch reads (``stacked.in_place``)."""
    stacks, layer = in_place([*weights, *scales])
    words = [jax.lax.bitcast_convert_type(w.reshape(*w.shape[:-1], w.shape[-1] // CODES_PER_WORD, CODES_PER_WORD),
                                          jnp.uint32) for w in stacks[:len(weights)]]
    return words, stacks[len(weights):], layer


@functools.partial(jax.jit, static_argnames=("config", "interpret", "quantise"))
def _fp8_linear_call(x_TI: jax.Array, weights: tuple[Weight, ...], scales: tuple[Weight, ...], *,
                     config: KernelConfig, interpret: bool, quantise: bool) -> jax.Array:
    """The kernel launch of ``fp8_linears_pallas``, jitted: the linears of one shape (the same projection in every
    layer) share one trace and lowering per step shape; ``config`` is part of the key. -> bf16 [T, sum O_i], the
    outputs side by side. ``quantise``: the kernel fake-quantises x (else x is fq8's values already)."""
    words, s_stacks, layer = _stacks_in_place(weights, scales)
    t, in_dim = x_TI.shape
    out_dims = [w.shape[0] for w in weights]
    rows = int(min(config.rows_max, max(MIN_DOT, pl.next_power_of_2(max(t, 1)))))
    cols = min(_tile(o, config.wide_cols if t >= config.wide_from else config.cols) for o in out_dims)
    depth = _tile(in_dim, config.depth)
    bounds = tuple(int(b) for b in np.cumsum([0] + [o // cols for o in out_dims]))
    tiles = bounds[-1] * -(-t // rows)
    splits = k_splits(tiles, in_dim // depth, config.target_programs)
    kernel = functools.partial(_kernel, n_tokens=t, rows=rows, cols=cols, depth=depth,
                               n_depth=in_dim // depth // splits, asm=not interpret, bounds=bounds,
                               quantise=quantise)
    grid = (bounds[-1], -(-t // rows), splits)
    total = sum(out_dims)
    out = jax.ShapeDtypeStruct((t, total) if splits == 1 else (splits, t, total),
                               jnp.bfloat16 if splits == 1 else jnp.float32)
    params = pltriton.CompilerParams(num_warps=config.warps, num_stages=config.stages)
    y = poison.pallas_call(kernel, layer[None], x_TI, *words, *s_stacks, out_shape=out, poison=config.poison,
                           grid=grid, compiler_params=params, name="fp8_linear", interpret=interpret)
    return y if splits == 1 else jnp.sum(y, axis=0).astype(jnp.bfloat16)


def decode_words(words_RW: jax.Array, asm: bool) -> list[jax.Array]:
    """The 4 e4m3 codes of each uint32 word (byte j is code j: little-endian) as float32, four arrays of the words'
    shape. ``asm`` (GPU): each code's exact value, two codes a ``cvt.rn.f16x2.e4m3x2`` (the hardware's fp8 pair
    conversion, sm_89 on) then a ``cvt.f32.f16`` each; otherwise ``decode_e4m3``'s ``value * 2^-8`` (interpreted:
    the mat-vec's scale multipliers then carry the 2^8). Pallas' Triton lowering takes one result per
    inline-asm call: codes 2h and 2h + 1 each repeat their pair's conversion, which ptxas merges."""
    if not asm:
        return [decode_e4m3((words_RW >> (8 * j)) & 0xFF) for j in range(CODES_PER_WORD)]
    word = jax.lax.bitcast_convert_type(words_RW, jnp.int32)
    shape = jax.ShapeDtypeStruct(words_RW.shape, jnp.float32)
    return [pltriton.elementwise_inline_asm(
        "{ .reg .b16 w0, w1, h0, h1; .reg .b32 p; mov.b32 {w0, w1}, $1; "
        f"cvt.rn.f16x2.e4m3x2 p, w{j // 2}; mov.b32 {{h0, h1}}, p; cvt.f32.f16 $0, h{j % 2}; }}",
        args=[word], constraints="=f,r", pack=1, result_shape_dtypes=[shape])[0] for j in range(CODES_PER_WORD)]


def _matvec_kernel(layer_ref, x_ref, *refs, rows: int, words: int, n_steps: int, asm: bool,
                   bounds: tuple[int, ...], quantise: bool):
    """Program n: outputs [n * rows, (n + 1) * rows) of the weights side by side (tiles [bounds[i], bounds[i+1])
    are weight i's) of one token, over all of K in ``n_steps`` steps of ``words`` words. ``refs``: each weight's
    words [L, O_i, I/4] and scale stack [L, O_i/32, I/32] (layer ``layer_ref[0]``), then the output bf16
    [1, sum O_i]. x_ref bf16 [1, I]: each step's 4 code phases (K positions 4w + j) are strided loads,
    fake-quantised together (``quantise``: 32-wide blocks are 8 words of every phase) or fq8's values already."""
    n_weights = len(bounds) - 1
    w_refs, s_refs, o_ref = refs[:n_weights], refs[n_weights:2 * n_weights], refs[-1]
    n, layer = pl.program_id(0), layer_ref[0]
    blocks = words // (FP8_BLOCK // CODES_PER_WORD)
    shift = 0 if asm else _F16_BIAS_FIX  # the scales carry the interpreted decode's 2^8 (``decode_words``)

    def tile(w_ref, s_ref, r0):
        row_R1 = (r0 + jnp.arange(rows))[:, None]
        last = n_steps - 1

        def load(k):  # step k's codes and scales (k = n_steps: the last step's again, loaded and unused)
            w0 = jnp.minimum(k, last) * words
            scale_RB = pltriton.load(s_ref.at[layer, row_R1 // FP8_BLOCK, (w0 // 8 + jnp.arange(blocks))[None, :]])
            return w_ref[layer, pl.ds(r0, rows), pl.ds(w0, words)], scale_RB

        def body(k, loaded, acc_R):
            words_RW, scale_RB = loaded
            k0 = k * words * CODES_PER_WORD
            x_J = [pltriton.load(x_ref.at[0, k0 + j + CODES_PER_WORD * jnp.arange(words)]).astype(jnp.float32)[None]
                   for j in range(CODES_PER_WORD)]
            if quantise:
                x_J = [x.astype(jnp.float32) for x in quant.fq8_tiles(x_J)]
            p_RW = functools.reduce(lambda a, b: a + b, [w * x for w, x in zip(decode_words(words_RW, asm), x_J)])
            block_RB = p_RW.reshape(rows, blocks, words // blocks).sum(axis=-1)
            return acc_R + (block_RB * quant.ue8m0_pow2(scale_RB, shift)).sum(axis=-1)

        y_R = prefetch.fori_loop_ahead(n_steps, load, body, jnp.zeros((rows,), jnp.float32))
        o_ref[0, pl.ds(n * rows, rows)] = y_R.astype(o_ref.dtype)

    _each_weight(tile, n, bounds, w_refs, s_refs, rows)


def _matvec_takes(x_TI: jax.Array, weights: list[Weight], config: KernelConfig) -> bool:
    """Whether a launch runs on the mat-vec kernel: ``config.matvec``, one token, K of at least
    ``matvec_min_in`` and at least ``matvec_min_codes`` weight codes in the launch (the shapes it was faster at)."""
    in_dim = x_TI.shape[1]
    return (config.matvec and x_TI.shape[0] == 1 and in_dim >= config.matvec_min_in
            and sum(w.shape[0] for w in weights) * in_dim >= config.matvec_min_codes)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "quantise"))
def _fp8_matvec_call(x_TI: jax.Array, weights: tuple[Weight, ...], scales: tuple[Weight, ...], *,
                     config: KernelConfig, interpret: bool, quantise: bool) -> jax.Array:
    """``_fp8_linear_call``'s contract for one token (T = 1) on ``_matvec_kernel``. -> bf16 [1, sum O_i]."""
    w_words, s_stacks, layer = _stacks_in_place(weights, scales)
    in_dim = x_TI.shape[1]
    out_dims = [w.shape[0] for w in weights]
    rows = config.matvec_rows
    words = FP8_BLOCK // CODES_PER_WORD  # a step's words: the most (a power of two) dividing K's, one block at least
    while (words * 2 <= config.matvec_words // rows and (in_dim // CODES_PER_WORD) % (words * 2) == 0):
        words *= 2
    bounds = tuple(int(b) for b in np.cumsum([0] + [o // rows for o in out_dims]))
    kernel = functools.partial(_matvec_kernel, rows=rows, words=words, n_steps=in_dim // CODES_PER_WORD // words,
                               asm=not interpret, bounds=bounds, quantise=quantise)
    return poison.pallas_call(kernel, layer[None], x_TI, *w_words, *s_stacks,
                              out_shape=jax.ShapeDtypeStruct((1, sum(out_dims)), jnp.bfloat16), poison=config.poison,
                              grid=(bounds[-1],), name="fp8_matvec", interpret=interpret,
                              compiler_params=pltriton.CompilerParams(num_warps=config.matvec_warps, num_stages=1))


_IMPLEMENTATIONS = {"reference": fp8_linears_reference, "pallas": fp8_linears_pallas}


def fp8_linear(x: jax.Array, weight_OI: Weight, scale_BB: Weight, *, impl: str = "reference",
               quantised: bool = False) -> jax.Array:
    """The fp8 linear seam: x [..., I] bf16 -> bf16 [..., O]; ``impl`` in IMPLS (static). ``weight_OI`` and
    ``scale_BB``: arrays, or ``LayerSlice``s of one layer of stacked weights (module docstring). ``quantised``: x
    holds ``quant.fq8``'s values already (``fp8_linears_pallas``)."""
    [y] = fp8_linears(x, [(weight_OI, scale_BB)], impl=impl, quantised=quantised)
    return y


def fp8_linears(x: jax.Array, pairs: list[tuple[Weight, Weight]], *, impl: str = "reference",
                joined: bool = False, quantised: bool = False) -> list[jax.Array]:
    """Several fp8 linears of one input: x [..., I] bf16, (weight [O_i, I], scale) pairs -> [bf16 [..., O_i]], each
    what ``fp8_linear`` gives, or with ``joined`` one bf16 [..., sum O_i], the outputs side by side (what a kernel
    reading them all takes without a copy of each); the Pallas implementation runs them as one launch
    (``fp8_linears_pallas``; ``quantised`` as there)."""
    if impl not in _IMPLEMENTATIONS:
        raise ValueError(f"fp8 linear impl must be one of {IMPLS}, got {impl!r}")
    x_TI = x.reshape(-1, x.shape[-1])
    ys = _IMPLEMENTATIONS[impl](x_TI, pairs, joined, quantised=quantised)
    return [y_TO.reshape(*x.shape[:-1], y_TO.shape[-1]) for y_TO in ys]
