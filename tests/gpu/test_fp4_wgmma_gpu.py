"""The Mosaic GPU MXFP4 grouped GEMM (dijax.kernels.fp4_wgmma) on a Hopper GPU against its reference.

Only tiles with an expert are compared (the kernel leaves the others unwritten). The same exact products summed in
another order (tensor-core partial sums), each rounded to bf16: within a bf16 ulp plus 2^-16 of the sum of
|products|, as the fp8 linear's test bounds it. Run on the device: ``PYTHONPATH=. python3 -m pytest -q tests/gpu``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dijax.kernels import fp4_wgmma as fw
from dijax.kernels import quant
from dijax.kernels.routed_experts import fit_tiles, pack_words
from tests.test_kernels_fp4_wgmma import fixed_tiles

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu" or "H" not in jax.devices()[0].device_kind,
                                reason="a Mosaic GPU wgmma kernel: needs a Hopper GPU")


@pytest.mark.parametrize("n_experts, f, k, tile_n, tiles, stages, chunks, scales, wgs", [
    (3, 256, 512, 128, (0, 2, -1, 1), 4, 2, (116, 128), 2),       # small, a padding tile between experts
    (2, 4608, 5120, 128, (1, 0, 0, -1, -1), 4, 2, (100, 160), 2),  # the real gate-up width, the top of SCALE_RANGE
    (2, 5120, 2304, 64, (0, 1, 1), 2, 1, (34, 60), 2),            # the real down projection, its bottom
    (1, 128, 256, 256, (0,), 3, 2, (116, 128), 2),
    (1, 256, 256, 8, (0, 0), 4, 1, (116, 128), 2),                # the smallest wgmma N
    (2, 2304, 5120, 8, (1, -1, 0), 8, 2, (100, 160), 1),          # decode: one compute warpgroup, deep pipeline
    (1, 64, 256, 16, (0,), 4, 1, (116, 128), 1),
    (2, 4608, 5120, 128, (1, 0, -1, 1), "overlap", 2, (100, 160), 2),  # the last wgmma running into the next step
    (2, 5120, 2304, 16, (0, 1, 1), "overlap", 1, (34, 60), 2),    # ... with one K chunk a step
])
def test_kernel_matches_reference(n_experts, f, k, tile_n, tiles, stages, chunks, scales, wgs):
    rng = np.random.default_rng(f + k)
    w = pack_words(jnp.asarray(rng.integers(0, 256, (n_experts, f, k // 2)), jnp.uint8))
    s = jnp.asarray(rng.integers(*scales, (n_experts, f, k // 32)), jnp.uint8)
    x = quant.fq8(jnp.asarray(rng.standard_normal((len(tiles) * tile_n, k)), jnp.float32)).astype(jnp.bfloat16)
    tiles_I3 = jnp.asarray(fixed_tiles(tiles, tile_n))
    overlap = stages == "overlap"
    kw = dict(sizes=(tile_n,), stages=3 if overlap else stages, chunks=chunks, warpgroups=wgs, overlap=overlap)
    got = np.asarray(fw.grouped_gemm_t_mgpu(w, s, x, tiles_I3, **kw), np.float32)
    rows = jnp.asarray(rng.permutation(x.shape[0]), jnp.int32)  # the gathered form: the same rows, reordered
    gathered = fw.grouped_gemm_t_mgpu(w, s, x, tiles_I3, rows, **kw)
    written = np.repeat(np.asarray(tiles) >= 0, tile_n)  # padding tiles' rows are left unwritten by both calls
    np.testing.assert_array_equal(np.asarray(gathered, np.float32)[written],
                                  np.asarray(fw.grouped_gemm_t_mgpu(w, s, x[rows], tiles_I3, **kw), np.float32)[written])
    want = np.asarray(fw.grouped_gemm_t_reference(w, s, x, tiles_I3, sizes=(tile_n,)), np.float32)
    w_u8 = jax.lax.bitcast_convert_type(w, jnp.uint8).reshape(*w.shape[:-1], -1)
    wd = np.abs(np.asarray(quant.dequant_fp4_weight(w_u8, s), np.float32))
    xa = np.abs(np.asarray(x, np.float32))
    for i, e in enumerate(tiles):
        if e < 0:
            continue
        rows = slice(i * tile_n, (i + 1) * tile_n)
        bound = np.abs(want[rows]) * np.float32(2.0 ** -7) + (xa[rows] @ wd[e].T) * np.float32(2.0 ** -16)
        err = np.abs(got[rows] - want[rows])
        assert np.all(err <= bound), (i, float(np.max(err / bound)))
        assert np.mean(got[rows] == want[rows]) >= 0.9


def test_fitted_tiles_match_reference():
    """fit_tiles' mixed sizes (256-row tiles, then 64 / 128 / 192) on a ragged routing of 8 experts."""
    rng = np.random.default_rng(7)
    n_experts, f, k, tokens, per_token = 8, 256, 512, 300, 4
    expert_A = jnp.asarray(np.stack([rng.choice(n_experts, per_token, replace=False) for _ in range(tokens)]),
                           jnp.int32).reshape(-1)
    sizes = (64, 128, 192, 256)
    tiles_I3, token_R, _, _ = fit_tiles(expert_A, n_experts, per_token, sizes)
    w = pack_words(jnp.asarray(rng.integers(0, 256, (n_experts, f, k // 2)), jnp.uint8))
    s = jnp.asarray(rng.integers(116, 128, (n_experts, f, k // 32)), jnp.uint8)
    x = quant.fq8(jnp.asarray(rng.standard_normal((tokens, k)), jnp.float32)).astype(jnp.bfloat16)
    got = np.asarray(fw.grouped_gemm_t_mgpu(w, s, x, tiles_I3, token_R, sizes=sizes), np.float32)
    want = np.asarray(fw.grouped_gemm_t_reference(w, s, x, tiles_I3, token_R, sizes=sizes), np.float32)
    covered = np.zeros(got.shape[0], bool)
    for e, r, n in np.asarray(tiles_I3):
        if e >= 0:
            covered[r:r + n] = True
    np.testing.assert_allclose(got[covered], want[covered], rtol=2 ** -7, atol=1e-3 * np.abs(want).max())
    assert np.mean(got[covered] == want[covered]) >= 0.9
