"""FP8 / FP4 fake quantisation and block-scaled weights, bit-exact with the reference kernels (v41_spec §12).

Every function is pure jnp and takes bf16 (or fp32 that is bf16-representable) input, like the reference kernels.
Dequantised values are returned in bf16: an e4m3 or e2m1 code times a power-of-two (or e4m3) scale always fits
bf16's 8 significant bits, so the round trip is exact and a GEMM on the dequantised operands with fp32
accumulation reproduces the reference's block-scaled GEMM up to summation order.

Storage conventions (checkpoint-native, never up-cast in storage):
  * fp8 weights: ``float8_e4m3fn`` [out, in] with ue8m0 scales as raw ``uint8`` exponents [ceil(out/32), in/32];
  * MXFP4 experts: ``uint8`` [out, in/2], two e2m1 codes per byte, the even element in the low nibble, with
    ue8m0 scales ``uint8`` [out, in/32];
  * Engram table rows: ``float8_e4m3fn`` [rows, width] with ue8m0 ``uint8`` scales [rows, width/32].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dijax.kernels.numerics import divide

FP8_BLOCK = 32  # one fp8 scale per 32x32 weight tile / per 32 activations (v41_spec §12)
FP4_BLOCK = 32  # MXFP4 experts and the indexer's fp4 path: one scale per 32 values
LATENT_FP4_BLOCK = 16  # compressed-KV latents: fp4 with one e4m3 scale per 16 values
FP8_MAX = 448.0
FP4_MAX = 6.0
_FP8_MAX_INV = np.float32(1.0 / FP8_MAX)
_FP4_MAX_INV = np.float32(1.0 / FP4_MAX)
# e2m1 magnitudes by 3-bit code; midpoints between neighbours and whether a tie rounds up (to an even code).
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
_E2M1_MIDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
_E2M1_TIE_UP = np.array([False, True, False, True, False, True, False])
FP4_TABLE = np.concatenate([E2M1_GRID, -E2M1_GRID])  # 4-bit code (bit 3 = sign) -> value


def pow2_scale(amax_f32: jax.Array, inv_max: np.float32) -> jax.Array:
    """``2^ceil(log2(amax * inv_max))`` computed from the IEEE bits exactly like ``fast_round_scale``.

    amax_f32: any shape, float32 (positive). Returns float32 powers of two, same shape.
    """
    y = amax_f32.astype(jnp.float32) * inv_max
    bits = jax.lax.bitcast_convert_type(y, jnp.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & ((1 << 23) - 1)
    log2_ceil = exponent - 127 + (mantissa != 0).astype(jnp.int32)
    return jax.lax.bitcast_convert_type((log2_ceil + 127) << 23, jnp.float32)


def ue8m0_pow2(scale_u8: jax.Array, shift: int = 0) -> jax.Array:
    """ue8m0 bytes s -> float32 ``2^(s - 127 + shift)`` straight from the bits (kernels fold a decode factor into
    ``shift``); exact while s + shift is in [1, 254]."""
    return jax.lax.bitcast_convert_type((scale_u8.astype(jnp.int32) + shift) << 23, jnp.float32)


def e4m3_round(x_f32: jax.Array) -> jax.Array:
    """Round float32 to the nearest e4m3 value (ties to even), saturating at +-448. Returns float32."""
    clipped = jnp.clip(x_f32.astype(jnp.float32), -FP8_MAX, FP8_MAX)
    return clipped.astype(jnp.float8_e4m3fn).astype(jnp.float32)


def e4m3_round_arith(v_f32: jax.Array) -> jax.Array:
    """``e4m3_round`` for |v| <= 448 by float arithmetic only (no fp8 conversion: usable inside GPU kernels).

    Adding and subtracting ``2^(q + 23)``, where 2^q is the e4m3 spacing at |v| (2^(e - 3) for a normal |v| in
    [2^e, 2^(e+1)), 2^-9 for subnormals), rounds |v| to that spacing with float32's own round-half-to-even.
    Returns float32 with v's sign (zero as +0).
    """
    mag = jnp.abs(v_f32.astype(jnp.float32))
    exponent = ((jax.lax.bitcast_convert_type(mag, jnp.int32) >> 23) & 0xFF) - 127
    spacing = jnp.maximum(exponent, -6) - 3
    magic = jax.lax.bitcast_convert_type((spacing + 23 + 127) << 23, jnp.float32)
    rounded = (mag + magic) - magic
    return jnp.where(v_f32 < 0, -rounded, rounded)


def e2m1_round(v_f32: jax.Array) -> jax.Array:
    """Round float32 in [-6, 6] to the e2m1 grid with round-half-to-even codes. Returns float32 (sign kept)."""
    mag = jnp.abs(v_f32)[..., None]
    code = (jnp.sum(mag > _E2M1_MIDS, axis=-1)
            + jnp.sum((mag == _E2M1_MIDS) & _E2M1_TIE_UP, axis=-1))
    value = jnp.asarray(E2M1_GRID)[code]
    return jnp.where(jnp.signbit(v_f32), -value, value)


def _groups(x: jax.Array, block: int) -> jax.Array:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quant block {block}")
    return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fq8(x: jax.Array, block: int = FP8_BLOCK) -> jax.Array:
    """Fake-quantise activations to e4m3 with one ue8m0 scale per ``block`` values (``act_quant`` in place).

    x: [..., K] bf16. Returns [..., K] bf16 holding q * s exactly.
    """
    xg = _groups(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1, keepdims=True), np.float32(1e-4))
    s = pow2_scale(amax, _FP8_MAX_INV)
    q = e4m3_round(divide(xg, s))
    return (q * s).reshape(x.shape).astype(jnp.bfloat16)


def fq8_tiles(x_tiles: list[jax.Array]) -> list[jax.Array]:
    """``fq8`` inside a kernel, of float32 tiles [T, K] that share each 32-wide block: with n tiles, block b is
    columns [b * 32/n, (b + 1) * 32/n) of every tile (n = 1: plain 32-wide blocks, the routed gate-up GEMM's
    output; n = 2: the fp8 linear's ``pair_columns`` tiles). -> bf16 tiles, bit for bit ``fq8``'s values.

    The scale comes from the amax's bits as in ``pow2_scale``; x / s is a multiplication by the exact power of
    two 1 / s; e4m3 rounding is ``e4m3_round_arith`` (no fp8 conversion, which Triton on the H200 lacks)."""
    t, k = x_tiles[0].shape
    group = FP8_BLOCK // len(x_tiles)
    groups = [x.reshape(t, k // group, group) for x in x_tiles]
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x), axis=-1) for x in groups])
    scale = pow2_scale(jnp.maximum(amax, np.float32(1e-4)), _FP8_MAX_INV)
    inverse = jax.lax.bitcast_convert_type((254 << 23) - jax.lax.bitcast_convert_type(scale, jnp.int32), jnp.float32)
    return [(e4m3_round_arith(x * inverse[:, :, None]) * scale[:, :, None]).reshape(t, k).astype(jnp.bfloat16)
            for x in groups]


def fq4_pow2(x: jax.Array, block: int = FP4_BLOCK) -> jax.Array:
    """fp4 path A (index q and keys): e2m1 with one ue8m0 scale per ``block``. x: [..., K] bf16 -> bf16."""
    xg = _groups(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1, keepdims=True), np.float32(6 * 2.0 ** -126))
    s = pow2_scale(amax, _FP4_MAX_INV)
    v = jnp.clip(divide(xg, s), -FP4_MAX, FP4_MAX)
    return (e2m1_round(v) * s).reshape(x.shape).astype(jnp.bfloat16)


def fq4_e4m3(x: jax.Array, block: int = LATENT_FP4_BLOCK) -> jax.Array:
    """fp4 path B (compressed-KV latents): e2m1 with one e4m3 scale per ``block``. x: [..., K] bf16 -> bf16.

    The scale is ``e4m3(amax / 6)`` and values are divided by it (the fixtures were produced dividing).
    """
    xg = _groups(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1, keepdims=True), np.float32(6 * 2.0 ** -9))
    s = e4m3_round(divide(amax, FP4_MAX))
    v = jnp.clip(divide(xg, s), -FP4_MAX, FP4_MAX)
    return (e2m1_round(v) * s).reshape(x.shape).astype(jnp.bfloat16)


def ue8m0_to_f32(exponent_u8: jax.Array) -> jax.Array:
    """ue8m0 scale bytes -> float32 ``2^(e - 127)`` (e = 0 gives 2^-127, a float32 subnormal; 255 is NaN)."""
    e = exponent_u8.astype(jnp.int32)
    normal = jax.lax.bitcast_convert_type(e << 23, jnp.float32)
    value = jnp.where(e == 0, np.float32(2.0 ** -127), normal)
    return jnp.where(e == 255, np.float32(np.nan), value)


def dequant_fp8_weight(weight: jax.Array, scale_u8: jax.Array, block: int = FP8_BLOCK) -> jax.Array:
    """e4m3 [out, in] with ue8m0 [ceil(out/block), in/block] tile scales -> bf16 [out, in] (exact)."""
    out_dim, in_dim = weight.shape
    s = ue8m0_to_f32(scale_u8)
    s = jnp.repeat(jnp.repeat(s, block, axis=0)[:out_dim], block, axis=1)[:, :in_dim]
    return (weight.astype(jnp.float32) * s).astype(jnp.bfloat16)


def unpack_fp4(packed_u8: jax.Array) -> jax.Array:
    """uint8 [..., K/2] (low nibble = even element) -> float32 e2m1 values [..., K]."""
    table = jnp.asarray(FP4_TABLE)
    low = table[(packed_u8 & 0x0F).astype(jnp.int32)]
    high = table[(packed_u8 >> 4).astype(jnp.int32)]
    return jnp.stack([low, high], axis=-1).reshape(*packed_u8.shape[:-1], packed_u8.shape[-1] * 2)


def dequant_fp4_weight(packed_u8: jax.Array, scale_u8: jax.Array, block: int = FP4_BLOCK) -> jax.Array:
    """MXFP4 uint8 [..., out, in/2] with ue8m0 [..., out, in/32] -> bf16 [..., out, in] (exact)."""
    values = unpack_fp4(packed_u8)
    s = jnp.repeat(ue8m0_to_f32(scale_u8), block, axis=-1)
    return (values * s).astype(jnp.bfloat16)


def dequant_rows_fp8(rows: jax.Array, scale_u8: jax.Array, block: int = FP8_BLOCK) -> jax.Array:
    """e4m3 rows [..., W] with ue8m0 [..., W/block] -> bf16 [..., W] (Engram table lookup)."""
    s = jnp.repeat(ue8m0_to_f32(scale_u8), block, axis=-1)
    return (rows.astype(jnp.float32) * s).astype(jnp.bfloat16)
