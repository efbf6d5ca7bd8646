"""The router kernel compiled for the GPU (Triton lowering, ``div.rn.f32``): the reference's experts (ties
included) and weights that are numpy's correctly rounded float32 quotients, at the model's shapes. Outputs are
compared with a host oracle, not with XLA's division on the GPU (not correctly rounded there: twentieth session).
Run on the device: ``PYTHONPATH=. python3 -m pytest -q tests/gpu``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dijax.kernels import router

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="compiles the Pallas kernel for a GPU (the CPU tests run it interpreted)")


def _oracle(scores: np.ndarray, bias: np.ndarray, x: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """numpy: a stable descending sort of the keys (the lower id first on ties), ids ascending, the weights summed
    left to right in float32 and divided with float32's correct rounding."""
    order = np.argsort(-(scores + bias), axis=1, kind="stable")[:, :x]
    experts = np.sort(order, axis=1)
    picked = np.take_along_axis(scores, experts, axis=1)
    total = picked[:, 0].copy()
    for j in range(1, x):
        total = total + picked[:, j]
    total = total + np.float32(1e-20)
    return (picked / total[:, None]) * np.float32(scale), experts.astype(np.int32)


@pytest.mark.parametrize("t, config", [(1, router.RouterConfig()), (16, router.RouterConfig()),
                                       (33, router.RouterConfig()), (1024, router.RouterConfig()),
                                       (33, router.RouterConfig(block_tokens=16, warps=4)),
                                       (1024, router.RouterConfig(block_tokens=2, warps=2))])
def test_kernel_is_the_oracle(t, config):
    key1, key2 = jax.random.split(jax.random.key(t))
    scores = jnp.sqrt(jax.nn.softplus(jax.random.normal(key1, (t, 384), jnp.float32)))
    bias = jax.random.normal(key2, (384,), jnp.float32) * 0.01
    bias = bias.at[:5].set(0.0)
    scores = scores.at[0, :5].set(3.0)  # five equal keys at the top of row 0: the lowest ids first
    weights, experts = jax.jit(lambda s, b: router.route_pallas(s, b, 6, True, 2.5, config=config))(scores, bias)
    want_w, want_e = _oracle(np.asarray(scores), np.asarray(bias), 6, 2.5)
    np.testing.assert_array_equal(np.asarray(experts), want_e)
    np.testing.assert_array_equal(np.asarray(weights), want_w)
    ref_w, ref_e = jax.jit(lambda s, b: router.route_reference(s, b, 6, True, 2.5))(scores, bias)
    np.testing.assert_array_equal(np.asarray(ref_e), want_e)
    np.testing.assert_allclose(np.asarray(ref_w), want_w, rtol=2 ** -22)  # XLA's GPU division: an ulp at most


@pytest.mark.parametrize("t, config", [(16, router.RouterConfig()),
                                       (33, router.RouterConfig(block_tokens=16, warps=4))])
def test_padding_tokens_get_no_expert(t, config):
    """``valid_T`` False: the token's experts are all -1, every other output as the oracle's."""
    key1, key2 = jax.random.split(jax.random.key(t + 1))
    scores = jnp.sqrt(jax.nn.softplus(jax.random.normal(key1, (t, 384), jnp.float32)))
    bias = jax.random.normal(key2, (384,), jnp.float32) * 0.01
    valid = np.arange(t) % 3 != 1
    weights, experts = jax.jit(lambda s, b, v: router.route_pallas(s, b, 6, True, 2.5, v, config=config))(
        scores, bias, jnp.asarray(valid))
    want_w, want_e = _oracle(np.asarray(scores), np.asarray(bias), 6, 2.5)
    np.testing.assert_array_equal(np.asarray(experts), np.where(valid[:, None], want_e, -1))
    np.testing.assert_array_equal(np.asarray(weights), want_w)
