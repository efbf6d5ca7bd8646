"""Routed experts: the gathered path (A <= E: only the assigned experts are dequantised) and the ragged path
(A > E: all experts dequantised, grouped GEMMs) agree bit for bit, both match a naive per-token loop, and the
path is chosen statically from the shapes. Runs on the embedded tiny config (E = 8, X = 2) with random weights.
"""

from __future__ import annotations

import os

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dijax
from dijax.config import ModelConfig
from dijax.kernels import quant
from dijax.kernels import routed_experts as rx
from dijax.model import moe
from dijax.io.random_init import random_params
from dijax.model.param_map import checkpoint_tree

TINY_CONFIG = os.path.join(os.path.dirname(dijax.__file__), "assets", "tiny", "config.json")
TOKEN_COUNTS = (1, 4, 5, 9)  # with E = 8 and X = 2: T <= 4 is gathered (A <= E), T >= 5 ragged
LAYERS = (0, 5)


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.from_file(TINY_CONFIG)
    assert (cfg.n_routed_experts, cfg.n_activated_experts) == (8, 2)  # the token counts above rely on it
    return cfg, checkpoint_tree(cfg, random_params(cfg, seed=3))


def _inputs(cfg: ModelConfig, ffn: dict, t: int, seed: int, scale: float = 6.0):
    """bf16 x_TD (large enough for the SwiGLU clamp to engage) and its routing from ``moe.gate``."""
    x_TD = (jax.random.normal(jax.random.PRNGKey(seed), (t, cfg.dim), jnp.float32) * scale).astype(jnp.bfloat16)
    weights_TX, experts_TX = moe.gate(ffn["gate"], x_TD, cfg.n_activated_experts, cfg)
    return x_TD, weights_TX, experts_TX


_routed_jit = jax.jit(rx.routed_experts_reference, static_argnames=("limit", "path"))


def _routed(experts: dict, x_TD, weights_TX, experts_TX, limit: float, path: str | None) -> np.ndarray:
    """The routed experts of x_TD, fq8'd first as ``moe.moe`` does (the seam takes quantised activations)."""
    return np.asarray(_routed_jit(experts, quant.fq8(x_TD), weights_TX, experts_TX, limit=limit, path=path))


