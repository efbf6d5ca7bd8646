"""The hyper-connection mix split (dijax/kernels/sinkhorn.py): the Pallas kernel (interpret mode on CPU) against the
jnp reference, and the model's mixes through either.

The two agree to float32 noise, not bit for bit: both divide with correct rounding and sum in the same order, but
XLA compiles the affine part differently in the two programs (an FMA in one, a multiply and an add in the other),
and a one-ulp difference in a logit moves a sigmoid by up to ~20 ulps (measured on the CPU with strongly skewed
mixes: a relative 2e-6). The GPU run (tests/gpu) records how close they are there."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dijax.kernels import sinkhorn as sk
from dijax.kernels.numerics import rms_factor
from dijax.kernels.sinkhorn import BLOCK_T, split, split_pallas, split_reference
from dijax.model import hc

EXACT, FAST = sk.SinkhornConfig(fast_divide=False), sk.SinkhornConfig(fast_divide=True)
RTOL = 1e-5


def mix_inputs(t: int, c: int, seed: int, spread: float = 3.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Raw mixes float32 [T, (2 + C) C] of the given spread, a scale [3] and a base [M] like a layer's."""
    m = (2 + c) * c
    mixes = jax.random.normal(jax.random.key(seed), (t, m), jnp.float32) * spread
    base = jax.random.normal(jax.random.key(seed + 1), (m,), jnp.float32) * 0.1
    return mixes, jnp.array([0.5, 1.5, 2.0], jnp.float32), base


def assert_split_close(got, want, rtol: float = RTOL) -> None:
    """(pre, post, comb) of one shape and dtype, each within ``rtol`` of the other's."""
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=0)


@pytest.mark.parametrize("config", [EXACT, FAST], ids=["exact", "fast_divide"])
@pytest.mark.parametrize("t, c, iters", [(1, 2, 20), (5, 4, 20), (BLOCK_T + 3, 4, 20), (3, 4, 1),
                                         (sk.TOKEN_MAJOR_MAX_TOKENS + 2, 2, 3)])
def test_pallas_matches_reference(t, c, iters, config):
    args = (*mix_inputs(t, c, seed=t), c, iters, 1e-6)
    got = split_pallas(*args, interpret=True, config=config)
    assert_split_close(got, split_reference(*args))
    # the last operation is a column normalisation: every column sums to ~1
    np.testing.assert_allclose(np.asarray(got[2]).sum(axis=-2), 1.0, rtol=1e-4)


@pytest.mark.parametrize("t", [3, BLOCK_T + 3])
def test_pallas_applies_the_rms_factor_as_the_reference(t):
    """The bare projection and its tokens' sums of squares (``hc.mixes``' form): the kernel applies the RMS factor in
    its prologue, the reference first (the projection times the factor)."""
    mixes, scale, base = mix_inputs(t, 4, seed=t)
    squares = jax.random.uniform(jax.random.key(7), (t, 1), jnp.float32, 100.0, 4000.0)
    args = (mixes, scale, base, 4, 20, 1e-6, squares, 1024, 1e-6)
    want = split_reference(*args)
    assert_split_close(split_pallas(*args, interpret=True), want)
    raw = mixes * rms_factor(squares, 1024, 1e-6)
    assert_split_close(want, split_reference(raw, scale, base, 4, 20, 1e-6), rtol=0)


def test_no_tokens_gives_empty_parts():
    args = (jnp.zeros((0, 24), jnp.float32), jnp.ones(3), jnp.zeros(24), 4, 20, 1e-6)
    got = split_pallas(*args, interpret=True)
    assert [g.shape for g in got] == [(0, 4), (0, 4), (0, 4, 4)] == [w.shape for w in split_reference(*args)]


def test_the_dispatcher_checks_the_impl():
    with pytest.raises(ValueError, match=r"sinkhorn impl must be one of \('reference', 'pallas'\), got 'triton'"):
        split(*mix_inputs(3, 4, seed=0), 4, 3, 1e-6, impl="triton")


def test_mixes_through_either_impl():
    """The hyper-connection mixes (RMS statistic, projection, split) with the kernel (interpreted off a GPU: the
    dispatcher picks the mode, as for every kernel) are the reference's to float32 noise."""
    x = jax.random.normal(jax.random.key(1), (9, 4, 32), jnp.float32).astype(jnp.bfloat16)
    fn = jax.random.normal(jax.random.key(2), (24, 128), jnp.float32) * 0.1
    scale, base = jnp.array([0.5, 1.5, 2.0], jnp.float32), jax.random.normal(jax.random.key(3), (24,)) * 0.1
    want = hc.mixes(x, fn, scale, base, 4, 4, 1e-6, 1e-20)
    assert_split_close(hc.mixes(x, fn, scale, base, 4, 4, 1e-6, 1e-20, sinkhorn_impl="pallas"), want)


