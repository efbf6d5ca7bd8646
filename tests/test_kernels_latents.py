"""The attention's latents (dijax.kernels.latents): the Pallas kernel, interpreted, against the reference: bit for
bit where the sums of squares are exact in any order, within a rounding step otherwise; every row written across
program blocks; the shapes it refuses; the seam."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dijax.kernels import latents, quant
from dijax.kernels.rope import rope_frequencies
from tests.test_quant import fq8_step

pytestmark = pytest.mark.cost(2)  # CI seconds, a scheduling hint (tests/conftest.py)

BF16 = ml_dtypes.bfloat16
FREQS = rope_frequencies(16, 10000.0, 64, 4.0, 32.0, 1.0)  # the tiny default's: 8 pairs, YaRN
EPS = 1e-6
POISON = latents.LatentsConfig(poison=True)


def _inputs(t: int, q: int, k: int, seed: int, exact: bool):
    """bf16 qkva [t, q + k] (qa and kva side by side), q, the norms' weights, positions. ``exact``: entries are
    multiples of 1/8 up to 8 in magnitude, so every square and every partial sum is exact in float32 (the kernel's order is XLA's)."""
    rng = np.random.default_rng(seed)
    if exact:
        qa, kva = (rng.integers(-64, 65, (t, n)) / 8 for n in (q, k))
    else:
        qa, kva = (rng.standard_normal((t, n)) * rng.uniform(0.1, 4.0, (t, 1)) for n in (q, k))
    weights = [1 + 0.25 * rng.standard_normal(n) for n in (q, k)]
    positions = rng.integers(0, 4096, t).astype(np.int32)
    qkva, qw, kvw = (jnp.asarray(np.asarray(a, np.float32).astype(BF16))
                     for a in (np.concatenate([qa, kva], axis=1), *weights))
    return qkva, q, qw, kvw, jnp.asarray(positions)


@pytest.mark.parametrize("t, q, k, block", [(1, 64, 64, 16), (8, 64, 64, 16), (19, 64, 64, 16), (33, 1280, 512, 16),
                                            (5, 48, 32, 2)])
def test_kernel_is_the_reference_where_the_sums_are_exact(t, q, k, block):
    """Token counts within one block and across blocks (the last one partial), the tiny and the flash widths (Q in
    five chunks of 256), a Q that is not a power of two; outputs start NaN-filled, so an unwritten element shows."""
    qkva, q_width, qw, kvw, pos = _inputs(t, q, k, seed=t + q, exact=True)
    config = latents.LatentsConfig(block_tokens=block, poison=True)
    got = latents.latents_pallas(qkva, q_width, qw, kvw, pos, FREQS, EPS, interpret=True, config=config)
    want = latents.latents_reference(qkva, q_width, qw, kvw, pos, FREQS, EPS)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_kernel_agrees_with_the_reference_to_a_rounding_step():
    """Random rows: the sums of squares may round differently, so a latent may differ by one bf16 ulp and a KV
    value by one e4m3 step of its block (its scale over 8 at most); nearly all are equal."""
    qkva, q_width, qw, kvw, pos = _inputs(64, 1280, 512, seed=3, exact=False)
    got = latents.latents_pallas(qkva, q_width, qw, kvw, pos, FREQS, EPS, interpret=True, config=POISON)
    want = latents.latents_reference(qkva, q_width, qw, kvw, pos, FREQS, EPS)
    qr, kv = (np.asarray(x, np.float32) for x in got)
    qr_want, kv_want = (np.asarray(x, np.float32) for x in want)
    np.testing.assert_allclose(qr, qr_want, rtol=2 ** -7, atol=0)
    assert (np.abs(kv - kv_want) <= fq8_step(kv_want)).all()
    assert (qr == qr_want).mean() > 0.99 and (kv == kv_want).mean() > 0.99


def test_the_kv_row_is_normed_rotated_and_fp8():
    """The kernel's KV row against an independent numpy oracle: float64 norm, the tail's pairs rotated, each block
    of 32 on the e4m3 grid of a power-of-two scale; the query latent's RMS is the weight's."""
    qkva, q_width, qw, kvw, pos = _inputs(4, 64, 64, seed=5, exact=True)
    qr, kv = latents.latents_pallas(qkva, q_width, qw, kvw, pos, FREQS, EPS, interpret=True, config=POISON)
    x = np.asarray(qkva, np.float64)[:, q_width:]
    normed = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + EPS) * np.asarray(kvw, np.float64)
    angle = np.asarray(pos, np.float32)[:, None] * FREQS[None, :]
    a, b = normed[:, -16::2], normed[:, -15::2]
    cos, sin = np.cos(angle.astype(np.float64)), np.sin(angle.astype(np.float64))
    normed[:, -16::2], normed[:, -15::2] = a * cos - b * sin, a * sin + b * cos
    kv = np.asarray(kv, np.float64)
    scale = np.exp2(np.ceil(np.log2(np.abs(normed).reshape(4, 2, 32).max(-1) / 448)))
    codes = kv.reshape(4, 2, 32) / scale[..., None]
    assert (np.abs(codes) <= 448).all()
    on_grid = np.asarray(quant.e4m3_round(jnp.asarray(codes, jnp.float32)), np.float64)
    np.testing.assert_array_equal(codes, on_grid)
    assert np.abs(kv - normed).max() <= np.abs(normed).max() / 8
    ratio = np.asarray(qr, np.float64) / np.asarray(qw, np.float64)
    np.testing.assert_allclose(np.sqrt((ratio * ratio).mean(axis=1)), 1.0, rtol=2 ** -6)


@pytest.mark.parametrize("q, k, pairs, message", [
    (64, 48, 8, "multiple of 32 whose half is a power of two"),
    (64, 96, 8, "multiple of 32 whose half is a power of two"),
    (64, 32, 17, "at least the rope width 34"),
    (40, 64, 8, "query latent width must be a multiple of 16, got 40"),
])
def test_refused_shapes_name_the_width(q, k, pairs, message):
    with pytest.raises(ValueError, match=message):
        latents.check_shapes(jnp.zeros((2, q + k), jnp.bfloat16), q, pairs)


def test_no_tokens_and_the_seam():
    qkva, q_width, qw, kvw, pos = _inputs(3, 64, 64, seed=7, exact=True)
    empty = latents.latents_pallas(qkva[:0], q_width, qw, kvw, pos[:0], FREQS, EPS, interpret=True)
    assert [x.shape for x in empty] == [(0, 64), (0, 64)]
    for impl in latents.IMPLS:
        got = latents.latents(qkva, q_width, qw, kvw, pos, FREQS, EPS, impl=impl)
        want = latents.latents_reference(qkva, q_width, qw, kvw, pos, FREQS, EPS)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(ValueError, match=r"latents impl must be one of \('reference', 'pallas'\), got 'triton'"):
        latents.latents(qkva, q_width, qw, kvw, pos, FREQS, EPS, impl="triton")
