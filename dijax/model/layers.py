"""Shared building blocks: linear layers by storage dtype, RMSNorm, rotary embedding (with YaRN).

Dimension letters (README glossary): T tokens of the step, D model dim, K head dim, R rope dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dijax.kernels import numerics, quant

HIGHEST = jax.lax.Precision.HIGHEST


def matmul_f32(x: jax.Array, w_OI: jax.Array) -> jax.Array:
    """``x @ w_OI.T`` with exact products and float32 accumulation. x: [..., I], w: [O, I] -> float32 [..., O]."""
    return jnp.einsum("...i,oi->...o", x, w_OI, preferred_element_type=jnp.float32, precision=HIGHEST)


def linear(x: jax.Array, p: dict) -> jax.Array:
    """The reference ``linear()``: the GEMM is chosen by the weight's storage dtype.

    x: [..., in] bf16; p: {'weight': [out, in], optional 'scale'}.
      * fp8 (e4m3 + ue8m0 32x32 tiles): x is fake-quantised to e4m3 per 32, block-scaled GEMM -> bf16;
      * MXFP4 (uint8 packed + ue8m0 1x32): x fake-quantised to e4m3 per 32 -> bf16;
      * bf16: plain bf16 GEMM (fp32 accumulation) -> bf16;
      * fp32: ``x.float() @ W.T`` -> float32.
    """
    w = p["weight"]
    if w.dtype == jnp.float8_e4m3fn:
        w_deq = quant.dequant_fp8_weight(w, p["scale"])
        return matmul_f32(quant.fq8(x), w_deq).astype(jnp.bfloat16)
    if w.dtype == jnp.uint8:
        w_deq = quant.dequant_fp4_weight(w, p["scale"])
        return matmul_f32(quant.fq8(x), w_deq).astype(jnp.bfloat16)
    if w.dtype == jnp.float32:
        return matmul_f32(x.astype(jnp.float32), w)
    return matmul_f32(x.astype(jnp.bfloat16), w).astype(jnp.bfloat16)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``weight * x * rsqrt(mean(x^2) + eps)`` in float32, cast back to x's dtype. x: [..., N], weight: [N]."""
    xf = x.astype(jnp.float32)
    var = numerics.mean(jnp.square(xf))
    y = xf * jax.lax.rsqrt(var + np.float32(eps))
    return (weight.astype(jnp.float32) * y).astype(x.dtype)


def rope_frequencies(rope_dim: int, base: float, original_seq_len: int, factor: float, beta_fast: float,
                     beta_slow: float) -> np.ndarray:
    """Per-pair inverse frequencies [rope_dim / 2] float32, with the YaRN blend when original_seq_len > 0 (§11)."""
    exponents = np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim)
    # base ** e correctly rounded to float32, as torch's pow(scalar, tensor) produces it
    powers = np.power(np.float64(base), exponents.astype(np.float64)).astype(np.float32)
    freqs = (np.float32(1.0) / powers).astype(np.float32)
    if original_seq_len > 0:
        def corrected_dim(rotations: float) -> float:
            return rope_dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected_dim(beta_fast)), 0)
        high = min(math.ceil(corrected_dim(beta_slow)), rope_dim - 1)
        ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - np.float32(low))
                       / np.float32(max(high - low, 1e-3)), 0, 1).astype(np.float32)
        smooth = np.float32(1) - ramp
        freqs = (freqs / np.float32(factor) * (np.float32(1) - smooth) + freqs * smooth).astype(np.float32)
    return freqs


def rope(x: jax.Array, positions: jax.Array, freqs: np.ndarray, inverse: bool = False) -> jax.Array:
    """Rotate the last ``2 * len(freqs)`` dims of x in interleaved (GPT-J) pairs at ``positions``.

    x: [T, ..., K] bf16; positions: [T] int32 (broadcast over the middle axes). Pair (2i, 2i+1) is a complex
    number multiplied by ``exp(i * pos * freqs[i])`` in float32 (conjugate when ``inverse``), then rounded back.
    """
    rd = 2 * len(freqs)
    angle = positions.astype(jnp.float32)[:, None] * jnp.asarray(freqs)[None, :]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (len(freqs),)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    tail = x[..., -rd:].astype(jnp.float32).reshape(*x.shape[:-1], rd // 2, 2)
    a, b = tail[..., 0], tail[..., 1]
    rotated = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(*x.shape[:-1], rd)
    return jnp.concatenate([x[..., :-rd], rotated.astype(x.dtype)], axis=-1)
