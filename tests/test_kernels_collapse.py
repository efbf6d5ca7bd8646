"""The collapse-and-norm kernel (dijax.kernels.collapse): the Pallas kernel, interpreted, against the reference: bit
for bit where the sums are exact in any order, within a rounding step otherwise; the fq8 output; every row written
across program blocks; the token limit; the shapes it refuses; the seam, and the model with it."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dijax.kernels import collapse
from tests.test_quant import fq8_step

pytestmark = pytest.mark.cost(40)  # CI seconds, a scheduling hint (tests/conftest.py)

BF16 = ml_dtypes.bfloat16
EPS = 1e-6
POISON = collapse.CollapseConfig(poison=True)


def _inputs(t: int, c: int, d: int, seed: int, exact: bool):
    """bf16 streams x [t, c, d], float32 pre [t, c], the norm's bf16 weight [d]. ``exact``: x in multiples of 1/8 up
    to 8 and pre in multiples of 1/4 up to 1, so every product, partial sum and square is exact in float32 (any
    order gives XLA's value); else random rows at scales from 0.1 to 4 and pre in (0, 1)."""
    rng = np.random.default_rng(seed)
    if exact:
        x, pre = rng.integers(-64, 65, (t, c, d)) / 8, rng.integers(0, 5, (t, c)) / 4
    else:
        x, pre = rng.standard_normal((t, c, d)) * rng.uniform(0.1, 4.0, (t, 1, 1)), rng.uniform(0, 1, (t, c))
    weight = 1 + 0.25 * rng.standard_normal(d)
    return (jnp.asarray(np.asarray(x, np.float32).astype(BF16)), jnp.asarray(pre, jnp.float32),
            jnp.asarray(np.asarray(weight, np.float32).astype(BF16)))


@pytest.mark.parametrize("t, c, d, block", [(1, 4, 256, 4), (3, 4, 256, 4), (8, 4, 256, 2), (13, 4, 1024, 4),
                                            (5, 2, 96, 4)])
@pytest.mark.parametrize("quantized", [False, True])
def test_kernel_is_the_reference_where_the_sums_are_exact(t, c, d, block, quantized):
    """Token counts within one program block and across blocks (the last partial), the tiny width (one chunk),
    1024 (two chunks of 512), a width that is no power of two (chunks of 32), two streams; outputs start NaN-filled,
    so an unwritten element shows."""
    x, pre, weight = _inputs(t, c, d, seed=t + d, exact=True)
    config = collapse.CollapseConfig(block_tokens=block, poison=True)
    got = collapse.collapse_norm_pallas(x, pre, weight, EPS, quantized, interpret=True, config=config)
    want = collapse.collapse_norm_reference(x, pre, weight, EPS, quantized)
    got, want = (got, want) if quantized else ((got,), (want,))
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape == (t, d) and g.dtype == w.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_kernel_agrees_with_the_reference_to_a_rounding_step():
    """Random rows: the sums of squares may round differently, so a value may differ by one bf16 ulp and its fq8 by
    one e4m3 step of its block (its scale over 8 at most); nearly all are equal."""
    x, pre, weight = _inputs(16, 4, 4096, seed=3, exact=False)
    y, y_act = (np.asarray(a, np.float32) for a in
                collapse.collapse_norm_pallas(x, pre, weight, EPS, True, interpret=True, config=POISON))
    y_want, act_want = (np.asarray(a, np.float32) for a in collapse.collapse_norm_reference(x, pre, weight, EPS, True))
    np.testing.assert_allclose(y, y_want, rtol=2 ** -7, atol=0)
    assert (np.abs(y_act - act_want) <= fq8_step(act_want)).all()
    assert (y == y_want).mean() > 0.99 and (y_act == act_want).mean() > 0.99


def test_against_a_float64_oracle():
    """Independent of the reference: the float64 weighted sum of the streams rounded to bf16, its RMS norm times the
    weight; the fq8 output is the normed row on the e4m3 grid of a power-of-two scale per 32 values."""
    x, pre, weight = _inputs(4, 4, 256, seed=7, exact=False)
    y, y_act = (np.asarray(a, np.float64) for a in
                collapse.collapse_norm_pallas(x, pre, weight, EPS, True, interpret=True, config=POISON))
    summed = np.einsum("tc,tcd->td", np.asarray(pre, np.float64), np.asarray(x, np.float64))
    summed = summed.astype(np.float32).astype(BF16).astype(np.float64)
    want = summed / np.sqrt((summed * summed).mean(axis=1, keepdims=True) + EPS) * np.asarray(weight, np.float64)
    np.testing.assert_allclose(y, want, rtol=2 ** -7)
    scale = np.exp2(np.ceil(np.log2(np.abs(y).reshape(4, -1, 32).max(-1) / 448)))
    codes = y_act.reshape(4, -1, 32) / scale[..., None]
    grid = np.asarray(codes, np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    np.testing.assert_array_equal(codes, grid)
    assert np.abs(codes).max() <= 448 and (np.abs(y_act - y) <= np.repeat(scale, 32, axis=1) * 32).all()


def test_steps_over_the_token_limit_take_the_reference():
    config = collapse.CollapseConfig(max_tokens=4, poison=True)
    x, pre, weight = _inputs(6, 4, 256, seed=1, exact=False)
    got = collapse.collapse_norm_pallas(x, pre, weight, EPS, interpret=True, config=config)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(collapse.collapse_norm_reference(x, pre, weight, EPS)))


def test_zero_tokens_and_refused_shapes():
    x, pre, weight = _inputs(1, 4, 256, seed=2, exact=True)
    y, y_act = collapse.collapse_norm_pallas(x[:0], pre[:0], weight, EPS, True, interpret=True)
    assert y.shape == y_act.shape == (0, 256)
    with pytest.raises(ValueError, match="multiple of 32, got 48"):
        collapse.collapse_norm_pallas(x[:, :, :48], pre, weight[:48], EPS, interpret=True)
    with pytest.raises(ValueError, match=r"needs pre \[T, C\] and weight \[D\]"):
        collapse.collapse_norm_pallas(x, pre[:, :3], weight, EPS, interpret=True)
    with pytest.raises(ValueError, match="collapse impl must be one of"):
        collapse.collapse_norm(x, pre, weight, EPS, impl="triton")


def test_the_seam_picks_the_implementation():
    x, pre, weight = _inputs(2, 4, 256, seed=4, exact=True)
    for impl in collapse.IMPLS:
        got = collapse.collapse_norm(x, pre, weight, EPS, impl=impl)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(collapse.collapse_norm_reference(x, pre, weight,
                                                                                                      EPS)))


