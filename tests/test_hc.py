"""Unit tests for dijax.model.hc (manifold-constrained hyper-connections) against float64 numpy evaluations of the
spec formulas, plus structural properties of the Sinkhorn-normalised comb matrix."""

import dijax  # noqa: F401  (sets XLA flags before jax initialises)

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dijax.kernels.collapse import collapse
from dijax.kernels.sinkhorn import split
from dijax.model import hc
from dijax.kernels.numerics import matmul_f32
from dijax.kernels.numerics import LARGE_STEP_TOKENS
from dijax.model.layers import matmul_f32_weight

BF16 = ml_dtypes.bfloat16
T, C, D = 5, 4, 64
M = (2 + C) * C
ITERS, EPS, NORM_EPS = 20, 1e-6, 1e-20


# ---------------------------------------------------------------------------------------------------------------------
# float64 references
# ---------------------------------------------------------------------------------------------------------------------

def sigmoid64(z):
    return 1.0 / (1.0 + np.exp(-z))


def np_split_sinkhorn(mixes_TM, scale_3, base_M, c, iters, eps):
    m = np.asarray(mixes_TM, np.float64)
    scale = np.asarray(scale_3, np.float64)
    base = np.asarray(base_M, np.float64)
    t = m.shape[0]
    pre = np.empty((t, c))
    post = np.empty((t, c))
    comb = np.empty((t, c, c))
    for tok in range(t):
        for k in range(c):
            pre[tok, k] = sigmoid64(m[tok, k] * scale[0] + base[k]) + eps
            post[tok, k] = 2 * sigmoid64(m[tok, c + k] * scale[1] + base[c + k])
        logits = np.empty((c, c))
        for i in range(c):
            for j in range(c):
                idx = 2 * c + c * i + j
                logits[i, j] = m[tok, idx] * scale[2] + base[idx]
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        a = e / e.sum(axis=1, keepdims=True) + eps
        a = a / (a.sum(axis=0, keepdims=True) + eps)
        for _ in range(iters - 1):
            a = a / (a.sum(axis=1, keepdims=True) + eps)
            a = a / (a.sum(axis=0, keepdims=True) + eps)
        comb[tok] = a
    return pre, post, comb


def np_mixes(x_TCD, fn_MX, scale_3, base_M, c, iters, hc_eps, norm_eps):
    flat = np.asarray(x_TCD).astype(np.float64).reshape(x_TCD.shape[0], -1)
    rms = 1.0 / np.sqrt((flat ** 2).mean(axis=1, keepdims=True) + norm_eps)
    raw = (flat @ np.asarray(fn_MX, np.float64).T) * rms
    return np_split_sinkhorn(raw, scale_3, base_M, c, iters, hc_eps)


def bf16_ulp(v):
    """One bf16 ulp at the magnitude of v (8 significant bits)."""
    a = np.maximum(np.abs(np.asarray(v, np.float64)), 2.0 ** -126)
    return np.ldexp(1.0, np.floor(np.log2(a)).astype(np.int64) - 7)


def assert_within_bf16_ulp(got_bf16, want_f64):
    got = np.asarray(got_bf16).astype(np.float64)
    err = np.abs(got - want_f64)
    bad = err > bf16_ulp(want_f64)
    assert not bad.any(), f"{bad.sum()} values off by more than 1 bf16 ulp, e.g. got {got[bad][:4]} " \
                          f"want {want_f64[bad][:4]}"


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(1234)
    return {
        "mixes_TM": rng.standard_normal((T, M)).astype(np.float32),
        "scale_3": np.float32([0.7, 1.3, 2.1]),
        "base_M": (0.5 * rng.standard_normal(M)).astype(np.float32),
        "x_TCD": rng.standard_normal((T, C, D)).astype(BF16),
        "fn_MX": (rng.standard_normal((M, C * D)) / np.sqrt(C * D)).astype(np.float32),
        "y_TD": rng.standard_normal((T, D)).astype(BF16),
    }


