"""tools/stream_probe.py: its two layouts' kernels (interpreted on the CPU) XOR the same words numpy does, and the
tiled layout holds each step's tile contiguously."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tools import stream_probe as sp


@pytest.mark.parametrize("warpgroups", [1, 2])
def test_both_layouts_stream_every_word(warpgroups):
    w = np.random.default_rng(warpgroups).integers(0, 2 ** 32, (256, 48), dtype=np.uint32)
    want = sp.reference(w, warpgroups)
    for layout in sp.LAYOUTS:
        data = jnp.asarray(w) if layout == "rows" else sp.tiled(jnp.asarray(w), warpgroups)
        got = sp.stream(data, layout=layout, stages=2, warpgroups=warpgroups, interpret=True)
        np.testing.assert_array_equal(np.asarray(got), want)


def test_a_step_tile_is_contiguous_in_the_tiled_layout():
    w = np.arange(256 * 32, dtype=np.uint32).reshape(256, 32)
    t = np.asarray(sp.tiled(jnp.asarray(w), 2))
    assert t.shape == (2, 2, 128, 16)
    np.testing.assert_array_equal(t[1, 1], w[128:256, 16:32])
    with pytest.raises(ValueError, match="layout must be one of"):
        sp.stream(jnp.asarray(w), layout="columns", interpret=True)