def test_the_model_step_takes_it(tiny_nodrop):
    """The tiny-nodrop model's step of two prompts (10 tokens: the kernels take steps of up to 16), every position's
    logits, with the collapse and latents kernels interpreted against the references: the same logits up to the
    kernels' rounding steps (a bf16 ulp of a normed value, an e4m3 step of a KV or fq8 value), the same argmax."""
    from dijax.model.step import SeqChunk
    from dijax.runtime.model_runner import ModelRunner

    fixture, params, consts = tiny_nodrop
    logits = {}
    for kernels in ("off", "off,collapse_impl=pallas,latents_impl=pallas"):
        runner = ModelRunner(fixture.cfg, params, consts, num_blocks=4, num_slots=2, block_size=16, max_model_len=16,
                             max_num_seqs=2, max_num_batched_tokens=16, kernels=kernels)
        got, _ = runner.forward([SeqChunk(slot=i, block_table=[i], start=0, tokens=p, logits="all")
                                 for i, p in enumerate([[5, 17, 99, 3, 250, 7, 11], [300, 1, 2]])])
        logits[kernels] = np.concatenate([np.asarray(x, np.float32) for x in got])
    want, got = logits.values()
    r = np.abs(got - want).max() / np.abs(want).max()
    print(f"max |difference| / max |logit|: {r:.2e}")
    assert r < 2e-3, r  # 0 on the CI machine; a 5 % scale error in the collapse kernel gave 5.3e-2
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
