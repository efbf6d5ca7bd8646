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

from dijax.kernels import sinkhorn as sk
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


EXACT, FAST = sk.SinkhornConfig(fast_divide=False), sk.SinkhornConfig(fast_divide=True)


@pytest.mark.parametrize("config", [EXACT, FAST], ids=["exact", "fast_divide"])
@pytest.mark.parametrize("t, c, rounds", [(1, 2, 19), (5, 4, 3), (BLOCK_T + 3, 4, 2)])
def test_pallas_matches_reference(t, c, rounds, config):
    comb = _comb(t, c, seed=t)
    want = sinkhorn_reference(comb, rounds, 1e-6)
    got = sinkhorn_pallas(comb, rounds, 1e-6, interpret=True, config=config)
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


def test_tokens_outside_the_fast_range_are_flagged():
    """The kernel divides by the fast path only where every dividend >= FAST_RANGE[0] and every divisor <
    FAST_RANGE[1] (else its block is recomputed with exact divisions): a token with a tiny entry, a huge one or a
    NaN is flagged, the model's softmax rows are not."""
    comb = np.array(_comb(5, 4, seed=3))
    comb[1, 2, 3] = 1e-30  # below 2^-40
    comb[2, 0, :] = 1e30  # a row sum past 2^40
    comb[3, 1, 1] = np.nan
    m = [[jnp.asarray(comb[:, i, j]) for j in range(4)] for i in range(4)]
    out, inside = sk._rounds(m, c=4, rounds=3, eps=np.float32(1e-6), reciprocal=lambda y: y,
                             divide=lambda x, y, r: x / y, check=True)
    assert np.asarray(inside).tolist() == [True, False, False, False, True]
    want = sinkhorn_reference(jnp.asarray(comb), 3, 1e-6)
    for i in range(4):  # the same arithmetic as the reference (interpreted division is IEEE-rounded)
        for j in range(4):
            assert_ulps(out[i][j][np.array([0, 1, 2, 4])], want[np.array([0, 1, 2, 4]), i, j], 4)


def test_a_block_outside_the_fast_range_gives_the_reference(monkeypatch):
    """A block with a token outside the fast range takes the kernel's exact path (interpreted here): the
    reference's result, as for every other block (to the CPU's few ulps; tests/gpu checks the bits)."""
    comb = np.array(_comb(BLOCK_T + 3, 4, seed=5))
    comb[BLOCK_T + 1, 0, 0] = 1e-30
    want = sinkhorn_reference(jnp.asarray(comb), 2, 1e-6)
    assert_ulps(sinkhorn_pallas(jnp.asarray(comb), 2, 1e-6, interpret=True, config=FAST), want, 4)


@pytest.mark.parametrize("config", [EXACT, FAST], ids=["exact", "fast_divide"])
def test_lowers_to_triton_without_a_gpu(lower_for_cuda, config):
    """Both GPU forms (``div.rn.f32`` throughout; the inline-PTX fast path with the exact fallback under a branch)
    lower to Triton IR."""
    text = lower_for_cuda(lambda x: sinkhorn_pallas(x, 20, 1e-6, interpret=False, config=config),
                          jax.ShapeDtypeStruct((3, 4, 4), jnp.float32))
    assert "triton" in text
