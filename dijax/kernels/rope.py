"""Rotary embedding with YaRN (v41_spec §11): the per-pair frequencies, the angles of a step's positions, and the
rotation of a head's tail in interleaved (GPT-J) pairs. Shared by the model and the kernels that rotate inside
(``dijax.kernels.latents``).

Letters: T tokens, R rope dims (R / 2 pairs).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dijax.kernels.numerics import large_step


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


def angles(positions_T: jax.Array, freqs: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin of ``position * freq`` (the angle in float32, as the reference), float32 [T, R / 2] each."""
    angle = positions_T.astype(jnp.float32)[:, None] * jnp.asarray(freqs)[None, :]
    return jnp.cos(angle), jnp.sin(angle)


def rope(x: jax.Array, positions: jax.Array, freqs: np.ndarray, inverse: bool = False) -> jax.Array:
    """Rotate the last ``2 * len(freqs)`` dims of x in interleaved (GPT-J) pairs at ``positions``.

    x: [T, ..., K] bf16; positions: [T] int32 (broadcast over the middle axes). Pair (2i, 2i+1) is a complex
    number multiplied by ``exp(i * pos * freqs[i])`` in float32 (conjugate when ``inverse``), then rounded back.
    """
    rd = 2 * len(freqs)
    cos, sin = angles(positions, freqs)
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (len(freqs),)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    tail = x[..., -rd:].astype(jnp.float32).reshape(*x.shape[:-1], rd // 2, 2)
    a, b = tail[..., 0], tail[..., 1]
    rotated = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(*x.shape[:-1], rd)
    if large_step(x.shape[0]):
        return x.at[..., -rd:].set(rotated.astype(x.dtype))
    return jnp.concatenate([x[..., :-rd], rotated.astype(x.dtype)], axis=-1)
