"""Unit tests for dijax.kernels.quant: fp8 / fp4 fake quantisation and block-scaled weight decoding.

Expectations are either worked out by hand (the comments give the arithmetic) or produced by an independent numpy
implementation written here from the spec formulas (frexp for the power-of-two scale, a grid search with an explicit
tie rule for e2m1, ml_dtypes or an explicit quantum rounding for e4m3).
"""

import dijax  # noqa: F401  (sets XLA flags before jax initialises)

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dijax.kernels import quant

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ---------------------------------------------------------------------------------------------------------------------
# independent numpy references
# ---------------------------------------------------------------------------------------------------------------------

def np_pow2_scale(amax, inv_max):
    """2^ceil(log2(float32(amax) * float32(inv_max))) via frexp (y = f * 2^e, f in [0.5, 1))."""
    y = (np.asarray(amax, np.float32) * np.float32(inv_max)).astype(np.float32)
    frac, exp = np.frexp(y.astype(np.float64))
    k = np.where(frac == 0.5, exp - 1, exp)  # exact power of two: no rounding up
    return np.ldexp(np.float64(1.0), k).astype(np.float32)


def np_e4m3_quantum(x):
    """Round float64 to e4m3fn by hand: quantum 2^(floor(log2|x|) - 3) for normals, 2^-9 for subnormals; RNE."""
    x = np.clip(np.asarray(x, np.float64), -448.0, 448.0)
    a = np.abs(x)
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    quantum = np.where(a >= 2.0 ** -6, 2.0 ** (e - 3), 2.0 ** -9)
    return np.round(x / quantum) * quantum  # np.round is half-to-even; x / quantum is exact


def np_e4m3_mldtypes(x_f32):
    return np.clip(np.asarray(x_f32, np.float32), -448, 448).astype(E4M3).astype(np.float32)


def np_e2m1(v):
    """Nearest grid magnitude; on an exact tie between two grid points take the one with the even code."""
    v = np.asarray(v, np.float64)
    dist = np.abs(np.abs(v)[..., None] - E2M1_GRID)
    best = dist.min(axis=-1, keepdims=True)
    cands = dist == best
    n_cands = cands.sum(axis=-1)
    first = np.argmax(cands, axis=-1)
    code = np.where((n_cands == 2) & (first % 2 == 1), first + 1, first)
    return np.copysign(E2M1_GRID[code], v)


def np_fq8(x_bf16, block=32):
    x = np.asarray(x_bf16).astype(np.float32)
    xg = x.reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(xg).max(axis=-1, keepdims=True), np.float32(1e-4))
    s = np_pow2_scale(amax, np.float32(1.0 / 448.0))
    q = np_e4m3_mldtypes((xg / s).astype(np.float32))
    with np.errstate(over="ignore"):  # q * s may overflow to inf near the float32 limit, as in the spec formula
        return (q * s).astype(np.float32).reshape(x.shape).astype(BF16)


def np_fq4_pow2(x_bf16, block=32):
    x = np.asarray(x_bf16).astype(np.float32)
    xg = x.reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(xg).max(axis=-1, keepdims=True), np.float32(6 * 2.0 ** -126))
    s = np_pow2_scale(amax, np.float32(1.0 / 6.0))
    v = np.clip((xg / s).astype(np.float32), -6, 6)
    with np.errstate(over="ignore"):  # 4 * 2^126 overflows bf16, as in the spec formula
        return (np_e2m1(v) * s.astype(np.float64)).reshape(x.shape).astype(BF16)


def fq8_step(want) -> np.ndarray:
    """A bound on one e4m3 step of fq8'd values [T, K]: each 32-value block's largest magnitude over 8 (a code has 3
    mantissa bits), per value. Kernels whose sums round in another order than XLA's stay within it."""
    want = np.asarray(want, np.float32)
    blocks = np.abs(want).reshape(want.shape[0], -1, quant.FP8_BLOCK).max(axis=-1, keepdims=True)
    return np.repeat(blocks, quant.FP8_BLOCK, axis=-1).reshape(want.shape) / 8


