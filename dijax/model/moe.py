"""Mixture of experts (v41_spec §9): sqrtsoftplus gate with a selection-only bias, MXFP4 routed SwiGLU experts
with fp8 activations (behind the kernel seam, dijax/kernels/routed_experts.py), one fp8 shared expert.

Letters: T tokens, D model dim, X experts per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dijax.config import ModelConfig
from dijax.kernels import quant, router
from dijax.kernels.routed_experts import swiglu
from dijax.model.layers import QuantLinear, linear, linears, matmul_promoted, param, values
from dijax.parallel.moe import routed_experts_ep
from dijax.kernels.numerics import divide


def gate(p: dict, x_TD: jax.Array, n_active: int, cfg: ModelConfig, impl: str = "reference",
         valid_T: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Route each token. Returns (weights_TX float32, experts_TX int32), experts in ascending id order; a token
    whose ``valid_T`` is False gets expert -1 in every slot.

    scores = sqrt(softplus(x @ W.T / gate_temp)) in fp32; the top-X of ``scores + bias`` are selected; weights are
    the unbiased scores of the selected experts, renormalised (sum + 1e-20) and times route_scale
    (``dijax.kernels.router``, whose implementation ``impl`` selects).
    """
    logits = divide(matmul_promoted(x_TD, p["weight"]), cfg.gate_temp)
    softplus = jnp.where(logits > 20, logits, jnp.log1p(jnp.exp(jnp.minimum(logits, 20))))
    return router.route(jnp.sqrt(softplus), p["bias"], n_active, cfg.norm_topk_prob, cfg.route_scale, valid_T,
                        impl=impl)


def shared_expert(p: dict, x_act_TD: jax.Array, limit: float, linear_impl: str = "reference") -> jax.Array:
    """The fp8 shared expert: ``w2(silu(min(w1 x, l)) * clip(w3 x, +-l))``. x_act_TD: ``quant.fq8(x)``, as w1 and
    w3 quantise x (the routed experts' activations; their kernel may take them as they are). -> bf16 [T, D]."""
    gate, up = linears(x_act_TD, [p["w1"], p["w3"]], linear_impl, quantised=True)  # one launch on the Pallas path
    h = swiglu(gate.astype(jnp.float32), up.astype(jnp.float32), limit)
    return linear(h.astype(jnp.bfloat16), p["w2"], linear_impl)


def moe(p: dict, x_TD: jax.Array, cfg: ModelConfig, valid_T: jax.Array | None = None, *,
        x_act_TD: jax.Array | None = None, impl: str = "reference", linear_impl: str = "reference",
        router_impl: str = "reference") -> jax.Array:
    """MoE sublayer. x_TD: bf16 (after ffn_norm) -> bf16 [T, D]. valid_T: bool [T], False for the step's padding
    tokens, which are routed to no expert (expert id -1: no expert weights are read for them by the kernel).
    x_act_TD: ``quant.fq8(x_TD)``, the routed experts' activations, where the caller has it (the input norm's
    kernel writes it beside x_TD: ``dijax.kernels.collapse``); else computed here.
    ``impl``: the routed-experts kernel seam's implementation ('reference' or 'pallas', static); ``linear_impl``:
    the shared expert's fp8 linears' (``dijax.kernels.fp8_linear``); ``router_impl``: the router's selection's
    (``dijax.kernels.router``). Under a context mesh with an ``ep`` axis the routed experts run split over it
    (dijax.parallel.moe)."""
    weights, experts = gate(p["gate"], x_TD, cfg.n_activated_experts, cfg, router_impl, valid_T)
    x_act_TD = quant.fq8(x_TD) if x_act_TD is None else x_act_TD
    y = routed_experts_ep(p["experts"], x_act_TD, weights, experts, cfg.swiglu_limit, impl=impl)
    y = y + shared_expert(p["shared_experts"], x_act_TD, cfg.swiglu_limit, linear_impl).astype(jnp.float32)
    return y.astype(jnp.bfloat16)


class Gate(nnx.Module):
    """The router: bf16 ``weight`` [E, D] and the fp32 selection-only ``bias`` [E] (see ``gate``)."""

    def __init__(self, cfg: ModelConfig, stack: tuple[int, ...] = ()):
        self.weight = param(stack, (cfg.n_routed_experts, cfg.dim), jnp.bfloat16, ("expert", "embed"))
        self.bias = param(stack, (cfg.n_routed_experts,), jnp.float32, ("expert",))


class ExpertMatrix(nnx.Module):
    """One weight of every routed expert, stacked: MXFP4 uint8 [E, out, in / 2] with ue8m0 [E, out, in / 32], or
    fp8 [E, out, in] with ue8m0 32x32 tiles (``expert_dtype``); read in place when its layers are stacked."""

    def __init__(self, n_experts: int, in_dim: int, out_dim: int, expert_dtype: str | None,
                 stack: tuple[int, ...] = ()):
        axes = ("expert", "expert_out", "expert_in")
        if expert_dtype == "fp4":
            self.weight = param(stack, (n_experts, out_dim, in_dim // 2), jnp.uint8, axes, in_place=True)
            self.scale = param(stack, (n_experts, out_dim, in_dim // 32), jnp.uint8, axes, in_place=True)
        else:
            self.weight = param(stack, (n_experts, out_dim, in_dim), jnp.float8_e4m3fn, axes, in_place=True)
            self.scale = param(stack, (n_experts, -(-out_dim // 32), -(-in_dim // 32)), jnp.uint8, axes,
                               in_place=True)


class RoutedExperts(nnx.Module):
    """The routed SwiGLU experts ``w1``, ``w3`` [F, D] and ``w2`` [D, F], stacked over all E experts (split over
    the ``ep`` mesh axis under expert parallelism, dijax.parallel)."""

    def __init__(self, cfg: ModelConfig, stack: tuple[int, ...] = ()):
        n_experts, d, f, kind = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim, cfg.expert_dtype
        self.w1 = ExpertMatrix(n_experts, d, f, kind, stack)
        self.w2 = ExpertMatrix(n_experts, f, d, kind, stack)
        self.w3 = ExpertMatrix(n_experts, d, f, kind, stack)


class SharedExpert(nnx.Module):
    """The fp8 shared expert: ``w1``, ``w3`` [F, D], ``w2`` [D, F] (see ``shared_expert``)."""

    def __init__(self, cfg: ModelConfig, stack: tuple[int, ...] = ()):
        self.w1 = QuantLinear(cfg.dim, cfg.moe_inter_dim, "fp8", ("mlp", "embed"), stack)
        self.w2 = QuantLinear(cfg.moe_inter_dim, cfg.dim, "fp8", ("embed", "mlp"), stack)
        self.w3 = QuantLinear(cfg.dim, cfg.moe_inter_dim, "fp8", ("mlp", "embed"), stack)


class MoE(nnx.Module):
    """The MoE sublayer (checkpoint ``ffn``): ``gate``, ``experts``, ``shared_experts``."""

    def __init__(self, cfg: ModelConfig, stack: tuple[int, ...] = ()):
        self.cfg = cfg
        self.gate = Gate(cfg, stack)
        self.experts = RoutedExperts(cfg, stack)
        self.shared_experts = SharedExpert(cfg, stack)

    def __call__(self, x_TD: jax.Array, valid_T: jax.Array | None = None, **kernel_options) -> jax.Array:
        """x_TD bf16 (after ffn_norm) -> bf16 [T, D]; valid_T and ``kernel_options`` go to ``moe`` unchanged."""
        return moe(values(self), x_TD, self.cfg, valid_T, **kernel_options)
