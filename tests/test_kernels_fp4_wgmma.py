"""The Mosaic GPU MXFP4 grouped GEMM's semantics on the CPU (dijax.kernels.fp4_wgmma).

The kernel needs a Hopper GPU (tests/gpu/test_fp4_wgmma_gpu.py runs it). Here: the reference against a numpy oracle,
and the kernel's index algebra emulated in numpy: each thread's natural-layout words decoded nibble by nibble into
the fragment positions the kernel gives them, against ``permute_k``'s activations, must reproduce the reference's
sums exactly (the products are exact in float32 and every sum here is of exact small integers times powers of two).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dijax.kernels import fp4_wgmma as fw
from dijax.kernels import quant
from dijax.kernels.routed_experts import GEMM_SCALE_RANGE, fit_tiles, pack_words


def fixed_tiles(experts, tile_n):
    """tiles_I3 of equal tiles: tile i is rows [i * tile_n, (i + 1) * tile_n) of expert ``experts[i]``."""
    return np.array([(e, i * tile_n, tile_n if e >= 0 else 0) for i, e in enumerate(experts)], np.int32)


def _operands(n_experts=3, f=128, k=256, tile_n=8, tiles=(0, 2, -1, 1), seed=0):
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 256, (n_experts, f, k // 2)).astype(np.uint8)
    s = rng.integers(120, 126, (n_experts, f, k // 32)).astype(np.uint8)
    x = rng.integers(-4, 5, (len(tiles) * tile_n, k)).astype(np.float32)  # exact in bf16, exact sums
    return w, s, x, fixed_tiles(tiles, tile_n)


def _dequant(w, s):
    codes = np.stack([w & 15, w >> 4], axis=-1).reshape(*w.shape[:-1], -1)
    return quant.FP4_TABLE[codes] * np.repeat(np.exp2(s.astype(np.float32) - 127), 32, axis=-1)


def test_reference_matches_numpy():
    w, s, x, tiles = _operands()
    want = np.zeros((x.shape[0], w.shape[1]), np.float32)
    for e, r, n in tiles:
        if e >= 0:
            want[r:r + n] = x[r:r + n] @ _dequant(w[e], s[e]).T
    got = fw.grouped_gemm_t_reference(pack_words(jnp.asarray(w)), jnp.asarray(s), jnp.asarray(x, jnp.bfloat16),
                                      jnp.asarray(tiles), sizes=(8,))
    np.testing.assert_array_equal(np.asarray(got, np.float32), want.astype(jnp.bfloat16).astype(np.float32))


def test_fragment_order_reproduces_the_reference():
    """Emulate one K step of one warpgroup for every chunk: thread (row, lane q) holds words 2q + h of the chunk;
    nibble j + 4e of word 2q + h sits at fragment column 16j + 8h + 2q + e, scaled by the lane's block (q // 2)."""
    w, s, x, _ = _operands(n_experts=1, f=64, k=256, tiles=(0,))
    words = np.asarray(pack_words(jnp.asarray(w[0])))  # [F, K/8]: nibble j of word w is code 8w + j
    xp = np.asarray(fw.permute_k(jnp.asarray(x)))
    got = np.zeros((64, x.shape[0]), np.float32)
    for t in range(x.shape[1] // 64):
        for q in range(4):
            scale = np.exp2(s[0, :, 2 * t + q // 2].astype(np.float32) - 127)
            for h in range(2):
                word = words[:, 8 * t + 2 * q + h]
                for j in range(4):
                    for e in range(2):
                        code = (word >> np.uint32(4 * (j + 4 * e))) & np.uint32(15)
                        col = 64 * t + 16 * j + 8 * h + 2 * q + e
                        got += np.outer(quant.FP4_TABLE[code] * scale, xp[:, col])
    np.testing.assert_array_equal(got, _dequant(w[0], s[0]) @ x.T)


def test_permute_k_is_a_permutation_within_chunks():
    x = jnp.arange(2 * 128, dtype=jnp.float32).reshape(2, 128)
    p = np.asarray(fw.permute_k(x))
    for chunk in range(2):
        np.testing.assert_array_equal(np.sort(p[:, 64 * chunk:64 * (chunk + 1)], axis=1),
                                      np.asarray(x)[:, 64 * chunk:64 * (chunk + 1)])
    assert p[0, 1] == 4 and p[0, 2] == 16  # position 16j + 8h + 2q + e holds 16q + 8h + 4e + j


def test_bad_shapes_are_named():
    w, s, x, tiles = _operands(f=96)
    args = pack_words(jnp.asarray(w)), jnp.asarray(s), jnp.asarray(x, jnp.bfloat16), jnp.asarray(tiles)
    with pytest.raises(ValueError, match="F 96 must be a multiple of 128"):
        fw.grouped_gemm_t_mgpu(*args, sizes=(8,))
    with pytest.raises(ValueError, match="tile sizes must be multiples of 8"):
        fw.grouped_gemm_t_mgpu(*args, sizes=(8, 12))
    with pytest.raises(ValueError, match="warpgroups must be one of"):
        fw.grouped_gemm_t_mgpu(*args, sizes=(8,), warpgroups=4)
    assert fw.shape_error(96, 128, (8,), 2) is not None and fw.shape_error(64, 128, (8,), 2, warpgroups=1) is None


def test_scale_range_is_the_triton_gemms():
    """The engine's scale-range check uses GEMM_SCALE_RANGE for the grouped GEMM, whichever engine runs it."""
    assert fw.SCALE_RANGE == GEMM_SCALE_RANGE


def test_rows_gather_equals_gathered_rows():
    w, s, x, tiles = _operands()
    rows = jnp.asarray(np.random.default_rng(3).integers(0, 5, x.shape[0]), jnp.int32)
    args = pack_words(jnp.asarray(w)), jnp.asarray(s)
    x_TK = jnp.asarray(x[:5], jnp.bfloat16)
    got = fw.grouped_gemm_t_reference(*args, x_TK, jnp.asarray(tiles), rows, sizes=(8,))
    want = fw.grouped_gemm_t_reference(*args, x_TK[rows], jnp.asarray(tiles), sizes=(8,))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_tiles_of_several_sizes():
    """Tiles of different sizes anywhere in x: each covers exactly its rows; rows no tile covers are zeros."""
    w, s, x, _ = _operands(tiles=(0,) * 6)  # 48 rows
    tiles = np.array([(1, 0, 16), (0, 16, 8), (-1, 0, 0), (2, 32, 16)], np.int32)  # rows 24-31 uncovered
    got = np.asarray(fw.grouped_gemm_t_reference(pack_words(jnp.asarray(w)), jnp.asarray(s),
                                                 jnp.asarray(x, jnp.bfloat16), jnp.asarray(tiles), sizes=(8, 16)),
                     np.float32)
    want = np.zeros_like(got)
    for e, r, n in tiles:
        if e >= 0:
            want[r:r + n] = (x[r:r + n] @ _dequant(w[e], s[e]).T).astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("chunks", [1, 2])
def test_scale_words_give_each_step_its_blocks(chunks):
    """The kernel reads step s's scales as one word a row and takes block 2 * chunks * s + 2c + b (chunk c, half b)
    as byte 2c + b of it: that byte is the stored scale, for every step of a K = 2304 row (72 bytes)."""
    rng = np.random.default_rng(chunks)
    s_EFB = rng.integers(0, 256, (2, 16, 2304 // 32), dtype=np.uint8)
    words = np.asarray(fw.scale_words(jnp.asarray(s_EFB), chunks)).astype(np.uint64)
    assert words.shape == (2, 16, 2304 // (64 * chunks))
    for step in range(words.shape[-1]):
        for j in range(2 * chunks):
            got = (words[..., step] >> (8 * j)) & 0xFF
            np.testing.assert_array_equal(got, s_EFB[..., 2 * chunks * step + j])


def assert_within_ulp(got: np.ndarray, want: np.ndarray, x: np.ndarray, w_abs: np.ndarray) -> None:
    """The same exact products summed in another order: within a bf16 ulp of the output plus 2^-16 of the sum of
    |products| (the GPU test's bound); most outputs identical."""
    bound = np.abs(want) * np.float32(2.0 ** -7) + (np.abs(x) @ w_abs.T) * np.float32(2.0 ** -16)
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / np.maximum(bound, 1e-30)))
    assert np.mean(got == want) >= 0.9


@pytest.mark.parametrize("sizes, chunks, warpgroups, stages, overlap", [
    ((8,), 2, 2, 2, False),            # decode's tiles
    ((8, 16, 32), 1, 2, 3, False),     # fitted tiles of three sizes, one K chunk a step
    ((8, 16), 2, 1, 4, False),         # one compute warpgroup a CTA
    ((16,), 2, 2, 3, True),            # a step's last wgmma running into the next
    ((8, 16), 1, 1, 4, False),         # one K chunk a step, one warpgroup: 8 steps of scale words loaded ahead
])
def test_interpreted_kernel_matches_reference(sizes, chunks, warpgroups, stages, overlap):
    """The Mosaic GPU kernel itself (pipeline, TMA copies, the scale words read from GMEM, wgmma, the transposed
    store of the output tiles) run by the Mosaic GPU interpreter on the CPU, with ``_decode_values`` in place of
    the register decode (the interpreter runs no ``inline_mgpu``; test_fragment_order_reproduces_the_reference
    checks that decode's order), against the reference over fitted tiles and gathered rows."""
    rng = np.random.default_rng(sum(sizes) + chunks)
    n_experts, f, k, tokens, per_token = 3, 64 * warpgroups, 512, 13, 2
    expert_A = jnp.asarray(np.stack([rng.choice(n_experts, per_token, replace=False) for _ in range(tokens)]),
                           jnp.int32).reshape(-1)
    tiles_I3, token_R, _, _ = fit_tiles(expert_A, n_experts, per_token, sizes)
    w = rng.integers(0, 256, (n_experts, f, k // 2)).astype(np.uint8)
    s = rng.integers(*fw.SCALE_RANGE, (n_experts, f, k // 32)).astype(np.uint8)
    x = quant.fq8(jnp.asarray(rng.standard_normal((tokens, k)), jnp.float32)).astype(jnp.bfloat16)
    args = pack_words(jnp.asarray(w)), jnp.asarray(s), x, tiles_I3, token_R
    kw = dict(sizes=sizes, stages=stages, chunks=chunks, warpgroups=warpgroups, overlap=overlap)
    got = np.asarray(fw.grouped_gemm_t_mgpu(*args, interpret=True, **kw), np.float32)
    want = np.asarray(fw.grouped_gemm_t_reference(*args, **kw), np.float32)
    x_R = np.asarray(x, np.float32)[np.asarray(token_R)]
    w_abs = np.abs(_dequant(w, s))
    for e, r, n in np.asarray(tiles_I3):
        if e >= 0:
            assert_within_ulp(got[r:r + n], want[r:r + n], x_R[r:r + n], w_abs[e])