def run_split(inp, iters=ITERS, eps=EPS):
    out = split(jnp.asarray(inp["mixes_TM"]), jnp.asarray(inp["scale_3"]), jnp.asarray(inp["base_M"]), C, iters, eps)
    return [np.asarray(a) for a in out]


# ---------------------------------------------------------------------------------------------------------------------
# the mix split (dijax.kernels.sinkhorn.split, the reference)
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("iters", [1, 2, ITERS])
def test_split_sinkhorn_matches_float64(inputs, iters):
    pre, post, comb = run_split(inputs, iters)
    assert pre.shape == (T, C) and post.shape == (T, C) and comb.shape == (T, C, C)
    assert pre.dtype == post.dtype == comb.dtype == np.float32
    want_pre, want_post, want_comb = np_split_sinkhorn(inputs["mixes_TM"], inputs["scale_3"], inputs["base_M"], C,
                                                       iters, EPS)
    np.testing.assert_allclose(pre, want_pre, rtol=1e-5, atol=0)
    np.testing.assert_allclose(post, want_post, rtol=1e-5, atol=0)
    np.testing.assert_allclose(comb, want_comb, rtol=1e-5, atol=1e-8)


def test_split_sinkhorn_comb_is_row_major(inputs):
    # put a large logit at comb[1][2] (mix index 2C + C*1 + 2) for token 0: the row-major layout makes it the
    # dominant entry of row 1, column 2, not of row 2, column 1
    inp = dict(inputs)
    mixes = inp["mixes_TM"].copy()
    mixes[0, 2 * C:] = 0.0
    mixes[0, 2 * C + C * 1 + 2] = 10.0
    inp["mixes_TM"] = mixes
    inp["base_M"] = np.zeros(M, np.float32)
    inp["scale_3"] = np.float32([1, 1, 1])
    comb = run_split(inp)[2][0]
    # Sinkhorn limit: row 1 and column 2 are ~ (0, 0, 1, 0); the other rows share the rest ~ 1/3 each
    assert comb[1, 2] > 0.9 and comb[2, 1] < 0.4 and comb[1, 1] < 0.05 and comb[2, 2] < 0.05
    assert np.unravel_index(np.argmax(comb), comb.shape) == (1, 2)


def test_split_sinkhorn_structure(inputs):
    pre, post, comb = run_split(inputs)
    assert (pre > np.float32(EPS)).all() and (pre < 1 + np.float32(EPS)).all()
    assert (post > 0).all() and (post < 2).all()
    assert (comb > 0).all()
    # the last operation is a column normalisation: column sums are S / (S + eps) ~ 1 - eps
    np.testing.assert_allclose(comb.sum(axis=1), 1.0, atol=1e-5)
    # after 20 Sinkhorn rounds the rows are close to stochastic too (convergence is slow for skewed logits:
    # the float64 reference shows the same ~1e-2 row error on these inputs)
    np.testing.assert_allclose(comb.sum(axis=2), 1.0, atol=2e-2)
    want_rows = np_split_sinkhorn(inputs["mixes_TM"], inputs["scale_3"], inputs["base_M"], C, ITERS, EPS)[2].sum(2)
    np.testing.assert_allclose(comb.sum(axis=2), want_rows, atol=1e-5)
    # with mild logits the rows converge tightly
    mild = dict(inputs, scale_3=np.float32([0.7, 1.3, 0.3]))
    np.testing.assert_allclose(run_split(mild)[2].sum(axis=2), 1.0, atol=1e-4)


def test_split_sinkhorn_zero_mixes_hand_values():
    # all-zero mixes and base: pre = sigmoid(0) + eps = 0.5 + 1e-6, post = 2 * sigmoid(0) = 1, comb uniform: every
    # entry equal (by symmetry, bit for bit) and ~ 1/C
    z = jnp.zeros((2, M), jnp.float32)
    pre, post, comb = (np.asarray(a) for a in split(z, jnp.ones(3), jnp.zeros(M), C, ITERS, EPS))
    np.testing.assert_allclose(pre, 0.5 + EPS, rtol=1e-7)
    np.testing.assert_array_equal(post, np.ones((2, C), np.float32))
    assert (comb == comb[0, 0, 0]).all()
    np.testing.assert_allclose(comb, 1.0 / C, rtol=1e-5)


