"""Sparse single-KV-head attention with an attention sink, over per-query index lists (v41_spec §4 step 5, §16).

This is the pure-jnp reference; a Pallas kernel with the same signature belongs beside it.

Semantics of the reference kernel (parity README §6.5): the index list is walked in blocks of 64 with an online
softmax whose running max starts at -1e30; probabilities are taken relative to the *running* max, summed in fp32
for the denominator and cast to bf16 before the PV product; the sink ``exp(sink_h - max)`` joins the denominator
unscaled; index -1 contributes nothing and a row with no valid index returns 0.

Letters: T query tokens, H heads, K head dim, L list length, N rows of a KV source.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dijax.kernels.numerics import divide

BLOCK = 64
HIGHEST = jax.lax.Precision.HIGHEST


def gather_rows(sources: tuple[jax.Array, ...], idx: jax.Array) -> jax.Array:
    """Rows of the virtual concatenation of ``sources`` (each [N_i, K]) at ``idx`` (any shape, -1 allowed).

    Returns float32 [*idx.shape, K]; rows for idx = -1 are zero. No concatenated copy is made.
    """
    out = jnp.zeros((*idx.shape, sources[0].shape[-1]), jnp.float32)
    base = 0
    for src in sources:
        local = idx - base
        hit = (local >= 0) & (local < src.shape[0])
        rows = src[jnp.clip(local, 0, src.shape[0] - 1)].astype(jnp.float32)
        out = jnp.where(hit[..., None], rows, out)
        base += src.shape[0]
    return out


def sparse_attn(q_THK: jax.Array, kv_sources: tuple[jax.Array, ...], idx_TL: jax.Array, sink_H: jax.Array,
                softmax_scale: float) -> jax.Array:
    """Attention of each query over the rows its index list names (K = V, one KV head).

    q_THK: bf16 queries; kv_sources: bf16 [N_i, K] arrays addressed as one concatenation; idx_TL: int32 indices
    (-1 = none); sink_H: float32 sink logits. Returns bf16 [T, H, K].
    """
    t, h, k = q_THK.shape
    length = idx_TL.shape[1]
    pad = -length % BLOCK
    if pad:
        idx_TL = jnp.concatenate([idx_TL, jnp.full((t, pad), -1, idx_TL.dtype)], axis=1)
    q = q_THK.astype(jnp.float32)
    scale = np.float32(softmax_scale)
    acc = jnp.zeros((t, h, k), jnp.float32)
    denom = jnp.zeros((t, h), jnp.float32)
    running_max = jnp.full((t, h), -1e30, jnp.float32)
    def block(b, carry):
        acc, denom, running_max = carry
        idx = jax.lax.dynamic_slice_in_dim(idx_TL, b * BLOCK, BLOCK, axis=1)
        valid = idx >= 0
        kv = gather_rows(kv_sources, idx)  # [T, 64, K], zero where invalid
        s = jnp.einsum("thk,tlk->thl", q, kv, precision=HIGHEST)
        s = jnp.where(valid[:, None, :], s, -jnp.inf) * scale
        new_max = jnp.maximum(running_max, jnp.max(s, axis=-1))
        alpha = jnp.exp(running_max - new_max)
        p = jnp.exp(s - new_max[..., None])
        denom = denom * alpha + jnp.sum(p, axis=-1)
        p16 = p.astype(jnp.bfloat16).astype(jnp.float32)
        acc = acc * alpha[..., None] + jnp.einsum("thl,tlk->thk", p16, kv, precision=HIGHEST)
        return acc, denom, new_max

    acc, denom, running_max = jax.lax.fori_loop(0, idx_TL.shape[1] // BLOCK, block, (acc, denom, running_max))
    denom = denom + jnp.exp(sink_H.astype(jnp.float32)[None, :] - running_max)
    return divide(acc, denom[..., None]).astype(jnp.bfloat16)
