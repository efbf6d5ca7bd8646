"""Pairs of bf16 values in one uint32 word: the pieces of a weight-only kernel's in-register decode, kept apart from
any one code format: the routed experts' grouped GEMM (MXFP4 codes) and the fp8 linear (e4m3 codes) build their
decodes on them.

The kernel decodes two packed codes at once into the two bf16 halves of a uint32 (integer shifts and masks; each
half is the code's value times a fixed power of two), then scales both halves by one ``mul.rn.bf16x2`` against a
per-block power of two, and feeds the pairs to a tensor-core dot. No float16 / float32 round trip, no conversions:
at decode shapes the kernels are bound by instruction issue, so the instructions per code set their speed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton


def pow2_pair(exponent_u32: jax.Array) -> jax.Array:
    """Biased bf16 exponents e (uint32, 1..254) -> uint32 holding the bf16 ``2^(e - 127)`` in both halves."""
    return (exponent_u32 << 7) | (exponent_u32 << 23)


def scaled_pair_asm(bits_u32: jax.Array, scale_u32: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Both halves of bf16 pairs ``bits`` times the bf16x2 ``scale`` by ``mul.rn.bf16x2`` (inline PTX: GPU lowering
    only; it keeps bf16 subnormals, which XLA on the CPU flushes) -> (low, high) bf16, each the shape of ``bits``.

    Pallas' Triton lowering takes one result per inline-asm call: each half's call repeats the multiply, and ptxas
    merges the two (one HMUL2 per pair in the sm_90 build)."""
    args = [jax.lax.bitcast_convert_type(a, jnp.int32) for a in (bits_u32, scale_u32)]
    shape = jax.ShapeDtypeStruct(bits_u32.shape, jnp.bfloat16)

    def half(h: int) -> jax.Array:
        halves = ("$0, u", "u, $0")[h]
        [out] = pltriton.elementwise_inline_asm(
            f"{{ .reg .b32 t; .reg .b16 u; mul.rn.bf16x2 t, $1, $2; mov.b32 {{{halves}}}, t; }}",
            args=args, constraints="=h,r,r", pack=1, result_shape_dtypes=[shape])
        return out

    return half(0), half(1)


def repeat_blocks(x_AB: jax.Array, rows: int, cols: int) -> jax.Array:
    """[A, B] -> [A * rows, B * cols], each element repeated over a rows x cols block (a block scale spread over
    the weights it scales), by broadcasts and reshapes only."""
    a, b = x_AB.shape
    if rows > 1:
        x_AB = jnp.broadcast_to(x_AB[:, None, :], (a, rows, b)).reshape(a * rows, b)
    if cols > 1:
        x_AB = jnp.broadcast_to(x_AB[:, :, None], (a * rows, b, cols)).reshape(a * rows, b * cols)
    return x_AB


def side_by_side(low: jax.Array, high: jax.Array) -> jax.Array:
    """Two [N, W] tiles -> [N, 2 W] with low[:, w] and high[:, w] in columns 2 w and 2 w + 1."""
    n, w = low.shape
    return jnp.stack([low, high], axis=-1).reshape(n, 2 * w)


def dot_nt(lhs_MK: jax.Array, rhs_NK: jax.Array) -> jax.Array:
    """lhs [M, K] times rhs [N, K] transposed, fp32 accumulation -> float32 [M, N]."""
    return jax.lax.dot_general(lhs_MK, rhs_NK, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