def test_split_sinkhorn_batches_tokens_independently(inputs):
    full = run_split(inputs)
    one = dict(inputs, mixes_TM=inputs["mixes_TM"][2:3])
    single = run_split(one)
    for a, b in zip(full, single):
        np.testing.assert_array_equal(a[2:3], b)


# ---------------------------------------------------------------------------------------------------------------------
# mixes
# ---------------------------------------------------------------------------------------------------------------------

def test_mixes_matches_float64(inputs):
    got = hc.mixes(jnp.asarray(inputs["x_TCD"]), jnp.asarray(inputs["fn_MX"]), jnp.asarray(inputs["scale_3"]),
                   jnp.asarray(inputs["base_M"]), C, ITERS, EPS, NORM_EPS)
    want = np_mixes(inputs["x_TCD"], inputs["fn_MX"], inputs["scale_3"], inputs["base_M"], C, ITERS, EPS, NORM_EPS)
    for g, w in zip(got, want):
        assert np.asarray(g).dtype == np.float32
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-8)


def test_matmul_f32_weight_sums_exact_products():
    # bf16 x against an fp32 weight through three bf16 parts: within fp32 rounding of the exact float64 product,
    # as close as the fp32 GEMM of x.float() it replaces
    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 1024)).astype(BF16)
    w = (rng.standard_normal((24, 1024)) / 32).astype(np.float32)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    got = np.asarray(matmul_f32_weight(jnp.asarray(x), jnp.asarray(w)))
    fp32 = np.asarray(matmul_f32(jnp.asarray(x.astype(np.float32)), jnp.asarray(w)))
    assert got.dtype == np.float32
    scale = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T  # the sum of |products|
    assert np.abs(got - exact).max() <= 2 ** -20 * scale.max()
    assert np.abs(got - exact).max() <= 4 * max(np.abs(fp32 - exact).max(), 2 ** -24 * scale.max())
    # a bf16 rounding of the weight alone would be far off: the lower parts carry the weight's other 16 bits
    assert np.abs(np.asarray(matmul_f32(jnp.asarray(x), jnp.asarray(w.astype(BF16)))) - exact).max() > \
        100 * np.abs(got - exact).max()
    with pytest.raises(ValueError, match="bf16 x"):
        matmul_f32_weight(jnp.asarray(x.astype(np.float32)), jnp.asarray(w))


def test_mixes_of_many_tokens_match_float64(inputs):
    # in a large step the projection is the split bf16 GEMM: the same results to fp32 rounding
    rng = np.random.default_rng(11)
    x = rng.standard_normal((LARGE_STEP_TOKENS, C, D)).astype(BF16)
    args = [inputs[k] for k in ("fn_MX", "scale_3", "base_M")]
    got = hc.mixes(jnp.asarray(x), *(jnp.asarray(a) for a in args), C, ITERS, EPS, NORM_EPS)
    want = np_mixes(x, *args, C, ITERS, EPS, NORM_EPS)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-8)


def test_mixes_uses_one_rms_over_all_copies(inputs):
    # scaling one copy changes the shared statistic: the result must equal the float64 formula with a single
    # rsqrt over all C * D values, and differ from a per-copy normalisation
    x = inputs["x_TCD"].astype(np.float32)
    x[:, 0] *= 8.0
    x = x.astype(BF16)
    args = (inputs["fn_MX"], inputs["scale_3"], inputs["base_M"], C, ITERS, EPS, NORM_EPS)
    got_pre = np.asarray(hc.mixes(jnp.asarray(x), *(jnp.asarray(a) for a in args[:3]), *args[3:])[0])
    want_pre = np_mixes(x, *args)[0]
    np.testing.assert_allclose(got_pre, want_pre, rtol=1e-5)
    # per-copy rms (the wrong reading of the spec) gives clearly different pre weights
    xf = x.astype(np.float64)
    per_copy = xf / np.sqrt((xf ** 2).mean(axis=2, keepdims=True) + NORM_EPS)
    raw = per_copy.reshape(T, -1) @ inputs["fn_MX"].astype(np.float64).T
    wrong_pre = np_split_sinkhorn(raw, *args[1:3], C, ITERS, EPS)[0]
    assert np.abs(wrong_pre - want_pre).max() > 1e-3


