"""Mixture of experts (v41_spec §9): sqrtsoftplus gate with a selection-only bias, MXFP4 routed SwiGLU experts
with fp8 activations, one fp8 shared expert.

Letters: T tokens, D model dim, E experts, X experts per token, F expert width, A = T * X assignments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dijax.config import ModelConfig
from dijax.model import quant
from dijax.model.layers import linear, matmul_f32
from dijax.model.numerics import divide


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


def _swiglu(gate_f32: jax.Array, up_f32: jax.Array, limit: float) -> jax.Array:
    if limit > 0:
        up_f32 = jnp.clip(up_f32, -limit, limit)
        gate_f32 = jnp.minimum(gate_f32, limit)
    return jax.nn.silu(gate_f32) * up_f32


def shared_expert(p: dict, x_TD: jax.Array, limit: float) -> jax.Array:
    """The fp8 shared expert: ``w2(silu(min(w1 x, l)) * clip(w3 x, +-l))``. -> bf16 [T, D]."""
    h = _swiglu(linear(x_TD, p["w1"]).astype(jnp.float32), linear(x_TD, p["w3"]).astype(jnp.float32), limit)
    return linear(h.astype(jnp.bfloat16), p["w2"])


def _expert_weights(experts: dict, name: str) -> jax.Array:
    """Stacked routed-expert weight dequantised to bf16: [E, out, in]."""
    w = experts[name]["weight"]
    if w.dtype == jnp.uint8:
        return quant.dequant_fp4_weight(w, experts[name]["scale"])
    return jax.vmap(quant.dequant_fp8_weight)(w, experts[name]["scale"])


def routed_experts(experts: dict, x_TD: jax.Array, weights_TX: jax.Array, experts_TX: jax.Array,
                   limit: float) -> jax.Array:
    """Sum over each token's experts of ``w_e * expert_e(x)``, in expert-id order, in fp32. -> float32 [T, D].

    experts: stacked {'w1','w2','w3': {'weight': [E, ...], 'scale': [E, ...]}}. Assignments are sorted by expert
    and run as grouped GEMMs (``ragged_dot``) on the dequantised weights.
    """
    t, d = x_TD.shape
    x_act = quant.fq8(x_TD)
    n_experts = experts["w1"]["weight"].shape[0]
    flat_expert = experts_TX.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    token_of = (jnp.arange(flat_expert.shape[0]) // experts_TX.shape[1])[order]
    group_sizes = jnp.bincount(flat_expert, length=n_experts).astype(jnp.int32)
    xs = x_act[token_of]

    def grouped(lhs_AI: jax.Array, w_EOI: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot(lhs_AI, jnp.swapaxes(w_EOI, 1, 2), group_sizes,
                                  precision=jax.lax.Precision.HIGHEST,
                                  preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    g = grouped(xs, _expert_weights(experts, "w1")).astype(jnp.float32)
    u = grouped(xs, _expert_weights(experts, "w3")).astype(jnp.float32)
    h = _swiglu(g, u, limit) * weights_TX.reshape(-1)[order][:, None]
    y = grouped(quant.fq8(h.astype(jnp.bfloat16)), _expert_weights(experts, "w2"))
    per_token = jnp.zeros_like(y).at[order].set(y).reshape(t, experts_TX.shape[1], d)
    total = jnp.zeros((t, d), jnp.float32)
    for i in range(experts_TX.shape[1]):
        total = total + per_token[:, i].astype(jnp.float32)
    return total


def moe(p: dict, x_TD: jax.Array, cfg: ModelConfig) -> jax.Array:
    """MoE sublayer. x_TD: bf16 (after ffn_norm) -> bf16 [T, D]."""
    weights, experts = gate(p["gate"], x_TD, cfg.n_activated_experts, cfg)
    y = routed_experts(p["experts"], x_TD, weights, experts, cfg.swiglu_limit)
    y = y + shared_expert(p["shared_experts"], x_TD, cfg.swiglu_limit).astype(jnp.float32)
    return y.astype(jnp.bfloat16)
