"""Mixture of experts (v41_spec §9): sqrtsoftplus gate with a selection-only bias, MXFP4 routed SwiGLU experts
with fp8 activations, one fp8 shared expert.

Letters: T tokens, D model dim, E experts, X experts per token, F expert width, A = T * X assignments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dijax.config import ModelConfig
from dijax.kernels import quant
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


def _swiglu(gate_f32: jax.Array, up_f32: jax.Array, limit: float) -> jax.Array:
    if limit > 0:
        up_f32 = jnp.clip(up_f32, -limit, limit)
        gate_f32 = jnp.minimum(gate_f32, limit)
    return jax.nn.silu(gate_f32) * up_f32


def shared_expert(p: dict, x_TD: jax.Array, limit: float) -> jax.Array:
    """The fp8 shared expert: ``w2(silu(min(w1 x, l)) * clip(w3 x, +-l))``. -> bf16 [T, D]."""
    h = _swiglu(linear(x_TD, p["w1"]).astype(jnp.float32), linear(x_TD, p["w3"]).astype(jnp.float32), limit)
    return linear(h.astype(jnp.bfloat16), p["w2"])


def _expert_weights(experts: dict, name: str, expert_A: jax.Array | None = None) -> jax.Array:
    """Routed-expert weight ``name`` dequantised to bf16: all experts [E, out, in], or, given ``expert_A``, only
    those experts' (gathered while still packed, then dequantised) [A, out, in].

    Storage: MXFP4 ``uint8`` [E, out, in/2] with ue8m0 [E, out, in/32], or fp8 [E, out, in] with ue8m0 tiles.
    """
    w, scale = experts[name]["weight"], experts[name]["scale"]
    if expert_A is not None:
        w, scale = w[expert_A], scale[expert_A]
    if w.dtype == jnp.uint8:
        return quant.dequant_fp4_weight(w, scale)
    return jax.vmap(quant.dequant_fp8_weight)(w, scale)


def routed_path(n_assignments: int, n_experts: int) -> str:
    """The static choice of ``routed_experts``: 'gathered' when A <= E, else 'ragged'.

    Measured on an H200 at the real sizes (E = 384, 2304 x 5120 MXFP4 experts, docs/benchmarks.md): gathered takes
    0.44 / 2.5 / 9.2 ms a layer at A = 6 / 96 / 384, ragged 18.6 / 19.4 / 30.0 ms (it dequantises every expert).
    """
    return "gathered" if n_assignments <= n_experts else "ragged"


def routed_experts(experts: dict, x_TD: jax.Array, weights_TX: jax.Array, experts_TX: jax.Array,
                   limit: float, path: str | None = None) -> jax.Array:
    """Sum over each token's experts of ``w_e * expert_e(x)``, in expert-id order, in fp32. -> float32 [T, D].

    experts: stacked {'w1','w2','w3': {'weight': [E, ...], 'scale': [E, ...]}}; x_TD bf16; weights_TX float32;
    experts_TX int32, ascending per token. Two paths, chosen statically from the shapes (``path`` forces one):
      * 'gathered' (A <= E, e.g. decode steps): the A assigned experts' packed weights and scales are gathered and
        only those are dequantised, then each assignment is a batched matrix-vector product. Memory traffic is A
        expert matrices instead of E (a decode step of one token touches X of the model's 384 experts);
      * 'ragged' (A > E, e.g. prefill): all E experts are dequantised once, assignments are sorted by expert and
        run as grouped GEMMs (``ragged_dot``); here every expert is likely used and the weights are shared.
    Both paths round every GEMM output to bf16 alike and sum the X experts of a token in expert-id order.
    """
    t, d = x_TD.shape
    n_per_token = experts_TX.shape[1]
    n_experts = experts["w1"]["weight"].shape[0]
    expert_A = experts_TX.reshape(-1)
    path = path or routed_path(expert_A.shape[0], n_experts)
    token_A = jnp.arange(expert_A.shape[0]) // n_per_token
    weights_A = weights_TX.reshape(-1)
    if path == "gathered":  # assignment a = t * X + i is (token t, slot i): no reordering
        order_A = None

        def matmul(lhs_AI: jax.Array, name: str) -> jax.Array:
            w_AOI = _expert_weights(experts, name, expert_A)
            return jnp.einsum("ai,aoi->ao", lhs_AI, w_AOI, precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    elif path == "ragged":  # assignments sorted by expert, one group per expert
        order_A = jnp.argsort(expert_A, stable=True)
        token_A, weights_A = token_A[order_A], weights_A[order_A]
        group_sizes_E = jnp.bincount(expert_A, length=n_experts).astype(jnp.int32)

        def matmul(lhs_AI: jax.Array, name: str) -> jax.Array:
            w_EIO = jnp.swapaxes(_expert_weights(experts, name), 1, 2)
            return jax.lax.ragged_dot(lhs_AI, w_EIO, group_sizes_E, precision=jax.lax.Precision.HIGHEST,
                                      preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    else:
        raise ValueError(f"unknown routed-experts path {path!r} (expected 'gathered' or 'ragged')")

    x_AD = quant.fq8(x_TD)[token_A]
    g_AF = matmul(x_AD, "w1").astype(jnp.float32)
    u_AF = matmul(x_AD, "w3").astype(jnp.float32)
    h_AF = _swiglu(g_AF, u_AF, limit) * weights_A[:, None]
    y_AD = matmul(quant.fq8(h_AF.astype(jnp.bfloat16)), "w2")
    if order_A is not None:
        y_AD = jnp.zeros_like(y_AD).at[order_A].set(y_AD)
    y_TXD = y_AD.reshape(t, n_per_token, d)
    total_TD = jnp.zeros((t, d), jnp.float32)
    for i in range(n_per_token):
        total_TD = total_TD + y_TXD[:, i].astype(jnp.float32)
    return total_TD


def moe(p: dict, x_TD: jax.Array, cfg: ModelConfig) -> jax.Array:
    """MoE sublayer. x_TD: bf16 (after ffn_norm) -> bf16 [T, D]."""
    weights, experts = gate(p["gate"], x_TD, cfg.n_activated_experts, cfg)
    y = routed_experts(p["experts"], x_TD, weights, experts, cfg.swiglu_limit)
    y = y + shared_expert(p["shared_experts"], x_TD, cfg.swiglu_limit).astype(jnp.float32)
    return y.astype(jnp.bfloat16)
