"""The fp8 linear Pallas kernel compiled for the GPU (Triton lowering) against the jnp reference on the same GPU.

Outputs start NaN-filled (``KernelConfig.poison``), so an element no program writes shows as NaN. Covers token
counts below, at and above one tile of rows (masked rows), the real V4.1-Flash linear shapes, and the whole range
of scale exponents the GPU kernel is exact for (``SCALE_RANGE``). Run on the device:
``PYTHONPATH=. python3 -m pytest -q tests/gpu``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from dijax.kernels import fp8_linear as fl, quant
from tests.test_kernels_fp8_linear import MATVEC_EVERYWHERE, _weights, assert_close_bf16

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="compiles the Pallas kernel for a GPU (the CPU tests run it interpreted)")


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):  # and every token count through the kernel
    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, poison=True, max_tokens=1 << 20))


@pytest.mark.parametrize("t, out_dim, in_dim", [
    (1, 1280, 5120),     # wq_a at decode
    (8, 512, 5120),      # wkv, a tiny-model decode bucket of 8 tokens (masked rows)
    (16, 4096, 1280),    # the indexer's wq_b at decode batch 16: the first step of the 128-column tiles
    (37, 5120, 8192),    # wo_b, a ragged token count
    (64, 2304, 5120),    # shared w1, one full tile of rows
    (300, 8192, 1280),   # the indexer's wq_b at prefill
    (16, 96, 160),       # small dims: narrow tiles
])
def test_kernel_matches_reference(t, out_dim, in_dim):
    weight, scale, _ = _weights(out_dim, in_dim, seed=t)
    x = (jax.random.normal(jax.random.key(t), (t, in_dim), jnp.float32) * 3).astype(jnp.bfloat16)
    got = jax.jit(fl.fp8_linear_pallas)(x, weight, scale)
    want = jax.jit(fl.fp8_linear_reference)(x, weight, scale)
    assert_close_bf16(got, want, x, weight, scale)


@pytest.mark.parametrize("t, matvec", [(4, False), (1, True)], ids=["dot", "matvec"])
def test_every_scale_exponent_in_range(monkeypatch, t, matvec):
    """Every byte of ``SCALE_RANGE``, 16 per tile row; both ends included; on the dot kernel and on the one-token
    mat-vec (``CONFIG.matvec``: the hardware's e4m3 conversion)."""
    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, **{**MATVEC_EVERYWHERE, "matvec": matvec}))
    lo, hi = fl.SCALE_RANGE
    exponents = jnp.arange(lo, hi + 1, dtype=jnp.uint8)
    exponents = jnp.concatenate([exponents, jnp.full((-exponents.size % 16,), hi, jnp.uint8)])
    weight, _, _ = _weights(32 * exponents.size // 16, 16 * 32, seed=9)
    scale = exponents.reshape(-1, 16)
    x = jax.random.normal(jax.random.key(3), (t, 16 * 32), jnp.bfloat16)
    assert_close_bf16(jax.jit(fl.fp8_linear_pallas)(x, weight, scale),
                      jax.jit(fl.fp8_linear_reference)(x, weight, scale), x, weight, scale)


@pytest.mark.parametrize("t, out_dims, in_dim", [
    (1, (1280, 512), 5120),    # wq_a and wkv at decode, one launch
    (16, (2304, 2304), 5120),  # the shared expert's w1 and w3 at decode batch 16 (128-column tiles)
    (5, (96, 64, 32), 160),    # three small weights, masked rows
])
def test_several_linears_in_one_launch_match_the_reference(t, out_dims, in_dim):
    pairs = [_weights(out_dim, in_dim, seed=t + i)[:2] for i, out_dim in enumerate(out_dims)]
    x = (jax.random.normal(jax.random.key(t), (t, in_dim), jnp.float32) * 3).astype(jnp.bfloat16)
    got = jax.jit(fl.fp8_linears_pallas)(x, pairs)
    for (weight, scale), y in zip(pairs, got):
        assert_close_bf16(y, jax.jit(fl.fp8_linear_reference)(x, weight, scale), x, weight, scale)


@pytest.mark.parametrize("t, out_dims, in_dim", [(1, (2304, 2304), 5120), (16, (2304, 2304), 5120),
                                                  (1, (32768,), 1280)])
def test_quantised_activations_are_taken_as_they_are(t, out_dims, in_dim, monkeypatch):
    """``take_quantised`` (on by default since the forty-third session): fq8'd x loaded as it is gives the bits of the
    kernel that quantises it again (the shared expert's w1 and w3, wq_b)."""
    pairs = [_weights(o, in_dim, seed=o + t)[:2] for o in out_dims]
    x_act = quant.fq8((jax.random.normal(jax.random.key(t), (t, in_dim), jnp.float32) * 3).astype(jnp.bfloat16))
    want = jax.jit(lambda x: fl.fp8_linears(x, pairs, impl="pallas"))(x_act)
    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, take_quantised=True))
    got = jax.jit(lambda x: fl.fp8_linears(x, pairs, impl="pallas", quantised=True))(x_act)
    for g, w, (weight, scale) in zip(got, want, pairs, strict=True):
        assert not bool(jnp.isnan(g.astype(jnp.float32)).any())
        assert bool((g == w).all())
        assert_close_bf16(g, jax.jit(fl.fp8_linear_reference)(x_act, weight, scale), x_act, weight, scale)


@pytest.mark.parametrize("out_dims, in_dim", [
    ((32768,), 1280),       # wq_b: short K (steps of 64 words a row)
    ((5120,), 8192),        # wo_b: long K
    ((1280, 512), 5120),    # wq_a and wkv in one launch
    ((2304, 2304), 5120),   # the shared expert's w1 and w3
    ((25600,), 6144),       # the Engram wkv
])
def test_matvec_matches_the_reference(out_dims, in_dim, monkeypatch):
    """One token on the mat-vec kernel (``CONFIG.matvec``), poisoned outputs, the flash-slice shapes; quantised
    activations taken as they are give the same bits."""
    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, **MATVEC_EVERYWHERE))
    pairs = [_weights(o, in_dim, seed=o + i)[:2] for i, o in enumerate(out_dims)]
    x = (jax.random.normal(jax.random.key(in_dim), (1, in_dim), jnp.float32) * 3).astype(jnp.bfloat16)
    got = jax.jit(lambda x: fl.fp8_linears(x, pairs, impl="pallas"))(x)
    for (weight, scale), y in zip(pairs, got, strict=True):
        assert_close_bf16(y, jax.jit(fl.fp8_linear_reference)(x, weight, scale), x, weight, scale)
    given = jax.jit(lambda x: fl.fp8_linears(x, pairs, impl="pallas", quantised=True))(quant.fq8(x))
    for g, y in zip(given, got, strict=True):
        assert bool((g == y).all())

