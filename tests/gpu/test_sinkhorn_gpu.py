"""The Sinkhorn Pallas kernel compiled for the GPU (Triton lowering, inline ``div.rn.f32``) against the jnp reference
on the same GPU. Not run yet (the session that wrote it had no device time left): run on the device with
``PYTHONPATH=. python3 -m pytest -q tests/gpu``."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dijax.kernels.sinkhorn import BLOCK_T, sinkhorn_pallas, sinkhorn_reference
from tests.test_kernels_sinkhorn import _comb, assert_ulps

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="compiles the Pallas kernel for a GPU (the CPU tests run it interpreted)")


@pytest.mark.parametrize("t, c, rounds", [(1, 4, 19), (7, 4, 19), (BLOCK_T + 5, 4, 19), (3 * BLOCK_T, 2, 5)])
def test_kernel_matches_reference(t, c, rounds):
    comb = _comb(t, c, seed=t)
    got = np.asarray(jax.jit(lambda x: sinkhorn_pallas(x, rounds, 1e-6))(comb))
    want = np.asarray(jax.jit(lambda x: sinkhorn_reference(x, rounds, 1e-6))(comb))
    assert np.isfinite(got).all()
    assert_ulps(got, want, 4)
