"""The Mosaic GPU fp8 linear (dijax.kernels.fp8_wgmma) on a Hopper GPU against its reference, and through the fp8
linear's seam with ``engine='mgpu'``. The same exact products summed in another order (``assert_close_bf16``'s
bound, the Triton kernel's). Run on the device: ``PYTHONPATH=. python3 -m pytest -q tests/gpu``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from dijax.kernels import fp8_linear as fl
from dijax.kernels import fp8_wgmma as f8
from dijax.kernels.stacked import of_layer
from tests.test_kernels_fp8_linear import _weights, assert_close_bf16

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu" or "H" not in jax.devices()[0].device_kind,
                                reason="a Mosaic GPU wgmma kernel: needs a Hopper GPU")


@pytest.mark.parametrize("t, out_dim, in_dim, warpgroups, stages", [
    (1, 1280, 5120, 1, 4),      # wq_a at decode
    (1, 512, 5120, 1, 4),       # wkv: 8 row blocks, K split in 40
    (3, 32768, 1280, 1, 4),     # wq_b, T padded to 8
    (16, 5120, 8192, 2, 4),     # wo_b, two compute warpgroups
    (32, 2304, 5120, 1, 8),     # shared w1, deeper pipeline
    (64, 25600, 6144, 1, 4),    # the Engram wkv
    (5, 64, 256, 1, 2),         # small dims
    (64, 5120, 8192, 2, 4),     # wo_b at 64 rows
    (48, 512, 5120, 1, 4),      # wkv, K split in many parts of few steps
])
@pytest.mark.parametrize("block_scales", [False, True], ids=["row_scales", "block_scales"])
def test_kernel_matches_reference(t, out_dim, in_dim, warpgroups, stages, block_scales):
    weight, scale, _ = _weights(out_dim, in_dim, seed=t, exponents=f8.SCALE_RANGE)
    x = (jax.random.normal(jax.random.key(t), (t, in_dim), jnp.float32) * 3).astype(jnp.bfloat16)
    got = jax.jit(lambda *a: f8.linear_mgpu(*a, warpgroups=warpgroups, stages=stages, block_scales=block_scales))(
        x, weight, scale)
    assert_close_bf16(got, jax.jit(f8.linear_reference)(x, weight, scale), x, weight, scale)


@pytest.mark.parametrize("block_scales", [False, True], ids=["row_scales", "block_scales"])
def test_a_layer_of_a_stack_in_place(block_scales):
    weights = [_weights(1280, 5120, seed=s) for s in range(3)]
    w_stack = jnp.stack([w for w, _, _ in weights])
    s_stack = jnp.stack([s for _, s, _ in weights])
    x = jax.random.normal(jax.random.key(7), (2, 5120), jnp.bfloat16)
    got = jax.jit(lambda *a: f8.linear_mgpu(*a, block_scales=block_scales))(x, of_layer(w_stack, 2, 2),
                                                                             of_layer(s_stack, 2, 2))
    assert_close_bf16(got, f8.linear_reference(x, weights[2][0], weights[2][1]), x, weights[2][0], weights[2][1])


def test_seam_with_the_mgpu_engine(monkeypatch):
    """``fp8_linears`` with ``engine='mgpu'``: both linears of one input, each on fp8_wgmma."""
    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, engine="mgpu", mgpu_min_tokens=1))
    pairs = [_weights(1280, 5120, seed=1)[:2], _weights(512, 5120, seed=2)[:2]]
    x = jax.random.normal(jax.random.key(1), (4, 5120), jnp.bfloat16)
    got = jax.jit(lambda x: fl.fp8_linears(x, pairs, impl="pallas"))(x)
    for y, (weight, scale) in zip(got, pairs):
        assert_close_bf16(y, fl.fp8_linear_reference(x, weight, scale), x, weight, scale)