def _affine_vectors(mixes: np.ndarray, c: int) -> list[jax.Array]:
    """The kernel's operands for ``sk._split``: entry e's vector over the tokens (scale 1, base 0)."""
    return [jnp.asarray(mixes[:, e]) for e in range((2 + c) * c)]


def test_tokens_outside_the_fast_range_are_flagged():
    """The kernel divides by the fast path only where every dividend >= FAST_RANGE[0] and every divisor <
    FAST_RANGE[1] (else its block is recomputed with exact divisions). Flagged: a comb logit far below its row's
    maximum (its exp underflows), a sigmoid of a large negative argument (1 + e past 2^40), a NaN; not flagged:
    the model's mixes."""
    c = 4
    mixes = np.array(mix_inputs(5, c, seed=3)[0])
    mixes[1, 2 * c + 5] = -200.0
    mixes[2, c + 1] = -60.0
    mixes[3, 0] = np.nan
    pre, post, comb, inside = sk._split(_affine_vectors(mixes, c), c=c, rounds=3, eps=np.float32(1e-6),
                                        reciprocal=lambda y: y, divide=lambda x, y, r: x / y, check=True)
    assert np.asarray(inside).tolist() == [True, False, False, False, True]
    want = split_reference(jnp.asarray(mixes), jnp.ones(3), jnp.zeros((2 + c) * c), c, 4, 1e-6)
    keep = np.array([0, 1, 2, 4])  # the same arithmetic as the reference (interpreted division is IEEE-rounded)
    got = (jnp.stack(pre, -1), jnp.stack(post, -1), jnp.stack([jnp.stack(row, -1) for row in comb], -2))
    assert_split_close([g[keep] for g in got], [w[keep] for w in want])


def test_a_block_outside_the_fast_range_gives_the_reference():
    """A block with a token outside the fast range takes the kernel's exact path (interpreted here): the
    reference's result, as in every other block (to float32 noise on the CPU; tests/gpu checks the bits)."""
    mixes, scale, base = mix_inputs(BLOCK_T + 3, 4, seed=5)
    mixes = mixes.at[BLOCK_T + 1, 8].set(-500.0)
    args = (mixes, scale, base, 4, 20, 1e-6)
    assert_split_close(split_pallas(*args, interpret=True, config=FAST), split_reference(*args))


@pytest.mark.parametrize("config", [EXACT, FAST], ids=["exact", "fast_divide"])
def test_lowers_to_triton_without_a_gpu(lower_for_cuda, config):
    """Both GPU forms (``div.rn.f32`` throughout; the inline-PTX fast path with the exact fallback under a branch)
    lower to Triton IR at the model's C = 4 and 20 iterations."""
    text = lower_for_cuda(lambda m, s, b: split_pallas(m, s, b, 4, 20, 1e-6, interpret=False, config=config),
                          jax.ShapeDtypeStruct((3, 24), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.float32),
                          jax.ShapeDtypeStruct((24,), jnp.float32))
    assert "triton" in text


MIXES_RTOL = 1e-4


def stream_inputs(t: int, c: int, k: int, seed: int) -> tuple[jax.Array, ...]:
    """A hyper-connection's flattened bf16 streams x [T, K] and its float32 fn [M, K], scale [3] and base [M]."""
    m = (2 + c) * c
    x = (jax.random.normal(jax.random.key(seed), (t, k), jnp.float32) * 2).astype(jnp.bfloat16)
    fn = jax.random.normal(jax.random.key(seed + 1), (m, k), jnp.float32) * (4 / np.sqrt(k))
    base = jax.random.normal(jax.random.key(seed + 2), (m,), jnp.float32) * 0.1
    return x, fn, jnp.array([0.5, 1.5, 2.0], jnp.float32), base


@pytest.mark.parametrize("config", [EXACT, FAST], ids=["exact", "fast_divide"])
@pytest.mark.parametrize("t, c, k", [(1, 4, 1024), (9, 4, 1024), (BLOCK_T, 4, 640), (17, 2, 256)])
def test_fused_mixes_match_reference(t, c, k, config):
    """mixes_pallas (the projection's parts over K, the sums of x^2 in the same programs, then the split with the
    RMS statistic and affine as its prologue) against mixes_reference: token counts that are not a power of two
    (rows past T never loaded), K in 16 parts of one chunk, in 2 parts of 5, and C = 2. The projection sums in another
    order than XLA's einsum, so a raw mix (a sum of K products of magnitude ~1) moves by a few float32 ulps of
    its terms, which a sigmoid's or softmax's slope carries into the parts: MIXES_RTOL (measured here: 1.5e-5)."""
    args = (*stream_inputs(t, c, k, seed=t + k), c, 20, 1e-6, 1e-6)
    got = sk.mixes_pallas(*args, interpret=True, config=config)
    assert_split_close(got, sk.mixes_reference(*args), rtol=MIXES_RTOL)
    np.testing.assert_allclose(np.asarray(got[2]).sum(axis=-2), 1.0, rtol=1e-4)


