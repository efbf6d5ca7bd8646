"""The Sinkhorn kernel (dijax/kernels/sinkhorn.py): the Pallas version (interpret mode on CPU) against the jnp
reference, and the model's hyper-connection mix through either.

The two agree to a few float32 ulps, not bit for bit: both divide with correct rounding and sum in the same order,
but XLA compiles the reference's fused rounds differently from the interpreted kernel (measured: at most 1 ulp on
some entries). The GPU run (tests/gpu) records how close they are there."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dijax.kernels.sinkhorn import BLOCK_T, sinkhorn, sinkhorn_pallas, sinkhorn_reference
from dijax.model import hc


def _comb(t: int, c: int, seed: int) -> jax.Array:
    """Positive matrices like the mix's: softmax rows plus eps, of widely different scales."""
    logits = jax.random.normal(jax.random.key(seed), (t, c, c), jnp.float32) * 4
    return jax.nn.softmax(logits, axis=-1) + np.float32(1e-6)


def assert_ulps(got: jax.Array, want: jax.Array, ulps: int) -> None:
    """Every element within ``ulps`` float32 units in the last place."""
    got_bits = np.asarray(got, np.float32).view(np.int32).astype(np.int64)
    want_bits = np.asarray(want, np.float32).view(np.int32).astype(np.int64)
    assert np.abs(got_bits - want_bits).max() <= ulps, np.abs(got_bits - want_bits).max()


@pytest.mark.parametrize("t, c, rounds", [(1, 2, 19), (5, 4, 3), (BLOCK_T + 3, 4, 2)])
def test_pallas_matches_reference(t, c, rounds):
    comb = _comb(t, c, seed=t)
    want = sinkhorn_reference(comb, rounds, 1e-6)
    got = sinkhorn_pallas(comb, rounds, 1e-6, interpret=True)
    assert_ulps(got, want, 4)
    # doubly stochastic up to eps: columns sum to ~1 after the last (column) step
    np.testing.assert_allclose(np.asarray(got).sum(axis=-2), 1.0, rtol=1e-4)


def test_zero_rounds_is_identity_and_impl_is_checked():
    comb = _comb(3, 4, seed=0)
    np.testing.assert_array_equal(np.asarray(sinkhorn_pallas(comb, 0, 1e-6, interpret=True)), np.asarray(comb))
    with pytest.raises(ValueError, match="sinkhorn impl must be one of"):
        sinkhorn(comb, 3, 1e-6, impl="triton")


def test_mix_through_either_impl():
    """The hyper-connection split (pre, post, comb) is identical with the kernel (interpreted off a GPU: the
    dispatcher picks the mode, as for every kernel)."""
    mixes = jax.random.normal(jax.random.key(1), (9, 24), jnp.float32)
    scale, base = jnp.array([0.5, 1.5, 2.0], jnp.float32), jax.random.normal(jax.random.key(2), (24,)) * 0.1
    want = hc.split_sinkhorn(mixes, scale, base, 4, 4, 1e-6)
    got = hc.split_sinkhorn(mixes, scale, base, 4, 4, 1e-6, sinkhorn_impl="pallas")
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))  # pre and post do not go through it
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert_ulps(got[2], want[2], 4)
