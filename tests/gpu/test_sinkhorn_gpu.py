"""The hyper-connection mix split's Pallas kernel compiled for the GPU (Triton lowering; inline ``div.rn.f32``, or
with ``fast_divide`` its fast path and the exact division for blocks outside its range): the two division forms
give the same bits, and both are the float64 formula's values to float32 noise, as is the jnp reference compiled
by XLA for the same GPU. Run on the device: ``PYTHONPATH=. python3 -m pytest -q tests/gpu``."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dijax.kernels import sinkhorn as sk
from dijax.kernels.sinkhorn import BLOCK_T, split_pallas, split_reference
from tests.test_hc import np_split_sinkhorn
from tests.test_kernels_sinkhorn import EXACT, FAST, MIXES_RTOL, RTOL, mix_inputs, stream_inputs

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="compiles the Pallas kernel for a GPU (the CPU tests run it interpreted)")
ITERS, EPS = 20, 1e-6


def _run(mixes, scale, base, c: int, config=None) -> list[np.ndarray]:
    """(pre, post, comb) of the kernel with ``config``, or of the XLA reference with None, jitted on the GPU."""
    if config is None:
        fn = jax.jit(lambda m, s, b: split_reference(m, s, b, c, ITERS, EPS))
    else:
        fn = jax.jit(lambda m, s, b: split_pallas(m, s, b, c, ITERS, EPS, config=config))
    return [np.asarray(a) for a in fn(mixes, scale, base)]


def _ulps(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)).max())


@pytest.mark.parametrize("t, c", [(1, 4), (7, 4), (BLOCK_T + 5, 4), (3 * BLOCK_T, 2),
                                  (sk.TOKEN_MAJOR_MAX_TOKENS + 5, 4)])  # the last: the [M, T] output
def test_both_division_forms_give_one_result_near_the_formula(t, c):
    mixes, scale, base = mix_inputs(t, c, seed=t)
    fast, exact, xla = _run(mixes, scale, base, c, FAST), _run(mixes, scale, base, c, EXACT), _run(mixes, scale,
                                                                                                   base, c)
    oracle = np_split_sinkhorn(np.asarray(mixes), np.asarray(scale), np.asarray(base), c, ITERS, EPS)
    print(f"t={t} c={c}: ulps pallas / xla reference: " + ", ".join(
        f"{name} {_ulps(f, x)}" for name, f, x in zip(("pre", "post", "comb"), fast, xla)))
    for f, e, x, want in zip(fast, exact, xla, oracle, strict=True):
        assert np.isfinite(f).all()
        assert _ulps(f, e) == 0  # the fast path is div.rn.f32's, bit for bit
        np.testing.assert_allclose(f, want, rtol=RTOL, atol=1e-8)
        np.testing.assert_allclose(x, want, rtol=RTOL, atol=1e-8)


@pytest.mark.parametrize("t", [8, BLOCK_T + 5])
def test_the_prologue_rms_factor_matches_the_reference(t):
    """The bare projection and the tokens' sums of squares (``hc.mixes``' form since the thirty-eighth session):
    the factor rsqrt(squares / width + eps) in the kernel's prologue against XLA's, then the split."""
    mixes, scale, base = mix_inputs(t, 4, seed=t)
    squares = jax.random.uniform(jax.random.key(3), (t, 1), np.float32, 100.0, 4000.0)
    got = jax.jit(lambda m, s, b, q: split_pallas(m, s, b, 4, ITERS, EPS, q, 20480, 1e-6, config=FAST))(
        mixes, scale, base, squares)
    want = jax.jit(lambda m, s, b, q: split_reference(m, s, b, 4, ITERS, EPS, q, 20480, 1e-6))(
        mixes, scale, base, squares)
    for g, w in zip(got, want, strict=True):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=RTOL, atol=1e-8)


@pytest.mark.parametrize("entry, value", [(8, -500.0), (9, -1e-30), (5, -60.0), (0, 200.0)])
def test_blocks_outside_the_fast_range_take_the_exact_bits(entry, value):
    """With ``fast_divide``, a token whose divisions leave the fast path's range (an underflowing comb entry, a
    sigmoid of a large negative argument; a tiny or a large logit that stays inside it as a control) sends its
    block down the exact path: ``div.rn.f32``'s bits there, and in the other blocks."""
    mixes, scale, base = mix_inputs(2 * BLOCK_T, 4, seed=11)
    mixes = mixes.at[BLOCK_T + 3, entry].set(value)
    fast, exact = _run(mixes, scale, base, 4, FAST), _run(mixes, scale, base, 4, EXACT)
    for f, e in zip(fast, exact, strict=True):
        assert np.isfinite(f).all() and _ulps(f, e) == 0


@pytest.mark.parametrize("t, k", [(1, 20480), (64, 20480), (9, 1024), (128, 640)])
def test_fused_mixes_match_the_reference(t, k):
    """mixes_pallas compiled for the GPU (flash-slice's width in 32 parts of 10 chunks, the tiny model's in 16
    parts of one, 640 in 2 parts of 5) against mixes_reference compiled by XLA: both division forms, within the
    CPU test's MIXES_RTOL."""
    args = stream_inputs(t, 4, k, seed=t)
    want = jax.jit(lambda *a: sk.mixes_reference(*a, 4, ITERS, EPS, 1e-6))(*args)
    for config in (FAST, EXACT):
        got = jax.jit(lambda *a, config=config: sk.mixes_pallas(*a, 4, ITERS, EPS, 1e-6, config=config))(*args)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=MIXES_RTOL, atol=0)
