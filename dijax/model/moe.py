"""Mixture of experts (v41_spec §9): sqrtsoftplus gate with a selection-only bias, MXFP4 routed SwiGLU experts
with fp8 activations (behind the kernel seam, dijax/kernels/routed_experts.py), one fp8 shared expert.

Letters: T tokens, D model dim, X experts per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dijax.config import ModelConfig
from dijax.kernels import quant
from dijax.kernels.routed_experts import routed_experts, swiglu
from dijax.model.layers import linear, matmul_f32
from dijax.kernels.numerics import divide


def gate(p: dict, x_TD: jax.Array, n_active: int, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Route each token. Returns (weights_TX float32, experts_TX int32), experts in ascending id order.

    scores = sqrt(softplus(x @ W.T / gate_temp)) in fp32; the top-X of ``scores + bias`` are selected; weights are
    the unbiased scores of the selected experts, renormalised (sum + 1e-20) and times route_scale.
    """
    logits = divide(matmul_f32(x_TD.astype(jnp.float32), p["weight"].astype(jnp.float32)), cfg.gate_temp)
    softplus = jnp.where(logits > 20, logits, jnp.log1p(jnp.exp(jnp.minimum(logits, 20))))
    scores = jnp.sqrt(softplus)
    _, experts = jax.lax.top_k(scores + p["bias"], n_active)
    experts = jnp.sort(experts, axis=-1)  # the reference sums expert outputs in expert-id order
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob and n_active > 1:
        weights = divide(weights, jnp.sum(weights, axis=-1, keepdims=True) + np.float32(1e-20))
    return weights * np.float32(cfg.route_scale), experts.astype(jnp.int32)


def shared_expert(p: dict, x_TD: jax.Array, limit: float) -> jax.Array:
    """The fp8 shared expert: ``w2(silu(min(w1 x, l)) * clip(w3 x, +-l))``. -> bf16 [T, D]."""
    h = swiglu(linear(x_TD, p["w1"]).astype(jnp.float32), linear(x_TD, p["w3"]).astype(jnp.float32), limit)
    return linear(h.astype(jnp.bfloat16), p["w2"])


def moe(p: dict, x_TD: jax.Array, cfg: ModelConfig, *, impl: str = "reference") -> jax.Array:
    """MoE sublayer. x_TD: bf16 (after ffn_norm) -> bf16 [T, D]. ``impl``: the routed-experts kernel seam's
    implementation ('reference' or 'pallas', static)."""
    weights, experts = gate(p["gate"], x_TD, cfg.n_activated_experts, cfg)
    y = routed_experts(p["experts"], x_TD, weights, experts, cfg.swiglu_limit, impl=impl)
    y = y + shared_expert(p["shared_experts"], x_TD, cfg.swiglu_limit).astype(jnp.float32)
    return y.astype(jnp.bfloat16)