def bits(a):
    """Raw bits of a bf16 / f32 array, to compare results bit for bit (signed zeros included)."""
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_bits_equal(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    mismatch = bits(got) != bits(want)
    assert not mismatch.any(), (f"{mismatch.sum()} mismatches; first at {np.argwhere(mismatch)[:5].tolist()}: "
                                f"got {got[mismatch][:5]} want {want[mismatch][:5]}")


def f32(values):
    return jnp.asarray(np.asarray(values, np.float32))


def block32(values, fill=0.0, dtype=BF16):
    """One 32-wide block: the given values followed by ``fill``."""
    row = np.full(32, fill, np.float64)
    row[:len(values)] = values
    return row.astype(dtype)


# ---------------------------------------------------------------------------------------------------------------------
# pow2_scale
# ---------------------------------------------------------------------------------------------------------------------

def test_pow2_scale_exact_powers_of_two_are_not_rounded_up():
    k = np.arange(-120, 121, 7)
    amax = np.ldexp(1.0, k).astype(np.float32)
    got = np.asarray(quant.pow2_scale(f32(amax), np.float32(1.0)))
    np.testing.assert_array_equal(got, amax)


def test_pow2_scale_just_above_and_below_a_power_of_two():
    k = np.arange(-100, 101, 9)
    above = (np.ldexp(1.0, k) * (1 + 2.0 ** -23)).astype(np.float32)  # one ulp above 2^k
    below = (np.ldexp(1.0, k) * (1 - 2.0 ** -24)).astype(np.float32)  # one ulp below 2^k
    np.testing.assert_array_equal(np.asarray(quant.pow2_scale(f32(above), np.float32(1.0))),
                                  np.ldexp(1.0, k + 1).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(quant.pow2_scale(f32(below), np.float32(1.0))),
                                  np.ldexp(1.0, k).astype(np.float32))


def test_pow2_scale_hand_values_with_the_real_inverse_maxima():
    inv448, inv6 = np.float32(1.0 / 448.0), np.float32(1.0 / 6.0)
    # 448 * f32(1/448) rounds to exactly 1.0; 7 * f32(1/448) to exactly 2^-6; 449/448 > 1 -> 2
    got = quant.pow2_scale(f32([448.0, 7.0, 449.0, 1e-4]), inv448)
    np.testing.assert_array_equal(np.asarray(got), np.float32([1.0, 2.0 ** -6, 2.0, 2.0 ** -22]))
    # 6 * f32(1/6) and 12 * f32(1/6) round to exactly 1 and 2; 4/6 -> 1; 7/6 -> 2; 6*2^-126 / 6 -> 2^-126
    got = quant.pow2_scale(f32([6.0, 12.0, 4.0, 7.0, 6 * 2.0 ** -126]), inv6)
    np.testing.assert_array_equal(np.asarray(got), np.float32([1.0, 2.0, 1.0, 2.0, 2.0 ** -126]))


@settings(max_examples=150, deadline=None)
@given(st.floats(min_value=float(np.float32(1e-30)), max_value=float(np.float32(1e30)), width=32, allow_subnormal=False),
       st.sampled_from([1.0, 1.0 / 448.0, 1.0 / 6.0]))
def test_pow2_scale_matches_frexp(amax, inv):
    inv = np.float32(inv)
    got = np.asarray(quant.pow2_scale(f32([amax]), inv))
    np.testing.assert_array_equal(got, np_pow2_scale(np.float32([amax]), inv))


# ---------------------------------------------------------------------------------------------------------------------
# e4m3_round / e2m1_round
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("x, want", [
    (1.0625, 1.0),  # midway 1.0 (m=000) / 1.125 (m=001): even -> 1.0
    (1.1875, 1.25),  # midway 1.125 (m=001) / 1.25 (m=010): even -> 1.25
    (-1.1875, -1.25),
    (1.125, 1.125),
    (1.0625 + 2.0 ** -20, 1.125),  # just above the midpoint
    (248.0, 256.0),  # midway 240 (m=111) / 256 (next binade, m=000): even -> 256
    (432.0, 448.0),  # midway 416 (m=101) / 448 (m=110): even -> 448
    (416.0, 416.0),
    (448.0, 448.0),
    (449.0, 448.0),  # saturates
    (464.0, 448.0),  # clamped before rounding, never NaN
    (1000.0, 448.0),
    (1e30, 448.0),
    (-1e30, -448.0),
    (2.0 ** -9, 2.0 ** -9),  # smallest subnormal
    (3 * 2.0 ** -10, 2.0 ** -8),  # 1.5 * 2^-9: midway codes 1 / 2 -> 2
    (5 * 2.0 ** -10, 2.0 ** -8),  # 2.5 * 2^-9: midway codes 2 / 3 -> 2
    (7 * 2.0 ** -10, 2.0 ** -7),  # 3.5 * 2^-9: midway codes 3 / 4 -> 4
    (2.0 ** -10, 0.0),  # half the smallest subnormal: ties to zero
    (2.0 ** -10 * (1 + 2.0 ** -20), 2.0 ** -9),
    (0.875 * 2.0 ** -6, 0.875 * 2.0 ** -6),  # largest subnormal
    (2.0 ** -6, 2.0 ** -6),  # smallest normal
])
def test_e4m3_round_hand_values(x, want):
    got = np.asarray(quant.e4m3_round(f32([x])))
    assert got.dtype == np.float32
    assert got[0] == np.float32(want), (x, got[0], want)


def test_e4m3_round_keeps_sign_of_zero():
    got = np.asarray(quant.e4m3_round(f32([0.0, -0.0, -2.0 ** -11])))
    assert_bits_equal(got, np.float32([0.0, -0.0, -0.0]))


def test_e4m3_round_every_bf16_value_matches_explicit_quantum_rounding():
    all_bf16 = np.arange(1 << 16, dtype=np.uint16).view(BF16).astype(np.float32)
    finite = all_bf16[np.isfinite(all_bf16) & (np.abs(all_bf16) >= 2.0 ** -126) | (all_bf16 == 0)]
    got = np.asarray(quant.e4m3_round(f32(finite)))
    want = np_e4m3_quantum(finite).astype(np.float32)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mid, want", [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0),
                                       (5.0, 4.0)])
