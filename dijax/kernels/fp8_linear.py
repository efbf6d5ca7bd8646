"""The fp8 block-scaled linear (v41_spec §12): ``bf16(fq8(x) @ dequant(W).T)`` behind one signature.

``fp8_linear(x, weight, scale, impl=)``; the choice is static (part of the step's jit key):
  * 'reference': fake-quantise x (``quant.fq8``), dequantise the whole weight to bf16 in XLA, one fp32-accumulated
    GEMM (the semantics; three XLA kernels and a bf16 copy of the weight per call);
  * 'pallas': one Triton-lowered ``pl.pallas_call`` per call. Each program owns a [rows x cols] output tile and
    one of ``splits`` parts of K, walks its part in slices, fake-quantises its activation slice in registers
    (per-32 amax, power-of-two scale from the bits, e4m3 rounding by float arithmetic), decodes its e4m3 weight
    codes with integer bit operations, applies the 32 x 32 tile scales, and runs a tensor-core bf16 dot with fp32
    accumulation. The weight is read once, as bytes. Split K (flash-decoding style) keeps a decode step's grid
    wide enough to fill the GPU when O / cols tiles are few: the splits' fp32 partial sums are added in XLA.

Numerics: every fake-quantised activation and every dequantised weight is a bf16 value, so each product is exact in
fp32 and both implementations sum the same exact products in fp32; only the summation order differs (a bf16 ulp
at rounding ties of the output). Weight scales are exact for ue8m0 exponents 0..246 (real scales sit near 2^-8).

Stacked layers: ``weight`` and ``scale`` may be ``LayerSlice``s (dijax.kernels.stacked), one layer of a scanned
stack of layers. The kernel then reads that layer's rows of the stack in place (the layer index is an operand), so
the scan never copies the weight out of the stack; the reference takes the slice.

Why integer decoding of the weight: Mosaic GPU's e4m3 -> bf16 needs PTX ISA 9.2 (the H200 image has 9.0), and the
bit trick is two shifts, a mask and an or: the 7 magnitude bits of e4m3 land on float16's exponent / mantissa
boundary, so the float16 equals the e4m3 value times 2^-8 for every code, subnormals included.

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

from dijax.kernels import interpret_mode, poison, quant
from dijax.kernels.quant import FP8_BLOCK
from dijax.kernels.stacked import LayerSlice, in_place, materialize

IMPLS = ("reference", "pallas")
MIN_DOT = 16  # Triton's dot needs every dimension >= 16
_F16_BIAS_FIX = 8  # a decoded e4m3 code is value * 2^-8 (float16 bias 15 against e4m3's 7)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tiles and Triton launch parameters. Sizes are powers of two; ``cols`` and ``depth`` are halved until they
    divide their dimension (never below 32, the scale block). ``rows`` grows to cover up to ``rows_max`` tokens.
    K is split into the fewest parts (a divisor of its slices) that give ``target_programs`` programs. Steps of
    more than ``max_tokens`` tokens take the reference (XLA's dequantisation, then cuBLAS: faster on the H200
    once the GEMM is compute bound, see docs/benchmarks.md).

    poison: outputs start NaN-filled (tests: an element no program writes shows)."""
    rows_max: int = 64
    cols: int = 64
    depth: int = 128
    warps: int = 4
    stages: int = 3
    target_programs: int = 264  # two per multiprocessor of an H200: K is split until the grid has this many
    max_tokens: int = 32
    poison: bool = False


CONFIG = KernelConfig()


Weight = jax.Array | LayerSlice


def fp8_linear_reference(x_TI: jax.Array, weight_OI: Weight, scale_BB: Weight) -> jax.Array:
    """The reference: x [T, I] bf16, weight [O, I] float8_e4m3fn, scale uint8 [ceil(O/32), I/32] -> bf16 [T, O]."""
    w_OI = quant.dequant_fp8_weight(materialize(weight_OI), materialize(scale_BB))
    y = jnp.einsum("ti,oi->to", quant.fq8(x_TI), w_OI, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST)
    return y.astype(jnp.bfloat16)