def _bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def _bf16(a: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 (nearest even) and back, as ``.astype(bfloat16)`` does."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _naive_routed(experts: dict, x_TD, weights_TX, experts_TX, limit: float) -> tuple[np.ndarray, int]:
    """Per token, per expert in id order: dequantise that expert, SwiGLU with the clamp, weight, w2; sum in fp32.

    GEMMs accumulate in float64 (the bf16 x bf16 products are exact) and round to float32 then bf16, like a bf16
    GEMM with fp32 accumulation up to summation order. Returns (float32 [T, D], number of clamped values).
    """
    def expert_weight(name: str, e: int) -> np.ndarray:
        w, s = experts[name]["weight"][e], experts[name]["scale"][e]
        deq = quant.dequant_fp4_weight(w, s) if w.dtype == jnp.uint8 else quant.dequant_fp8_weight(w, s)
        return np.asarray(deq, np.float64)

    def gemm(w_OI: np.ndarray, v_I: np.ndarray) -> np.ndarray:
        return _bf16((w_OI @ np.asarray(v_I, np.float64)).astype(np.float32))

    x_act_TD = np.asarray(quant.fq8(x_TD), np.float32)
    weights_TX, experts_TX = np.asarray(weights_TX), np.asarray(experts_TX)
    assert np.all(np.diff(experts_TX, axis=1) > 0)  # ascending, distinct
    total_TD = np.zeros(x_act_TD.shape, np.float32)
    clamped = 0
    for t in range(x_act_TD.shape[0]):
        for i in range(experts_TX.shape[1]):  # expert-id order
            e = int(experts_TX[t, i])
            g, u = gemm(expert_weight("w1", e), x_act_TD[t]), gemm(expert_weight("w3", e), x_act_TD[t])
            clamped += int(np.sum(g > limit) + np.sum(np.abs(u) > limit))
            g, u = np.minimum(g, np.float32(limit)), np.clip(u, np.float32(-limit), np.float32(limit))
            h = (g / (np.float32(1) + np.exp(-g))) * u * weights_TX[t, i]
            h_act = np.asarray(quant.fq8(jnp.asarray(h.astype(np.float32)).astype(jnp.bfloat16)), np.float32)
            total_TD[t] = total_TD[t] + gemm(expert_weight("w2", e), h_act)
    return total_TD, clamped


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("t", TOKEN_COUNTS)
def test_gathered_and_ragged_paths_agree_bit_for_bit(tiny, t, layer):
    cfg, params = tiny
    ffn = params["layers"][layer]["ffn"]
    x_TD, weights_TX, experts_TX = _inputs(cfg, ffn, t, seed=100 * layer + t)
    gathered = _routed(ffn["experts"], x_TD, weights_TX, experts_TX, cfg.swiglu_limit, "gathered")
    ragged = _routed(ffn["experts"], x_TD, weights_TX, experts_TX, cfg.swiglu_limit, "ragged")
    auto = _routed(ffn["experts"], x_TD, weights_TX, experts_TX, cfg.swiglu_limit, None)
    assert gathered.shape == (t, cfg.dim) and gathered.dtype == np.float32
    # Exact on CPU (observed, jax 0.12): bf16 x bf16 products are exact in fp32, XLA's CPU ragged_dot is a dense
    # dot over zero-masked groups (adding exact zeros changes nothing), and XLA's CPU dot accumulates each output
    # in the same order for the batched mat-vec as for the grouped GEMM; the bf16 roundings and the fp32 sum over
    # experts are shared code. Bit-equality is what keeps decode (gathered) and prefill (ragged) batch-invariant.
    np.testing.assert_array_equal(_bits(gathered), _bits(ragged))
    np.testing.assert_array_equal(_bits(auto), _bits(gathered))
    assert np.all(np.isfinite(gathered)) and np.abs(gathered).max() > 0


@pytest.mark.parametrize("t", TOKEN_COUNTS)
def test_both_paths_match_a_naive_per_token_loop(tiny, t):
    cfg, params = tiny
    ffn = params["layers"][2]["ffn"]
    x_TD, weights_TX, experts_TX = _inputs(cfg, ffn, t, seed=7 + t)
    expected, clamped = _naive_routed(ffn["experts"], x_TD, weights_TX, experts_TX, cfg.swiglu_limit)
    assert clamped > 0  # the clamp is exercised
    # The naive loop sums each GEMM in float64 and uses numpy's exp: an fp32-accumulated dot that lands next to a
    # bf16 rounding boundary can round the other way, so allow a few bf16 ulps of the output's magnitude
    # (2^-8 relative). In practice on CPU every element is exact; require 99%.
    tol = 4 * 2.0 ** -8 * np.abs(expected).max()
    for path in ("gathered", "ragged"):
        got = _routed(ffn["experts"], x_TD, weights_TX, experts_TX, cfg.swiglu_limit, path)
        np.testing.assert_allclose(got, expected, rtol=0, atol=tol, err_msg=path)
        assert np.mean(got == expected) > 0.99, path


def _fp8_experts(n_experts: int, out_dim: int, in_dim: int, seed: int) -> dict:
    """Random fp8 (e4m3 + ue8m0 32x32 tiles) stacked experts [E, out, in]."""
    rng = np.random.default_rng(seed)
    weight = rng.normal(0, 1, (n_experts, out_dim, in_dim)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.integers(120, 124, (n_experts, -(-out_dim // 32), in_dim // 32)).astype(np.uint8)
    return {"weight": jnp.asarray(weight), "scale": jnp.asarray(scale)}


@pytest.mark.parametrize("t", (1, 3, 4))
def test_fp8_experts_gathered_and_ragged_agree(tiny, t):
    cfg, params = tiny
    d, f = cfg.dim, cfg.moe_inter_dim
    experts = {"w1": _fp8_experts(8, f, d, 1), "w3": _fp8_experts(8, f, d, 2), "w2": _fp8_experts(8, d, f, 3)}
    x_TD, weights_TX, experts_TX = _inputs(cfg, params["layers"][0]["ffn"], t, seed=t, scale=1.0)
    gathered = _routed(experts, x_TD, weights_TX, experts_TX, cfg.swiglu_limit, "gathered")
    ragged = _routed(experts, x_TD, weights_TX, experts_TX, cfg.swiglu_limit, "ragged")
    np.testing.assert_array_equal(_bits(gathered), _bits(ragged))
    expected, _ = _naive_routed(experts, x_TD, weights_TX, experts_TX, cfg.swiglu_limit)
    np.testing.assert_allclose(gathered, expected, rtol=0, atol=4 * 2.0 ** -8 * np.abs(expected).max())


def _avals(jaxpr) -> list:
    """Every intermediate (equation output) aval of a jaxpr, sub-jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        found += [v.aval for v in eqn.outvars]
        for sub in jax_core.jaxprs_in_params(eqn.params):
            found += _avals(sub)
    return found


def _primitives(jaxpr) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax_core.jaxprs_in_params(eqn.params):
            names |= _primitives(sub)
    return names


@pytest.mark.parametrize("t", TOKEN_COUNTS)
def test_the_path_is_chosen_from_the_shapes(tiny, t):
    cfg, params = tiny
    ffn = params["layers"][0]["ffn"]
    n_experts, n_assign = cfg.n_routed_experts, t * cfg.n_activated_experts
    x_TD = jnp.zeros((t, cfg.dim), jnp.bfloat16)
    closed = jax.make_jaxpr(lambda p, x: moe.moe(p, x, cfg))(ffn, x_TD)
    avals = [a for a in _avals(closed.jaxpr) if hasattr(a, "shape")]
    prims = _primitives(closed.jaxpr)
    # a dequantised stack of all experts: [E, F, D] or [E, D, F] (or its transpose), bf16 or the f32 before it
    full = {(n_experts, cfg.moe_inter_dim, cfg.dim), (n_experts, cfg.dim, cfg.moe_inter_dim)}
    full_dequantised = [a for a in avals if a.shape in full and jnp.issubdtype(a.dtype, jnp.floating)]
    lowered = jax.jit(lambda p, x: moe.moe(p, x, cfg)).lower(ffn, x_TD).as_text()
    full_text = [f"tensor<{n_experts}x{a}x{b}xbf16>" for a, b in
                 ((cfg.moe_inter_dim, cfg.dim), (cfg.dim, cfg.moe_inter_dim))]
    if n_assign <= n_experts:
        assert rx.routed_path(n_assign, n_experts) == "gathered"
        assert "ragged_dot_general" not in prims
        if n_assign < n_experts:  # (at A == E the gathered stack has the full stack's shape)
            assert not full_dequantised, full_dequantised
            assert not any(s in lowered for s in full_text)
        # only the A assigned experts are dequantised
        assert any(a.shape == (n_assign, cfg.moe_inter_dim, cfg.dim) and a.dtype == jnp.bfloat16 for a in avals)
    else:
        assert rx.routed_path(n_assign, n_experts) == "ragged"
        assert "ragged_dot_general" in prims
        assert any(a.dtype == jnp.bfloat16 for a in full_dequantised)


def test_unknown_path_is_refused(tiny):
    cfg, params = tiny
    ffn = params["layers"][0]["ffn"]
    x_TD, weights_TX, experts_TX = _inputs(cfg, ffn, 2, seed=0)
    with pytest.raises(ValueError, match="unknown routed-experts path"):
        rx.routed_experts(ffn["experts"], x_TD, weights_TX, experts_TX, cfg.swiglu_limit, path="dense")
