"""The sampler's top-k / top-p thresholds kernel (dijax.kernels.sample_filter) compiled for the GPU (Triton
lowering), against the XLA reference on the same GPU at V4.1's vocabulary, and the sampler's draws with it against
the XLA select's. Run on the device: ``PYTHONPATH=. python3 -m pytest -q tests/gpu``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dijax.kernels import sample_filter as sf
from dijax.runtime import sampler
from tests.test_kernels_sample_filter import filter_rows

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="compiles the Pallas kernel for a GPU (the CPU tests run it interpreted)")
VOCAB = 129_280


@pytest.mark.parametrize("config", [sf.CONFIG, sf.FilterConfig(bits=4), sf.FilterConfig(block=1024, num_warps=4),
                                    sf.FilterConfig(block=2048, num_warps=8, prefetch=False),
                                    sf.FilterConfig(prefetch=False)],
                         ids=["default", "4_bits", "block_1024", "block_2048_no_prefetch", "no_prefetch"])
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_kernel_thresholds_match_the_reference_on_the_gpu(rows, config):
    scaled, top_k, top_p = (jnp.asarray(a) for a in filter_rows(rows, VOCAB, seed=rows))
    top_k = jnp.where(top_k > VOCAB, top_k, top_k % 4096)  # top-k small enough to bite, besides off / above V
    want = np.asarray(jax.jit(sf.thresholds_reference)(scaled, top_k, top_p))
    got = np.asarray(jax.jit(lambda *a: sf.thresholds_pallas(*a, config=config))(scaled, top_k, top_p))
    np.testing.assert_array_equal(got, want)


def test_the_sampler_draws_the_same_tokens_with_the_kernel():
    rng = np.random.default_rng(5)
    rows = 32
    logits = jnp.asarray(rng.normal(0, 3, (rows, VOCAB)).astype(np.float32))
    columns = (jnp.full(rows, 0.8, jnp.float32), jnp.asarray(rng.integers(0, 64, rows), jnp.int32),
               jnp.full(rows, 0.95, jnp.float32), jnp.zeros(rows, jnp.uint32),
               jnp.asarray(rng.integers(0, 2**32, rows, dtype=np.uint64).astype(np.uint32)),
               jnp.arange(rows, dtype=jnp.int32))
    select, kernel = (np.asarray(sampler.sample(logits, *columns, mode="sample", top_filter=name))
                      for name in ("select", "pallas"))
    np.testing.assert_array_equal(kernel, select)