def test_e2m1_round_midpoints_round_half_to_even_code(mid, want):
    got = np.asarray(quant.e2m1_round(f32([mid, -mid])))
    assert_bits_equal(got, np.float32([want, -want]))
    # one float32 ulp either side of the midpoint leaves the tie
    lo, hi = np.nextafter(np.float32(mid), np.float32(0)), np.nextafter(np.float32(mid), np.float32(7))
    grid = E2M1_GRID.astype(np.float32)
    below, above = grid[grid < mid].max(), grid[grid > mid].min()
    np.testing.assert_array_equal(np.asarray(quant.e2m1_round(f32([lo, hi, -lo, -hi]))),
                                  np.float32([below, above, -below, -above]))


def test_e2m1_round_grid_points_are_fixed():
    grid = E2M1_GRID.astype(np.float32)
    np.testing.assert_array_equal(np.asarray(quant.e2m1_round(f32(grid))), grid)
    np.testing.assert_array_equal(np.asarray(quant.e2m1_round(f32(-grid[1:]))), -grid[1:])
    assert_bits_equal(np.asarray(quant.e2m1_round(f32([-0.0, -0.1]))), np.float32([-0.0, -0.0]))


def test_e2m1_round_every_bf16_in_range_matches_grid_search():
    v = np.arange(1 << 16, dtype=np.uint16).view(BF16).astype(np.float32)
    v = v[np.isfinite(v) & (np.abs(v) <= 6)]
    got = np.asarray(quant.e2m1_round(f32(v)))
    assert_bits_equal(got, np_e2m1(v).astype(np.float32))


# ---------------------------------------------------------------------------------------------------------------------
# fq8
# ---------------------------------------------------------------------------------------------------------------------

def test_fq8_all_zero_block_gives_zeros():
    x = np.zeros((2, 64), BF16)
    got = np.asarray(quant.fq8(jnp.asarray(x)))
    assert got.dtype == BF16
    assert_bits_equal(got, x)