def test_mixes_is_scale_invariant(inputs):
    # the rms normalisation makes the mixes invariant to scaling x by a power of two (exact in bf16)
    args = [jnp.asarray(inputs[k]) for k in ("fn_MX", "scale_3", "base_M")]
    a = hc.mixes(jnp.asarray(inputs["x_TCD"]), *args, C, ITERS, EPS, NORM_EPS)
    x4 = (inputs["x_TCD"].astype(np.float32) * 4).astype(BF16)
    b = hc.mixes(jnp.asarray(x4), *args, C, ITERS, EPS, NORM_EPS)
    for u, v in zip(a, b):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# pre / post
# ---------------------------------------------------------------------------------------------------------------------

def test_pre_matches_float64(inputs):
    pre_TC = run_split(inputs)[0]
    x = inputs["x_TCD"]
    got = np.asarray(collapse(jnp.asarray(x), jnp.asarray(pre_TC)))
    assert got.shape == (T, D) and got.dtype == BF16
    want = np.einsum("tc,tcd->td", pre_TC.astype(np.float64), x.astype(np.float64))
    assert_within_bf16_ulp(got, want)


def test_pre_hand_values():
    x = np.array([[[1.0, 2.0], [3.0, -4.0]]], BF16)  # T=1, C=2, D=2
    p = np.float32([[0.5, 0.25]])
    got = np.asarray(collapse(jnp.asarray(x), jnp.asarray(p)))
    np.testing.assert_array_equal(got.astype(np.float32), np.float32([[0.5 + 0.75, 1.0 - 1.0]]))
    # float32 input gives float32 output
    got32 = np.asarray(collapse(jnp.asarray(x.astype(np.float32)), jnp.asarray(p)))
    assert got32.dtype == np.float32


def test_post_matches_float64(inputs):
    _, post_TC, comb_TCC = run_split(inputs)
    y, res = inputs["y_TD"], inputs["x_TCD"]
    got = np.asarray(hc.post(jnp.asarray(y), jnp.asarray(res), jnp.asarray(post_TC), jnp.asarray(comb_TCC)))
    assert got.shape == (T, C, D) and got.dtype == BF16
    want = (post_TC.astype(np.float64)[:, :, None] * y.astype(np.float64)[:, None, :]
            + np.einsum("tik,tid->tkd", comb_TCC.astype(np.float64), res.astype(np.float64)))
    assert_within_bf16_ulp(got, want)


def test_post_hand_values_uses_comb_columns():
    # T=1, C=2, D=1: out[k] = post[k] * y + sum_i comb[i][k] * residual[i]
    y = np.array([[2.0]], BF16)
    res = np.array([[[10.0], [100.0]]], BF16)
    post_TC = np.float32([[0.5, 1.5]])
    comb = np.float32([[[0.25, 0.75],  # comb[0][0], comb[0][1]
                        [0.5, 0.125]]])  # comb[1][0], comb[1][1]
    got = np.asarray(hc.post(jnp.asarray(y), jnp.asarray(res), jnp.asarray(post_TC), jnp.asarray(comb)))
    # k=0: 0.5*2 + 0.25*10 + 0.5*100 = 53.5 ; k=1: 1.5*2 + 0.75*10 + 0.125*100 = 23
    np.testing.assert_array_equal(got.astype(np.float32), np.float32([[[53.5], [23.0]]]))


def test_post_identity_comb_and_zero_post_returns_residual(inputs):
    res = inputs["x_TCD"]
    eye = np.broadcast_to(np.eye(C, dtype=np.float32), (T, C, C))
    got = np.asarray(hc.post(jnp.asarray(inputs["y_TD"]), jnp.asarray(res), jnp.zeros((T, C)), jnp.asarray(eye)))
    np.testing.assert_array_equal(got.view(np.uint16), res.view(np.uint16))