def test_fused_mixes_take_what_they_can():
    x, fn, scale, base = stream_inputs(3, 4, 1024, seed=0)
    with pytest.raises(ValueError, match=r"T 129 must be at most 128, K 1024 a multiple of 64"):
        sk.mixes_pallas(jnp.zeros((BLOCK_T + 1, 1024), jnp.bfloat16), fn, scale, base, 4, 20, 1e-6, 1e-6)
    with pytest.raises(ValueError, match=r"K 1000 a multiple of 64"):
        sk.mixes_pallas(x[:, :1000], fn[:, :1000], scale, base, 4, 20, 1e-6, 1e-6)
    empty = sk.mixes_pallas(x[:0], fn, scale, base, 4, 20, 1e-6, 1e-6, interpret=True)
    assert [e.shape for e in empty] == [(0, 4), (0, 4), (0, 4, 4)]
    # by default: decode steps of up to 16 tokens of streams up to 4096 wide (the tiny model's, not flash-slice's)
    assert sk.fused_mixes(1, 1024) and sk.fused_mixes(16, 4096)
    assert not sk.fused_mixes(17, 1024) and not sk.fused_mixes(1, 20480) and not sk.fused_mixes(0, 1024)
    on = sk.SinkhornConfig(fused_mixes_max_tokens=64, fused_mixes_max_width=20480)
    assert sk.fused_mixes(64, 20480, on) and not sk.fused_mixes(65, 1024, on) and not sk.fused_mixes(1, 20481, on)
    assert not sk.fused_mixes(1, 1024, sk.SinkhornConfig(fused_mixes_max_tokens=0))
    for name in ("fused_mixes_max_tokens", "fused_mixes_max_width"):
        with pytest.raises(ValueError, match=f"{name} must be >= 0"):
            sk.SinkhornConfig(**{name: -1})


def test_model_mixes_take_the_fused_kernel_when_on(monkeypatch):
    """hc.mixes with the Sinkhorn kernel goes through mixes_pallas for the steps the config names (a spy sees the
    call) and gives the reference's values either way."""
    x = jax.random.normal(jax.random.key(1), (9, 4, 256), jnp.float32).astype(jnp.bfloat16)
    _, fn, scale, base = stream_inputs(9, 4, 1024, seed=5)
    calls = []
    fused = sk.mixes_pallas
    monkeypatch.setattr(sk, "mixes_pallas", lambda *a, **k: calls.append(a[0].shape) or fused(*a, **k))
    monkeypatch.setattr(sk, "CONFIG", sk.SinkhornConfig(fused_mixes_max_tokens=0))
    want = hc.mixes(x, fn, scale, base, 4, 20, 1e-6, 1e-6)
    assert_split_close(hc.mixes(x, fn, scale, base, 4, 20, 1e-6, 1e-6, sinkhorn_impl="pallas"), want)
    assert calls == []
    monkeypatch.setattr(sk, "CONFIG", sk.SinkhornConfig(fused_mixes_max_tokens=16, fused_mixes_max_width=1023))
    assert_split_close(hc.mixes(x, fn, scale, base, 4, 20, 1e-6, 1e-6, sinkhorn_impl="pallas"), want)
    assert calls == []  # too wide
    monkeypatch.setattr(sk, "CONFIG", sk.SinkhornConfig(fused_mixes_max_tokens=16))
    assert_split_close(hc.mixes(x, fn, scale, base, 4, 20, 1e-6, 1e-6, sinkhorn_impl="pallas"), want,
                       rtol=MIXES_RTOL)
    assert calls == [(9, 1024)]


def test_fused_mixes_lower_to_triton_without_a_gpu(lower_for_cuda):
    """Both kernels of mixes_pallas lower to Triton IR at flash-slice's width (C * D = 20480: 32 parts of 10
    chunks) and a decode batch of 64."""
    text = lower_for_cuda(lambda x, f, s, b: sk.mixes_pallas(x, f, s, b, 4, 20, 1e-6, 1e-6, interpret=False),
                          jax.ShapeDtypeStruct((64, 20480), jnp.bfloat16), jax.ShapeDtypeStruct((24, 20480), jnp.float32),
                          jax.ShapeDtypeStruct((3,), jnp.float32), jax.ShapeDtypeStruct((24,), jnp.float32))
    assert text.count("triton") >= 2