def decode_e4m3(codes_u8: jax.Array) -> jax.Array:
    """e4m3 bytes (uint8, any shape) -> float32 ``value * 2^-8`` by integer bit operations (exact; NaN not kept)."""
    c = codes_u8.astype(jnp.int32)
    bits = ((c & 0x7F) << 7) | ((c & 0x80) << 8)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def scale_multiplier(scale_u8: jax.Array) -> jax.Array:
    """ue8m0 bytes s -> float32 ``2^(s - 127 + 8)``, undoing ``decode_e4m3``'s 2^-8 (exact for s <= 246)."""
    return quant.ue8m0_pow2(scale_u8, _F16_BIAS_FIX)


def fq8_tile(x_TK: jax.Array) -> jax.Array:
    """``quant.fq8`` of a float32 tile [T, K] (K a multiple of 32) with kernel-friendly arithmetic -> bf16 [T, K].

    The scale comes from the amax's bits as in ``quant.pow2_scale``; x / s is a multiplication by the exact power
    of two 1 / s; e4m3 rounding is ``quant.e4m3_round_arith``. Equal to ``quant.fq8`` bit for bit."""
    t, k = x_TK.shape
    xg = x_TK.reshape(t, k // FP8_BLOCK, FP8_BLOCK)
    amax = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1), np.float32(1e-4))
    scale = quant.pow2_scale(amax, np.float32(1.0 / quant.FP8_MAX))
    inverse = jax.lax.bitcast_convert_type((254 << 23) - jax.lax.bitcast_convert_type(scale, jnp.int32), jnp.float32)
    q = quant.e4m3_round_arith(xg * inverse[:, :, None])
    return (q * scale[:, :, None]).reshape(t, k).astype(jnp.bfloat16)


def _expand_scales(scale_BB: jax.Array, cols: int, depth: int) -> jax.Array:
    """Tile scales [cols/32, depth/32] -> one multiplier per weight element [cols, depth] (float32)."""
    rb, kb = scale_BB.shape
    per_row = jnp.broadcast_to(scale_BB[:, None, :], (rb, FP8_BLOCK, kb)).reshape(cols, kb)
    return jnp.broadcast_to(per_row[:, :, None], (cols, kb, FP8_BLOCK)).reshape(cols, depth)


