"""The sampler's top-k / top-p thresholds (dijax.kernels.sample_filter): the Triton-lowered kernel, interpreted,
against the XLA reference (the same thresholds, bit for bit, on rows whose masses do not land within rounding of
top_p), with blocks that do not divide the row, every digit width, and filters off; bad configurations named."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dijax.kernels import sample_filter as sf

pytestmark = pytest.mark.cost(20)  # CI seconds, a scheduling hint (tests/conftest.py)


def filter_rows(rows: int, width: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scaled logits [rows, width] with heavy tails and ties (-0.0 beside +0.0 among them), and per-row top_k /
    top_p covering off (0, 1.0), 1, above the vocabulary and a top_p below float32's resolution."""
    rng = np.random.default_rng(seed)
    scaled = (rng.standard_t(3, (rows, width)) * rng.uniform(0.3, 4)).astype(np.float32)
    scaled[::2, :width // 4] = np.round(scaled[::2, :width // 4])
    top_k = rng.integers(0, width + 3, rows).astype(np.int32)
    top_k[::4] = 0
    top_k[1 % rows] = 1
    top_p = rng.uniform(0, 1, rows).astype(np.float32)
    top_p[::3] = 1.0
    top_p[2 % rows] = 1e-9
    return scaled, top_k, top_p


@pytest.mark.parametrize("config", [sf.FilterConfig(block=64), sf.FilterConfig(block=16, bits=4, prefetch=True),
                                    sf.FilterConfig(block=256, bits=1)], ids=["2_bits", "4_bits_prefetch", "1_bit"])
@pytest.mark.parametrize("rows, width", [(8, 40), (5, 300), (3, 1000)])
def test_kernel_thresholds_match_the_reference(config, rows, width):
    scaled, top_k, top_p = (jnp.asarray(a) for a in filter_rows(rows, width, seed=rows + width))
    want = np.asarray(sf.thresholds_reference(scaled, top_k, top_p))
    got = np.asarray(sf.thresholds_pallas(scaled, top_k, top_p, config=config, interpret=True))
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.uint32


def test_thresholds_keep_what_they_name():
    """A row keeps exactly the entries whose key is at or above its threshold: top_k alone keeps k entries of
    distinct values, top_p alone the smallest prefix of the sorted row whose mass reaches it, both off keep all."""
    scaled = jnp.asarray([[3.0, 1.0, 2.0, 0.5, -1.0, 2.5]], jnp.float32)
    keys = np.asarray(sf.filter_keys(scaled))[0]
    for impl in sf.IMPLS:
        def kept(k, p):
            thr = np.asarray(sf.thresholds(scaled, jnp.asarray([k], jnp.int32), jnp.asarray([p], jnp.float32),
                                           impl=impl))[0]
            return sorted(np.asarray(scaled)[0][keys >= thr].tolist(), reverse=True)

        assert kept(3, 1.0) == [3.0, 2.5, 2.0]
        assert kept(0, 1.0) == kept(9, 1.0) == sorted(np.asarray(scaled)[0].tolist(), reverse=True)
        probs = np.exp(np.sort(np.asarray(scaled)[0])[::-1] - 3.0)
        probs /= probs.sum()
        assert kept(0, float(probs[0]) + 1e-3) == [3.0, 2.5]  # the first alone falls just short
        assert kept(0, 1e-9) == [3.0]
        assert kept(2, 0.99) == [3.0, 2.5]


def test_no_rows_and_bad_settings():
    empty = sf.thresholds_pallas(jnp.zeros((0, 16)), jnp.zeros((0,), jnp.int32), jnp.zeros((0,)), interpret=True)
    assert empty.shape == (0,) and empty.dtype == jnp.uint32
    with pytest.raises(ValueError, match="FilterConfig.block must be a power of two >= 16, got 48"):
        sf.FilterConfig(block=48)
    with pytest.raises(ValueError, match="FilterConfig.bits must be 1, 2 or 4, got 8"):
        sf.FilterConfig(bits=8)
    with pytest.raises(ValueError, match=r"impl must be one of \('reference', 'pallas'\), got 'sort'"):
        sf.thresholds(jnp.zeros((1, 4)), jnp.zeros((1,), jnp.int32), jnp.ones((1,)), impl="sort")
