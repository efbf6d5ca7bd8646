"""The flash-decoding merge: split partial sums of an online softmax with a sink, added in fp32 (v41_spec §16).

A list of indices split into S parts gives, per part, the fp32 sums acc = sum_j p_j v_j and den = sum_j p_j with
p_j = exp(s_j - m), relative to that part's running max m. ``merge_splits`` rescales every part to the overall max,
adds them, puts the sink into the denominator (``exp(sink - max)``, unscaled: the sink has no value row) and divides.
Both sparse-attention kernels (``sparse_attn``'s Triton one, ``sparse_attn_mgpu``) merge their splits here.

Letters: T tokens, S splits, H heads, K head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dijax.kernels.numerics import divide


def merge_splits(acc_TSHK: jax.Array, max_TSH: jax.Array, den_TSH: jax.Array, sink_H: jax.Array) -> jax.Array:
    """The splits' fp32 partials (acc [T, S, H, K], running max and denominator [T, S, H]) and the sink logits
    (float32 [H]) -> the attention output, bf16 [T, H, K]."""
    running_max = jnp.max(max_TSH, axis=1)
    weight_TSH = jnp.exp(max_TSH - running_max[:, None, :])
    acc = jnp.sum(acc_TSHK * weight_TSH[..., None], axis=1)
    denom = jnp.sum(den_TSH * weight_TSH, axis=1) + jnp.exp(sink_H.astype(jnp.float32)[None, :] - running_max)
    return divide(acc, denom[..., None]).astype(jnp.bfloat16)
