"""The staging copy on the GPU: exact, and in a compiled step the staged argument has the copy as its only reader
(what keeps the step's CUDA graphs from being updated when the argument's buffer moves). Run on the device:
``PYTHONPATH=. python3 -m pytest -q tests/gpu``."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dijax.kernels.staging import BLOCK, stage

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiles the Pallas copy for a GPU")


@pytest.mark.parametrize("n", [8, BLOCK, 40 * BLOCK])
def test_copy_is_exact(n):
    x = np.random.default_rng(n).integers(-2**31, 2**31 - 1, n).astype(np.int32)
    assert np.array_equal(np.asarray(jax.jit(lambda v: stage(v, impl="pallas"))(x)), x)


def test_argument_read_only_through_the_copy():
    def step(x_N, y_N):
        staged = stage(x_N, impl="pallas")
        a = jnp.cumsum(staged[:BLOCK] * y_N[:BLOCK])  # several consumers that XLA would otherwise fuse the read into
        b = jnp.sort(staged[BLOCK:])
        return a, b, staged[::7] + 1

    x = np.arange(4 * BLOCK, dtype=np.int32)
    text = jax.jit(step).lower(x, x).compile().as_text()
    entry = text[text.index("ENTRY"):]
    [param] = re.findall(r"(\S+) = s32\[512\]\{0\} parameter\(0\)", entry)
    readers = [line for line in entry.splitlines() if re.search(rf"[(, ]{re.escape(param)}[,)]", line)
               and "parameter(0)" not in line]
    assert len(readers) == 1 and "custom-call" in readers[0], readers