def test_fq8_tiny_block_uses_the_1e4_amax_clamp():
    # amax < 1e-4 -> s = 2^ceil(log2(1e-4 / 448)) = 2^ceil(-22.09) = 2^-22 (without the clamp s would be ~2^-28
    # and every value below would be exact)
    s = 2.0 ** -22
    vals = [2.0 ** -20,  # x/s = 4 -> 4
            1.0625 * 2.0 ** -20,  # 4.25: midway 4.0 / 4.5 -> 4.0
            1.1875 * 2.0 ** -20,  # 4.75: midway 4.5 / 5.0 -> 5.0
            -1.1875 * 2.0 ** -20,
            3 * 2.0 ** -32,  # 3 * 2^-10 = 1.5 * 2^-9 (subnormal e4m3 tie) -> 2^-8
            2.0 ** -32]  # 2^-10: half the smallest subnormal -> 0
    want = [4 * s, 4 * s, 5 * s, -5 * s, 2.0 ** -8 * s, 0.0]
    got = np.asarray(quant.fq8(jnp.asarray(block32(vals))))
    assert_bits_equal(got, block32(want))


def test_fq8_block_amax_448_keeps_e4m3_grid_values():
    # amax 448 -> s = 1; the values are e4m3 values already except the ties
    vals = [448.0, 1.0625, 1.1875, 248.0, 432.0, -3.0, 2.0 ** -9, 2.0 ** -10]
    want = [448.0, 1.0, 1.25, 256.0, 448.0, -3.0, 2.0 ** -9, 0.0]
    got = np.asarray(quant.fq8(jnp.asarray(block32(vals))))
    assert_bits_equal(got, block32(want))


def test_fq8_huge_values_do_not_overflow():
    # 2^100 * f32(1/448) is exact, ceil(log2) = ceil(100 - 8.807) = 92 -> s = 2^92, 2^100 / s = 256 (exact)
    vals = [2.0 ** 100, 1e30, 1.0, -2.0 ** 99]
    x = block32(vals)
    got = np.asarray(quant.fq8(jnp.asarray(x))).astype(np.float64)
    assert np.isfinite(got).all()
    assert got[0] == 2.0 ** 100 and got[3] == -2.0 ** 99 and got[2] == 0.0
    x1e30 = float(x[1].astype(np.float64))
    assert abs(got[1] - x1e30) <= x1e30 * 2.0 ** -4  # e4m3: 3 mantissa bits


def test_fq8_blocks_are_independent():
    x = np.concatenate([block32([448.0, 1.0625]), block32([2.0 ** -20, 1.1875 * 2.0 ** -20])])
    got = np.asarray(quant.fq8(jnp.asarray(x[None, :])))[0]
    assert_bits_equal(got, np.concatenate([block32([448.0, 1.0]), block32([2.0 ** -20, 5 * 2.0 ** -22])]))


def test_fq8_rejects_a_partial_block():
    with pytest.raises(ValueError):
        quant.fq8(jnp.zeros((2, 48), jnp.bfloat16))


# ---------------------------------------------------------------------------------------------------------------------
# fq4_pow2 (path A)
# ---------------------------------------------------------------------------------------------------------------------

def test_fq4_pow2_hand_block_scale_one():
    # amax 4 -> 4 * f32(1/6) = 0.667 -> s = 1; each value rounds on the e2m1 grid with even-code ties
    vals = [4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, -2.5, 0.3, -0.75, 1.5, -3.0]
    want = [4.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, -2.0, 0.5, -1.0, 1.5, -3.0]
    got = np.asarray(quant.fq4_pow2(jnp.asarray(block32(vals))))
    assert_bits_equal(got, block32(want))
    # scaled by 2^-10 everything scales exactly (s = 2^-10)
    got = np.asarray(quant.fq4_pow2(jnp.asarray(block32(np.array(vals) * 2.0 ** -10))))
    assert_bits_equal(got, block32(np.array(want) * 2.0 ** -10))


def test_fq4_pow2_amax_5_and_6_and_7():
    # amax 5 -> s = 1, 5 is the 4/6 midpoint -> 4; amax 6 -> s = 1 exactly; amax 7 -> s = 2, 7/2 = 3.5 -> 4 -> 8
    got = np.asarray(quant.fq4_pow2(jnp.asarray(np.stack([block32([5.0, 1.0]), block32([6.0, -5.0]),
                                                            block32([7.0, 5.0, 1.0, 0.5])]))))
    want = np.stack([block32([4.0, 1.0]), block32([6.0, -4.0]), block32([8.0, 4.0, 1.0, 0.0])])
    assert_bits_equal(got, want)


