"""Rotary embedding (dijax.kernels.rope): float64 pairs rotation, both write forms, the inverse."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dijax.kernels import numerics, rope as rope_mod

BF16 = ml_dtypes.bfloat16
FREQS = np.array([1.0, 0.3, 0.05, 0.002], np.float32)
K = 24  # the last 8 dims rotate


def np_rope(x, pos, freqs, inverse=False):
    """float64 complex rotation of interleaved pairs of the tail, then bf16 (the rest passes through)."""
    x64 = np.asarray(x, np.float64)
    rd = 2 * len(freqs)
    angle = pos.astype(np.float32)[:, None] * freqs[None, :]  # the angle in float32, as the reference
    rot = np.exp((-1j if inverse else 1j) * angle.astype(np.float64))
    rot = rot.reshape((x.shape[0],) + (1,) * (x.ndim - 2) + (len(freqs),))
    tail = x64[..., -rd:].reshape(*x.shape[:-1], rd // 2, 2)
    z = (tail[..., 0] + 1j * tail[..., 1]) * rot
    out = x64.copy()
    out[..., -rd:] = np.stack([z.real, z.imag], axis=-1).reshape(*x.shape[:-1], rd)
    return out.astype(BF16)


@pytest.mark.parametrize("tokens", [5, numerics.LARGE_STEP_TOKENS])  # the concatenation, the in-place update
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_rotates_only_the_tail(tokens, inverse):
    rng = np.random.default_rng(tokens)
    x = rng.standard_normal((tokens, 3, K)).astype(BF16)
    pos = rng.integers(0, 5000, tokens).astype(np.int32)
    got = np.asarray(rope_mod.rope(jnp.asarray(x), jnp.asarray(pos), FREQS, inverse=inverse))
    assert got.dtype == BF16
    np.testing.assert_array_equal(got[..., :-8], x[..., :-8])
    want = np_rope(x, pos, FREQS, inverse).astype(np.float64)
    ulp = np.ldexp(1.0, np.floor(np.log2(np.maximum(np.abs(want), 2.0 ** -126))).astype(int) - 7)
    assert (np.abs(got.astype(np.float64) - want) <= ulp).all()


def test_rope_forms_agree_bit_for_bit(monkeypatch):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 2, K)).astype(BF16))
    pos = jnp.arange(64, dtype=jnp.int32) * 37
    concatenated = np.asarray(rope_mod.rope(x, pos, FREQS))
    monkeypatch.setattr(numerics, "LARGE_STEP_TOKENS", 1)
    np.testing.assert_array_equal(np.asarray(rope_mod.rope(x, pos, FREQS)), concatenated)


def test_inverse_rope_undoes_rope_to_bf16_rounding():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, K)).astype(BF16)
    pos = jnp.arange(16, dtype=jnp.int32)
    back = rope_mod.rope(rope_mod.rope(jnp.asarray(x), pos, FREQS), pos, FREQS, inverse=True)
    np.testing.assert_allclose(np.asarray(back, np.float32), x.astype(np.float32), atol=2 ** -6, rtol=2 ** -6)
