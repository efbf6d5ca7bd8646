"""dijax.kernels.numerics: divisions and means that keep a true division's rounding under jit (on the CPU, where
XLA's division is IEEE-rounded), where XLA would otherwise multiply by a reciprocal."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dijax.kernels.numerics import divide, mean


def _bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.int32)


def _operands(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [64, 48], y float32 [64, 1]: ratios where ``x * (1 / y)`` rounds differently from ``x / y``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, 48)).astype(np.float32) * np.float32(3)
    y = (rng.random((64, 1)).astype(np.float32) * np.float32(7) + np.float32(0.1))
    return x, y


def test_divide_by_a_broadcast_row_is_a_true_division_under_jit():
    x, y = _operands(0)
    want = x / y  # numpy: IEEE division, element by element
    reciprocal_product = x * (np.float32(1) / y)
    assert (_bits(reciprocal_product) != _bits(want)).any(), "the operands must tell the two roundings apart"
    got = jax.jit(divide)(jnp.asarray(x), jnp.asarray(y))
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_divide_by_a_python_scalar_is_a_true_division_under_jit():
    x, _ = _operands(1)
    want = x / np.float32(3.0)
    assert (_bits(x * (np.float32(1) / np.float32(3.0))) != _bits(want)).any()
    got = jax.jit(lambda v: divide(v, 3.0))(jnp.asarray(x))
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_divide_keeps_ieee_special_values():
    x = np.array([[np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, 1.0, np.nan]], np.float32)
    y = np.array([[2.0, np.inf, 2.0, 0.0, 5.0, 0.0, np.nan, 0.0]], np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        want = x / y
    got = np.asarray(jax.jit(divide)(jnp.asarray(x), jnp.asarray(y)))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(_bits(got[finite]), _bits(want[finite]))


def test_divide_takes_the_dividends_shape_and_dtype():
    x = jnp.ones((3, 5), jnp.bfloat16)
    out = divide(x, jnp.full((3, 1), 4.0, jnp.float32))
    assert out.shape == (3, 5) and out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.full((3, 5), 0.25, np.float32))


def test_mean_is_the_sum_divided_by_the_count():
    x, _ = _operands(2)
    x = x[:, :45]  # a count whose reciprocal is inexact
    total = np.asarray(jax.jit(lambda v: jnp.sum(v, axis=-1, keepdims=True))(jnp.asarray(x)))
    got = jax.jit(mean)(jnp.asarray(x))
    assert got.shape == (64, 1)
    np.testing.assert_array_equal(_bits(got), _bits(total / np.float32(45)))
