"""The collapse-and-norm kernel compiled for the GPU (Triton lowering): against the jnp reference run by XLA on the
same GPU, at the tiny default's and V4.1-Flash's widths, outputs poisoned. The sums of squares run in another order
than XLA's, and Triton and XLA may contract the weighted stream sum into FMAs differently, so a value may differ by
one bf16 ulp and its fq8 by one e4m3 step of its block; the counts are printed. Run on the device:
``PYTHONPATH=. python3 -m pytest -q tests/gpu``. (Fortieth session, H100: the same cases run as a script all passed,
at most one value of a row block off by one ulp.)"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dijax.kernels import collapse
from tests.test_kernels_collapse import EPS, _inputs
from tests.test_quant import fq8_step

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="compiles the Pallas kernel for a GPU (the CPU tests run it interpreted)")


@pytest.mark.parametrize("t, d", [(1, 256), (3, 256), (8, 256), (5, 4096), (16, 4096), (13, 7168)])
@pytest.mark.parametrize("quantized", [False, True])
def test_kernel_is_the_reference_to_a_rounding_step(t, d, quantized):
    x, pre, weight = _inputs(t, 4, d, seed=t + d, exact=False)
    config = collapse.CollapseConfig(poison=True)
    got = jax.jit(lambda *a: collapse.collapse_norm_pallas(*a, EPS, quantized, config=config))(x, pre, weight)
    want = jax.jit(lambda *a: collapse.collapse_norm_reference(*a, EPS, quantized))(x, pre, weight)
    got, want = (got, want) if quantized else ((got,), (want,))
    y, y_want = np.asarray(got[0], np.float32), np.asarray(want[0], np.float32)
    print(f"t={t} d={d}: normed values off the reference {(y != y_want).sum()} of {y.size}")
    np.testing.assert_allclose(y, y_want, rtol=2 ** -7, atol=0)
    assert (y == y_want).mean() > 0.99
    if quantized:
        act, act_want = np.asarray(got[1], np.float32), np.asarray(want[1], np.float32)
        assert (np.abs(act - act_want) <= fq8_step(act_want)).all() and (act == act_want).mean() > 0.99


def test_exact_sums_give_the_references_bits():
    x, pre, weight = _inputs(16, 4, 4096, seed=1, exact=True)
    got = jax.jit(lambda *a: collapse.collapse_norm_pallas(*a, EPS, True))(x, pre, weight)
    want = jax.jit(lambda *a: collapse.collapse_norm_reference(*a, EPS, True))(x, pre, weight)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