def test_fq4_pow2_all_zero_and_tiny_blocks():
    assert_bits_equal(np.asarray(quant.fq4_pow2(jnp.zeros((1, 32), jnp.bfloat16))), np.zeros((1, 32), BF16))
    # amax clamp 6 * 2^-126 -> s = 2^-126: 2^-125 / s = 2 -> 2, 1.5 * 2^-125 / s = 3 -> 3
    vals = [2.0 ** -125, 1.5 * 2.0 ** -125, -2.0 ** -126]
    got = np.asarray(quant.fq4_pow2(jnp.asarray(block32(vals))))
    assert_bits_equal(got, block32(vals))


def test_fq4_pow2_huge_values():
    # amax 2^120: 2^120 * f32(1/6) -> s = 2^118 (2^120 / 6 = 1.33 * 2^117), 2^120 / s = 4
    vals = [2.0 ** 120, -3 * 2.0 ** 118, 1.0, 1e30]
    got = np.asarray(quant.fq4_pow2(jnp.asarray(block32(vals)))).astype(np.float64)
    assert np.isfinite(got).all()
    assert got[0] == 2.0 ** 120 and got[1] == -3 * 2.0 ** 118 and got[2] == 0.0 and got[3] == 0.0


# ---------------------------------------------------------------------------------------------------------------------
# fq4_e4m3 (path B)
# ---------------------------------------------------------------------------------------------------------------------

def block16(values, fill=0.0):
    row = np.full(16, fill, np.float64)
    row[:len(values)] = values
    return row.astype(BF16)


@pytest.mark.parametrize("s", [1.25, 1.75, 0.5625, 13.0, 0.875 * 2.0 ** -6,
                               1.875, 7.5, 15 * 2.0 ** -9])  # the last three: x * f32(1/s) would miss the ties
def test_fq4_e4m3_ties_on_non_power_of_two_scales(s):
    # amax = 6 s with s an e4m3 value: the scale is exactly s, and x = mid * s divides back to exactly mid
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    codes = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    vals = [6 * s] + [m * s for m in mids] + [-m * s for m in mids]
    x = block16(vals)
    assert np.array_equal(x.astype(np.float64), np.array(vals + [0.0])), "test values must be bf16-exact"
    want = block16([6 * s] + [c * s for c in codes] + [-c * s for c in codes])
    got = np.asarray(quant.fq4_e4m3(jnp.asarray(x)))
    assert_bits_equal(got, want)


def test_fq4_e4m3_scale_is_rounded_to_e4m3_and_values_clipped():
    # amax 6.375 -> 6.375 / 6 = 1.0625 -> e4m3 tie -> s = 1.0; 6.375 / 1 clips to 6 -> 6
    got = np.asarray(quant.fq4_e4m3(jnp.asarray(block16([6.375, -6.375, 1.25, 2.9]))))
    assert_bits_equal(got, block16([6.0, -6.0, 1.0, 3.0]))
    # amax bf16(1e4) = 9984: 9984 / 6 saturates the e4m3 scale at 448; x / 448 clips at 6 -> 6 * 448 = 2688;
    # 700 / 448 = 1.5625 -> 1.5 -> 672
    x = block16([1e4, -1e4, 448.0, 700.0])
    got = np.asarray(quant.fq4_e4m3(jnp.asarray(x)))
    assert_bits_equal(got, block16([2688.0, -2688.0, 448.0, 672.0]))


def test_fq4_e4m3_amax_clamp():
    assert_bits_equal(np.asarray(quant.fq4_e4m3(jnp.zeros((3, 16), jnp.bfloat16))), np.zeros((3, 16), BF16))
    # amax < 6 * 2^-9 -> s = e4m3(2^-9) = 2^-9: 2^-10 / s = 0.5; 3 * 2^-12 / s = 0.375 -> 0.5; 2^-11 -> 0.25 -> 0
    got = np.asarray(quant.fq4_e4m3(jnp.asarray(block16([2.0 ** -10, 3 * 2.0 ** -12, 2.0 ** -11, -2.0 ** -10]))))
    assert_bits_equal(got, block16([2.0 ** -10, 2.0 ** -10, 0.0, -2.0 ** -10]))


