"""The Sinkhorn Pallas kernel compiled for the GPU (Triton lowering, inline ``div.rn.f32``) against a numpy float32
oracle (IEEE division, sums left to right: the reference's arithmetic, computed on the host) and against the jnp
reference compiled by XLA for the same GPU. Run on the device: ``PYTHONPATH=. python3 -m pytest -q tests/gpu``."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dijax.kernels.sinkhorn import BLOCK_T, sinkhorn_pallas, sinkhorn_reference
from tests.test_kernels_sinkhorn import _comb, assert_ulps

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="compiles the Pallas kernel for a GPU (the CPU tests run it interpreted)")


def sinkhorn_numpy(comb_TCC: np.ndarray, rounds: int, eps: float) -> np.ndarray:
    """The oracle: numpy float32 arithmetic (each operation correctly rounded), sums strictly left to right."""
    m = np.array(comb_TCC, np.float32)
    eps = np.float32(eps)
    c = m.shape[-1]
    for _ in range(rounds):
        row = m[..., 0:1]
        for j in range(1, c):
            row = row + m[..., j:j + 1]
        m = m / (row + eps)
        column = m[..., 0:1, :]
        for i in range(1, c):
            column = column + m[..., i:i + 1, :]
        m = m / (column + eps)
    return m


@pytest.mark.parametrize("t, c, rounds", [(1, 4, 19), (7, 4, 19), (BLOCK_T + 5, 4, 19), (3 * BLOCK_T, 2, 5)])
def test_kernel_matches_oracle(t, c, rounds):
    comb = _comb(t, c, seed=t)
    oracle = sinkhorn_numpy(np.asarray(comb), rounds, 1e-6)
    got = np.asarray(jax.jit(lambda x: sinkhorn_pallas(x, rounds, 1e-6))(comb))
    want = np.asarray(jax.jit(lambda x: sinkhorn_reference(x, rounds, 1e-6))(comb))
    assert np.isfinite(got).all()
    ulps = lambda a: int(np.abs(a.view(np.int32).astype(np.int64) - oracle.view(np.int32).astype(np.int64)).max())
    print(f"t={t} c={c} rounds={rounds}: ulps from the numpy oracle: pallas {ulps(got)}, xla reference {ulps(want)}")
    assert_ulps(got, oracle, 0)
