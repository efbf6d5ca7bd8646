"""Routed-experts Pallas kernels compiled for the GPU (Triton lowering) against the jnp reference on the same GPU.

Kernel outputs start NaN-filled (``KernelConfig.poison``), so an element that no program writes shows up as NaN in
the result. Covers both paths on ragged routings (empty experts, groups spanning several tiles, padding), the wide
exponent range, and the real V4.1-Flash expert shapes with 384 experts (pointer offsets near the end of the stack).
Run on the device: ``PYTHONPATH=. python3 -m pytest -q tests/gpu``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dijax.kernels import routed_experts as rx
from tests.test_kernels_routed_experts import LIMIT, assert_close, make_experts, make_routing, make_x
from tools.bench_kernels import random_mxfp4

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="compiles the Pallas kernels for a GPU (the CPU tests run them interpreted)")


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(rx, "CONFIG", dataclasses.replace(rx.CONFIG, poison=True))


CASES = {  # name: (T, E, X, D, F, pool, pad_tokens, pad_slots, exponent range)
    "decode": (1, 32, 6, 1024, 512, None, (), (), (116, 122)),
    "batch-padding": (16, 32, 6, 1024, 512, None, (3, 9), (5,), (116, 122)),
    "ragged-empty-experts": (200, 32, 6, 1024, 512, 9, (17,), (2,), (114, 124)),
    "prefill": (512, 16, 4, 512, 256, None, (), (), (116, 122)),
    "wide-exponents": (24, 8, 2, 512, 256, None, (), (), (100, 150)),
}


MGPU = {"gemm_engine": "mgpu", "mgpu_min_assignments": 0}  # the ragged path on fp4_wgmma at every size
VARIANTS = {"ragged-cols64": ("ragged", {"gemm_cols": 64}),  # the variants the benchmark sweeps
            "gathered-rows16": ("gathered", {"matvec_rows": 16}),  # h quantised by XLA, not the gate-up kernel
            # the ragged path on dijax.kernels.fp4_wgmma (wgmma, weights decoded in registers)
            "ragged-mgpu": ("ragged", MGPU),
            "ragged-mgpu-64x1": ("ragged", {**MGPU, "mgpu_sizes": (16, 64), "mgpu_chunks": 1}),
            "ragged-mgpu-1wg": ("ragged", {**MGPU, "mgpu_warpgroups": 1, "mgpu_stages": 8}),
            "ragged-mgpu-overlap": ("ragged", {**MGPU, "mgpu_overlap": True}),
            "ragged-mgpu-fitted": ("ragged", {**MGPU, "mgpu_lone_max": 0})}


@pytest.mark.parametrize("path", [*rx.PATHS, *VARIANTS])
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_kernels_match_reference(name, path, monkeypatch):
    if path in VARIANTS:
        path, change = VARIANTS[path]
        monkeypatch.setattr(rx, "CONFIG", dataclasses.replace(rx.CONFIG, **change))
    t, e, x, d, f, pool, pad_tokens, pad_slots, exponents = CASES[name]
    rng = np.random.default_rng(sorted(CASES).index(name))
    experts = make_experts(rng, e, d, f, exponents)
    weights_TX, experts_TX = make_routing(rng, t, e, x, pool, pad_tokens, pad_slots)
    x_TD = make_x(rng, t, d, 3.0)
    expected = np.asarray(jax.jit(rx.routed_experts_reference, static_argnames=("limit",))(
        experts, x_TD, weights_TX, experts_TX, limit=LIMIT))
    got = np.asarray(jax.jit(rx.routed_experts_pallas, static_argnames=("limit", "path"))(
        experts, x_TD, weights_TX, experts_TX, limit=LIMIT, path=path))
    assert_close(got, expected, min_equal=0.95)
    pad_rows = np.all(np.asarray(experts_TX) < 0, axis=1)
    assert np.all(got[pad_rows] == 0)


@pytest.mark.parametrize("path, engine", [("gathered", "triton"), ("ragged", "triton"), ("ragged", "mgpu")])
def test_gpu_real_expert_shapes_top_of_the_stack(path, engine, monkeypatch):
    """384 experts of 2304 x 5120: a uint8 stack is 2.26 GB, so the last experts' byte offsets pass 2^31."""
    monkeypatch.setattr(rx, "CONFIG", dataclasses.replace(rx.CONFIG, gemm_engine=engine, mgpu_min_assignments=0))
    n_experts, d, f = 384, 5120, 2304
    keys = jax.random.split(jax.random.key(0), 3)
    experts = {"w1": random_mxfp4(keys[0], (n_experts,), f, d), "w3": random_mxfp4(keys[1], (n_experts,), f, d),
               "w2": random_mxfp4(keys[2], (n_experts,), d, f)}
    experts_TX = jnp.asarray([[0, 190, 370, 380, 382, 383], [1, 2, 300, 381, 382, 383]], jnp.int32)
    weights_TX = jnp.full(experts_TX.shape, 0.2, jnp.float32)
    x_TD = make_x(np.random.default_rng(1), 2, d, 3.0)
    expected = np.asarray(rx.routed_experts_reference(experts, x_TD, weights_TX, experts_TX, LIMIT))
    got = np.asarray(rx.routed_experts_pallas(experts, x_TD, weights_TX, experts_TX, LIMIT, path))
    assert_close(got, expected, min_equal=0.95)