def test_fq4_e4m3_uses_blocks_of_16():
    x = np.concatenate([block16([6 * 1.25, 1.25 * 1.25]), block16([6.0, 1.25])])[None]
    got = np.asarray(quant.fq4_e4m3(jnp.asarray(x)))
    assert_bits_equal(got[0], np.concatenate([block16([7.5, 1.25]), block16([6.0, 1.0])]))


# ---------------------------------------------------------------------------------------------------------------------
# property test against the numpy references
# ---------------------------------------------------------------------------------------------------------------------

_MANTISSAS = [0.0, 0.25, 0.5, 0.75, 1.0, 1.0625, 1.125, 1.1875, 1.25, 1.5, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1.9921875]
_tie_heavy = st.builds(lambda m, e, neg: (-m if neg else m) * 2.0 ** e,
                       st.sampled_from(_MANTISSAS), st.integers(-24, 24), st.booleans())
_generic = st.floats(min_value=float(np.float32(-3e38)), max_value=float(np.float32(3e38)), width=32, allow_subnormal=False)
_element = st.one_of(_tie_heavy, _generic, st.floats(-8, 8, width=32, allow_subnormal=False))


def _bf16_array(values):
    x = np.asarray(values, np.float32).astype(BF16).reshape(4, 64)
    # a bf16 rounding of a value just below 2^-126 can land on a subnormal: flush those (CPU XLA flushes denormals)
    x[np.abs(x.astype(np.float32)) < 2.0 ** -126] = 0
    return x


@settings(max_examples=120, deadline=None)
@given(st.lists(_element, min_size=256, max_size=256))
def test_fq8_matches_numpy_reference(values):
    x = _bf16_array(values)
    assert_bits_equal(np.asarray(quant.fq8(jnp.asarray(x))), np_fq8(x))
    # fp32 input holding the same bf16 values gives the same bits
    assert_bits_equal(np.asarray(quant.fq8(jnp.asarray(x.astype(np.float32)))), np_fq8(x))


@settings(max_examples=120, deadline=None)
@given(st.lists(_element, min_size=256, max_size=256))
def test_fq4_pow2_matches_numpy_reference(values):
    x = _bf16_array(values)
    assert_bits_equal(np.asarray(quant.fq4_pow2(jnp.asarray(x))), np_fq4_pow2(x))


# ---------------------------------------------------------------------------------------------------------------------
# ue8m0 scales, fp8 / fp4 weights
# ---------------------------------------------------------------------------------------------------------------------

def test_ue8m0_to_f32():
    e = np.array([0, 1, 126, 127, 128, 200, 254, 255], np.uint8)
    got = np.asarray(quant.ue8m0_to_f32(jnp.asarray(e)))
    assert got.dtype == np.float32
    want = np.float32([2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0, 2.0 ** 73, 2.0 ** 127])
    assert_bits_equal(got[:-1], want)  # 2^-127 is a float32 subnormal and must be exactly that
    assert np.isnan(got[-1])


def _e4m3_values(rng, shape):
    """Random finite e4m3 values (every finite bit pattern is reachable)."""
    codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # NaN patterns -> some finite code
    return codes.view(E4M3)


