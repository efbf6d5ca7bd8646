"""The Sinkhorn Pallas kernel compiled for the GPU (Triton lowering; inline ``div.rn.f32``, or with ``fast_divide``
its fast path and the exact division for blocks outside its range) against a numpy float32 oracle (IEEE division,
sums left to right: the reference's arithmetic, computed on the host) and against the jnp reference compiled by XLA
for the same GPU. Run on the device: ``PYTHONPATH=. python3 -m pytest -q tests/gpu``."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dijax.kernels.sinkhorn import BLOCK_T, sinkhorn_pallas, sinkhorn_reference
from tests.test_kernels_sinkhorn import EXACT, FAST, _comb, assert_ulps

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


@pytest.mark.parametrize("config", [EXACT, FAST], ids=["exact", "fast_divide"])
@pytest.mark.parametrize("t, c, rounds", [(1, 4, 19), (7, 4, 19), (BLOCK_T + 5, 4, 19), (3 * BLOCK_T, 2, 5)])
def test_kernel_matches_oracle(t, c, rounds, config):
    comb = _comb(t, c, seed=t)
    oracle = sinkhorn_numpy(np.asarray(comb), rounds, 1e-6)
    got = np.asarray(jax.jit(lambda x: sinkhorn_pallas(x, rounds, 1e-6, config=config))(comb))
    want = np.asarray(jax.jit(lambda x: sinkhorn_reference(x, rounds, 1e-6))(comb))
    assert np.isfinite(got).all()
    ulps = lambda a: int(np.abs(a.view(np.int32).astype(np.int64) - oracle.view(np.int32).astype(np.int64)).max())
    print(f"t={t} c={c} rounds={rounds} {config}: ulps from the numpy oracle: pallas {ulps(got)}, "
          f"xla reference {ulps(want)}")
    assert_ulps(got, oracle, 0)


@pytest.mark.parametrize("value", [1e-30, 1e-44, 1e30])
def test_blocks_outside_the_fast_range_match_the_oracle(value):
    """With ``fast_divide``, entries far below or above the fast path's range (a denormal among them) send their
    block down the exact path: the oracle's bits there, and in the other blocks."""
    comb = np.array(_comb(2 * BLOCK_T, 4, seed=11))
    comb[BLOCK_T + 3, 1, 2] = value
    oracle = sinkhorn_numpy(comb, 19, 1e-6)
    got = np.asarray(jax.jit(lambda x: sinkhorn_pallas(x, 19, 1e-6, config=FAST))(comb))
    assert_ulps(got, oracle, 0)
