"""Kernels reading one layer in place from a stack of layers (dijax.kernels.stacked), compiled for the GPU: the
fp8 linear and the routed experts give for a ``LayerSlice`` exactly what they give for the sliced-out layer,
including a real-size expert stack past 2^32 bytes (Pallas' Triton lowering then indexes in int64) read at its
last layer's last expert. Outputs start NaN-filled. Run on the device: ``PYTHONPATH=. python3 -m pytest -q
tests/gpu``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dijax.kernels import fp8_linear as fl
from dijax.kernels import routed_experts as rx
from dijax.kernels.stacked import of_layer
from tests.test_kernels_fp8_linear import _weights
from tools.bench_kernels import random_mxfp4

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="compiles the Pallas kernels for a GPU (the CPU tests run them interpreted)")


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, poison=True, max_tokens=1 << 20))
    monkeypatch.setattr(rx, "CONFIG", dataclasses.replace(rx.CONFIG, poison=True))


@pytest.mark.parametrize("t", [1, 64])
def test_fp8_linear_reads_the_stacked_layer(t):
    out_dim, in_dim, lead = 8192, 1280, (2, 5)  # the indexer's wq_b, ten stacked layers
    layers = [_weights(out_dim, in_dim, seed) for seed in range(10)]
    weight = jnp.stack([w for w, _, _ in layers]).reshape(*lead, out_dim, in_dim)
    scale = jnp.stack([s for _, s, _ in layers]).reshape(*lead, *layers[0][1].shape)
    x = (jax.random.normal(jax.random.key(t), (t, in_dim), jnp.float32) * 3).astype(jnp.bfloat16)
    got = jax.jit(fl.fp8_linear_pallas)(x, of_layer(weight, 7, 2), of_layer(scale, 7, 2))
    want = jax.jit(fl.fp8_linear_pallas)(x, layers[7][0], layers[7][1])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("t", [1, 64])  # the mat-vec and the grouped-GEMM path
def test_routed_experts_read_a_stack_past_4_gib(t):
    n_experts, d, f, lead = 384, 5120, 2304, (1, 2)  # real V4.1-Flash experts, two stacked layers
    keys = jax.random.split(jax.random.key(0), 3)
    lead = (*lead, n_experts)
    stacks = {"w1": random_mxfp4(keys[0], lead, f, d), "w3": random_mxfp4(keys[1], lead, f, d),
              "w2": random_mxfp4(keys[2], lead, d, f)}
    assert stacks["w1"]["weight"].nbytes > 2 ** 32
    views = jax.tree.map(lambda a: of_layer(a, 1, 3), stacks)
    layer = jax.tree.map(lambda a: a[0, 1], stacks)
    rng = np.random.default_rng(t)
    experts_TX = np.sort(np.stack([rng.choice(n_experts - 1, 6, replace=False) for _ in range(t)]), axis=1)
    experts_TX[:, -1] = n_experts - 1  # the last expert of the last layer: the stack's last bytes
    experts_TX = jnp.asarray(experts_TX.astype(np.int32))
    weights_TX = jnp.asarray(rng.uniform(0.1, 1.0, (t, 6)).astype(np.float32))
    x_TD = (jax.random.normal(jax.random.key(1), (t, d), jnp.float32)).astype(jnp.bfloat16)
    call = jax.jit(lambda e, x, w, i: rx.routed_experts(e, x, w, i, 10.0, impl="pallas"))
    got = np.asarray(call(views, x_TD, weights_TX, experts_TX))
    want = np.asarray(call(layer, x_TD, weights_TX, experts_TX))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)