def test_dequant_fp8_weight_tiles_and_ragged_out_dim():
    rng = np.random.default_rng(0)
    out_dim, in_dim = 40, 64  # out is not a multiple of 32: the second tile row is partial
    w = _e4m3_values(rng, (out_dim, in_dim))
    scale = rng.integers(118, 136, size=(2, 2), dtype=np.uint8)
    got = np.asarray(quant.dequant_fp8_weight(jnp.asarray(w), jnp.asarray(scale)))
    assert got.dtype == BF16 and got.shape == (out_dim, in_dim)
    want = np.empty((out_dim, in_dim), np.float64)
    for r in range(out_dim):
        for c in range(in_dim):
            want[r, c] = np.ldexp(float(w[r, c]), int(scale[r // 32, c // 32]) - 127)
    assert_bits_equal(got, want.astype(BF16))  # exact: <= 4 significant bits


def _fp4_decode(code):
    """e2m1 4-bit code: bit 3 sign, bits 2..1 exponent, bit 0 mantissa (bias 1, exponent 0 subnormal)."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    mag = 0.5 * man if exp == 0 else 2.0 ** (exp - 1) * (1 + 0.5 * man)
    return np.copysign(mag, sign)


@pytest.mark.parametrize("byte, want", [
    (0x21, [0.5, 1.0]),  # low nibble 1 -> 0.5 (even element), high nibble 2 -> 1.0
    (0x41, [0.5, 2.0]),  # code 4 -> 2.0
    (0x9A, [-1.0, -0.5]),  # low 0xA = sign | 2 -> -1.0, high 0x9 = sign | 1 -> -0.5
    (0x7F, [-6.0, 6.0]),
    (0x65, [3.0, 4.0]),
    (0xB3, [1.5, -1.5]),
    (0x00, [0.0, 0.0]),
    (0x80, [0.0, -0.0]),
])
def test_unpack_fp4_hand_bytes(byte, want):
    got = np.asarray(quant.unpack_fp4(jnp.asarray(np.array([[byte]], np.uint8))))
    assert got.shape == (1, 2) and got.dtype == np.float32
    assert_bits_equal(got[0], np.float32(want))


def test_unpack_fp4_all_bytes_and_shape():
    packed = np.arange(256, dtype=np.uint8).reshape(2, 4, 32)
    got = np.asarray(quant.unpack_fp4(jnp.asarray(packed)))
    assert got.shape == (2, 4, 64)
    want = np.empty((2, 4, 64), np.float32)
    for idx in np.ndindex(packed.shape):
        b = int(packed[idx])
        want[idx[:-1] + (2 * idx[-1],)] = _fp4_decode(b & 0xF)
        want[idx[:-1] + (2 * idx[-1] + 1,)] = _fp4_decode(b >> 4)
    assert_bits_equal(got, want)


def test_dequant_fp4_weight_matches_manual_decode():
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, size=(2, 3, 32), dtype=np.uint8)  # [batch, out, in/2], in = 64
    scale = rng.integers(110, 140, size=(2, 3, 2), dtype=np.uint8)  # [batch, out, in/32]
    got = np.asarray(quant.dequant_fp4_weight(jnp.asarray(packed), jnp.asarray(scale)))
    assert got.dtype == BF16 and got.shape == (2, 3, 64)
    want = np.empty((2, 3, 64), np.float64)
    for b, o, k in np.ndindex(2, 3, 64):
        byte = int(packed[b, o, k // 2])
        code = byte & 0xF if k % 2 == 0 else byte >> 4
        want[b, o, k] = np.ldexp(_fp4_decode(code), int(scale[b, o, k // 32]) - 127)
    assert_bits_equal(got, want.astype(BF16))


def test_fp4_round_trip_quantise_pack_dequant():
    # fq4_pow2 output, re-encoded by hand as codes + ue8m0 scales, decodes back bit for bit
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 64)) * 2.0 ** rng.integers(-8, 8, size=(3, 2)).repeat(32, axis=1)).astype(BF16)
    q = np.asarray(quant.fq4_pow2(jnp.asarray(x))).astype(np.float64)
    xf = x.astype(np.float32).reshape(3, 2, 32)
    s = np_pow2_scale(np.maximum(np.abs(xf).max(-1), np.float32(6 * 2.0 ** -126)), np.float32(1 / 6))  # [3, 2]
    v = q.reshape(3, 2, 32) / s[..., None]
    codes = np.abs(v)[..., None] == E2M1_GRID
    assert codes.sum(-1).min() == 1, "fq4 output is not an e2m1 value times the block scale"
    code = np.argmax(codes, -1) | np.where(np.signbit(v), 8, 0)
    code = code.reshape(3, 64).astype(np.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    scale_u8 = (np.log2(s).astype(np.int64) + 127).astype(np.uint8)
    back = np.asarray(quant.dequant_fp4_weight(jnp.asarray(packed), jnp.asarray(scale_u8)))
    assert_bits_equal(back, q.astype(BF16))
