"""The latents kernel compiled for the GPU (Triton lowering): against the jnp reference run by XLA on the same GPU,
at the tiny default's and V4.1-Flash's widths. Where every sum of squares is exact the query latent and the KV
row's unrotated columns must be the reference's bits; the rotated pairs may differ by a bf16 rounding of the
rotation (Triton and XLA may contract a product and a sum into an FMA differently), which the fp8 step can turn
into one e4m3 step; the counts are printed. Run on the device: ``PYTHONPATH=. python3 -m pytest -q tests/gpu``."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dijax.kernels import latents, quant
from tests.test_kernels_latents import EPS, FREQS, _inputs
from tests.test_quant import fq8_step

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="compiles the Pallas kernel for a GPU (the CPU tests run it interpreted)")


def _run(t, q, k, exact, config=latents.LatentsConfig(poison=True)):
    qkva, q_width, qw, kvw, pos = _inputs(t, q, k, seed=t + q + k, exact=exact)
    got = jax.jit(lambda x, *a: latents.latents_pallas(x, q_width, *a, FREQS, EPS, config=config))(qkva, qw, kvw,
                                                                                                   pos)
    want = jax.jit(lambda x, *a: latents.latents_reference(x, q_width, *a, FREQS, EPS))(qkva, qw, kvw, pos)
    return [np.asarray(x, np.float32) for x in (*got, *want)]


@pytest.mark.parametrize("t, q, k", [(1, 64, 64), (8, 64, 64), (19, 64, 64), (1, 1280, 512), (64, 1280, 512),
                                     (200, 1280, 512)])
def test_exact_sums_give_the_references_bits(t, q, k):
    qr, kv, qr_want, kv_want = _run(t, q, k, exact=True)
    rotated = 2 * len(FREQS)
    tail = kv[:, -rotated:] != kv_want[:, -rotated:]
    print(f"t={t} q={q} k={k}: rotated values off the reference {tail.sum()} of {tail.size}")
    np.testing.assert_array_equal(qr, qr_want)
    blocks_with_tail = k - quant.FP8_BLOCK * -(-rotated // quant.FP8_BLOCK)
    np.testing.assert_array_equal(kv[:, :blocks_with_tail], kv_want[:, :blocks_with_tail])
    assert (np.abs(kv - kv_want) <= fq8_step(kv_want)).all()


@pytest.mark.parametrize("t, config", [(64, latents.LatentsConfig(poison=True)),
                                       (37, latents.LatentsConfig(block_tokens=4, warps=2, poison=True))])
def test_random_rows_within_a_rounding_step(t, config):
    qr, kv, qr_want, kv_want = _run(t, 1280, 512, exact=False, config=config)
    print(f"t={t}: query latents off {(qr != qr_want).sum()} of {qr.size}, KV values off {(kv != kv_want).sum()} "
          f"of {kv.size}")
    np.testing.assert_allclose(qr, qr_want, rtol=2 ** -7, atol=0)
    assert (np.abs(kv - kv_want) <= fq8_step(kv_want)).all()
    assert (qr == qr_want).mean() > 0.99 and (kv == kv_want).mean() > 0.99