def _kernel(layer_ref, x_ref, w_ref, s_ref, o_ref, *, n_tokens: int, rows: int, cols: int, depth: int,
            n_depth: int):
    """Program (n, m, k): output rows [m*rows, (m+1)*rows) (masked past the last token), columns [n*cols, ...),
    over K slices [k*n_depth, (k+1)*n_depth) of ``depth``, reading layer ``layer_ref[0]`` of the weight stack
    [L, O, I] and of the scale stack. The output is bf16 [T, O], or with split K the fp32 partial sums
    [splits, T, O]."""
    n0, m0 = pl.program_id(0) * cols, pl.program_id(1) * rows
    layer = layer_ref[0]
    first = pl.program_id(2) * n_depth
    row_R = m0 + jnp.arange(rows)
    live_R1 = (row_R < n_tokens)[:, None]
    safe_R1 = jnp.minimum(row_R, n_tokens - 1)[:, None]

    def step(k, acc):
        k0 = (first + k) * depth
        col_K = k0 + jnp.arange(depth)
        x_RK = pltriton.load(x_ref.at[safe_R1, col_K[None, :]], mask=jnp.broadcast_to(live_R1, (rows, depth)),
                             other=0).astype(jnp.float32)
        codes_NK = w_ref[layer, pl.ds(n0, cols), pl.ds(k0, depth)]
        scale_BB = s_ref[layer, pl.ds(n0 // FP8_BLOCK, cols // FP8_BLOCK),
                         pl.ds(k0 // FP8_BLOCK, depth // FP8_BLOCK)]
        w_NK = (decode_e4m3(codes_NK) * _expand_scales(scale_multiplier(scale_BB), cols, depth)).astype(jnp.bfloat16)
        return acc + jax.lax.dot_general(fq8_tile(x_RK), w_NK, (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, n_depth, step, jnp.zeros((rows, cols), jnp.float32))
    col_N = n0 + jnp.arange(cols)
    # masked rows keep their own (out-of-range) indices: interpret mode drops them, where clamped duplicates would
    # write stale values over a live row
    index = (row_R[:, None], col_N[None, :])
    if len(o_ref.shape) == 3:  # split K: this split's plane of fp32 partial sums
        index = (jnp.full((rows, 1), pl.program_id(2)),) + index
    pltriton.store(o_ref.at[index], acc.astype(o_ref.dtype), mask=jnp.broadcast_to(live_R1, (rows, cols)))


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


def pallas_supports(x_TI: jax.Array, weight_OI: Weight) -> bool:
    """Shapes the kernel takes: O and I multiples of 32 (the scale tiles), fp8 weights, at most
    ``CONFIG.max_tokens`` rows of x."""
    out_dim, in_dim = weight_OI.shape
    return (weight_OI.dtype == jnp.float8_e4m3fn and out_dim % FP8_BLOCK == 0 and in_dim % FP8_BLOCK == 0
            and x_TI.shape[0] <= CONFIG.max_tokens)


def fp8_linear_pallas(x_TI: jax.Array, weight_OI: Weight, scale_BB: Weight,
                      interpret: bool | None = None) -> jax.Array:
    """``fp8_linear_reference`` in one Pallas kernel (module docstring); other shapes take the reference.

    x_TI bf16 [T, I] (any leading shape is flattened by ``fp8_linear``); weight [O, I] e4m3; scale uint8
    [O/32, I/32] (either may be a ``LayerSlice``, read in place). -> bf16 [T, O]. ``interpret``: run the kernel
    interpreted (default: off a GPU)."""
    if not pallas_supports(x_TI, weight_OI):
        return fp8_linear_reference(x_TI, weight_OI, scale_BB)
    if x_TI.shape[0] == 0:
        return jnp.zeros((0, weight_OI.shape[0]), jnp.bfloat16)
    return _fp8_linear_call(x_TI, weight_OI, scale_BB, config=CONFIG, interpret=interpret_mode(interpret))


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _fp8_linear_call(x_TI: jax.Array, weight_OI: Weight, scale_BB: Weight, *, config: KernelConfig,
                     interpret: bool) -> jax.Array:
    """The kernel launch of ``fp8_linear_pallas``, jitted: the linears of one shape (the same projection in every
    layer) share one trace and lowering per step shape; ``config`` is part of the key."""
    (w_LOI, s_LBB), layer = in_place([weight_OI, scale_BB])
    t, in_dim = x_TI.shape
    out_dim = weight_OI.shape[0]
    rows = int(min(config.rows_max, max(MIN_DOT, pl.next_power_of_2(max(t, 1)))))
    cols, depth = _tile(out_dim, config.cols), _tile(in_dim, config.depth)
    tiles = (out_dim // cols) * -(-t // rows)
    splits = k_splits(tiles, in_dim // depth, config.target_programs)
    kernel = functools.partial(_kernel, n_tokens=t, rows=rows, cols=cols, depth=depth,
                               n_depth=in_dim // depth // splits)
    grid = (out_dim // cols, -(-t // rows), splits)
    out = jax.ShapeDtypeStruct((t, out_dim) if splits == 1 else (splits, t, out_dim),
                               jnp.bfloat16 if splits == 1 else jnp.float32)
    params = pltriton.CompilerParams(num_warps=config.warps, num_stages=config.stages)
    codes_LOI = jax.lax.bitcast_convert_type(w_LOI, jnp.uint8)
    y = poison.pallas_call(kernel, layer[None], x_TI, codes_LOI, s_LBB, out_shape=out, poison=config.poison, grid=grid,
                           compiler_params=params, name="fp8_linear", interpret=interpret)
    return y if splits == 1 else jnp.sum(y, axis=0).astype(jnp.bfloat16)


_IMPLEMENTATIONS = {"reference": fp8_linear_reference, "pallas": fp8_linear_pallas}


def fp8_linear(x: jax.Array, weight_OI: Weight, scale_BB: Weight, *, impl: str = "reference") -> jax.Array:
    """The fp8 linear seam: x [..., I] bf16 -> bf16 [..., O]; ``impl`` in IMPLS (static). ``weight_OI`` and
    ``scale_BB``: arrays, or ``LayerSlice``s of one layer of stacked weights (module docstring)."""
    if impl not in _IMPLEMENTATIONS:
        raise ValueError(f"fp8 linear impl must be one of {IMPLS}, got {impl!r}")
    x_TI = x.reshape(-1, x.shape[-1])
    y_TO = _IMPLEMENTATIONS[impl](x_TI, weight_OI, scale_BB)
    return y_TO.reshape(*x.shape[:-1], weight_OI.shape[0])
