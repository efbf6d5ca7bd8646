"""Arithmetic that keeps the reference's rounding where XLA would otherwise change it.

XLA's algebraic simplifier rewrites ``x / broadcast(y)`` into ``x * broadcast(1 / y)``, which rounds differently
from a true division. DeepSeek's reference divides (softmax normalisation, Sinkhorn, fp4 scales, means), and at
e2m1/e4m3 rounding ties one ulp decides the code, so dijax divides by a divisor the rewrite does not match: a
select of the broadcast divisor. The select fuses into the division's consumer; the optimisation barrier used
before it made XLA materialise every broadcast divisor as a kernel of its own (97 of the tiny decode step's 600
launches on the H200, docs/benchmarks.md, twentieth session).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


# Steps of this many tokens or more take the forms that avoid a full-size copy of an activation; smaller steps
# (decode) take the forms that fuse into their neighbours, where a copy is small and an extra launch is not.
# ``rope`` writes the rotated tail into x in place instead of concatenating: on the H200 (twenty-fourth session)
# the concatenation rewrote every column of prefill 8192's q and o (14 copies of [8192, 64, 512], 5.5 ms a step),
# while the update at every size added 11 launches to flash-slice decode at batch 1. The hyper-connections'
# projection (``hc.mixes``) takes bf16 x against the weight's exact bf16 parts (``matmul_f32_weight``) instead of
# an fp32 copy of x and an fp32 GEMM.
LARGE_STEP_TOKENS = 256


def large_step(tokens: int) -> bool:
    """Whether a step of ``tokens`` tokens takes the copy-avoiding forms (``LARGE_STEP_TOKENS``)."""
    return tokens >= LARGE_STEP_TOKENS


def divide(x: jax.Array, y: jax.Array | float) -> jax.Array:
    """Correctly rounded ``x / y`` with y broadcast to x's shape (never a reciprocal multiply).

    The divisor is ``where(x == x, y, x)``: y wherever x is a number, x itself where x is NaN, so the quotient is
    x / y everywhere (NaN / anything is NaN), and the simplifier sees a select, not a broadcast."""
    y = jnp.broadcast_to(jnp.asarray(y, x.dtype), x.shape)
    return x / jnp.where(x == x, y, x)


def mean(x: jax.Array, axis: int = -1, keepdims: bool = True) -> jax.Array:
    """``sum(x) / n`` over ``axis`` with a true division (as torch's mean)."""
    total = jnp.sum(x, axis=axis, keepdims=keepdims)
    return divide(total, float(x.shape[axis]))


def rms_factor(squares: jax.Array, width: int, eps: float) -> jax.Array:
    """``rsqrt(squares / width + eps)`` (a true division, as ``mean``): an RMS norm's factor from a sum of ``width``
    squares, float32."""
    return jax.lax.rsqrt(divide(squares, float(width)) + np.float32(eps))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``weight * x * rsqrt(mean(x^2) + eps)`` in float32, cast back to x's dtype. x: [..., N], weight: [N]."""
    xf = x.astype(jnp.float32)
    y = xf * rms_factor(jnp.sum(jnp.square(xf), axis=-1, keepdims=True), x.shape[-1], eps)
    return (weight.astype(jnp.float32) * y).astype(x.dtype)


def sum_in_order(x: jax.Array, axis: int, front: bool = False) -> jax.Array:
    """Sum over a short axis strictly left to right, keeping the axis (size 1): the order the reference's reductions
    use, so the bits match (XLA's reduce may pair the terms differently).

    The layout XLA picks around it depends on the form (the same bits either way). By default the slices are added
    in place: moving the axis to the front made XLA lay the hyper-connection streams out [C, T, D] and transpose
    them back around every kernel reading them (tiny decode, thirty-eighth session, deviceless). ``front`` moves
    it first: the form the hyper-connections take where the split kernel writes entry-major (``dijax.model.hc``)."""
    if front:
        parts = jnp.moveaxis(x, axis, 0)
        return jnp.expand_dims(functools.reduce(lambda a, b: a + b, list(parts)), axis)
    total = jax.lax.slice_in_dim(x, 0, 1, axis=axis)
    for i in range(1, x.shape[axis]):
        total = total + jax.lax.slice_in_dim(x, i, i + 1, axis=axis)
    return total


def matmul_f32(x: jax.Array, w_OI: jax.Array) -> jax.Array:
    """``x @ w_OI.T`` with exact products and float32 accumulation. x: [..., I], w: [O, I] -> float32 [..., O]."""
    return jnp.einsum("...i,oi->...o", x, w_OI, preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST)


def einsum_bf16(spec: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    """``einsum(spec, lhs, rhs)`` of bf16 operands with exact products, fp32 accumulation and one rounding to bf16:
    the value of the fp32 einsum cast to bf16, but the GEMM writes bf16 itself. (The fp32 output and its convert
    kernel cost prefill 8192 on the H200 4.7 ms in 32 converts plus the fp32 writes: docs/benchmarks.md,
    twenty-fourth session. XLA's bf16 GEMMs, cuBLAS and Triton alike, accumulate in fp32.)"""
    return jnp.einsum(spec, lhs, rhs, preferred_element_type=jnp.bfloat16, precision=jax.lax.Precision.HIGHEST)
