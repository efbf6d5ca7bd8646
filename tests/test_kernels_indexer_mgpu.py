"""dijax.kernels.indexer_mgpu in jax's Mosaic GPU interpreter (CPU) against the jnp reference, and its tiles.

The kernel needs a Hopper GPU (tests/gpu/test_indexer_gpu.py runs it). Interpreted, its keys are gathered in XLA
(the interpreter runs no ``inline_mgpu``: the module docstring); the rest is the kernel's own: the tiles of tokens,
the warpgroups' alternate blocks and their slots, both products, the rounding chain, the masked rows and the -inf
blocks it writes. The interpreter's race detector runs over every case. It does not check alignment (a vector load
misaligned on the GPU passed here: docs/benchmarks.md, fifty-first session), and it drops a store's part past an
array's end, which on the GPU had spilled into the next row (fifty-second session).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from dijax.kernels import indexer as ix
from dijax.kernels import indexer_mgpu as im
from tests.test_kernels_indexer import assert_agree, problem

pytestmark = pytest.mark.cost(30)
RACES = plgpu.InterpretGPUParams(detect_races=True)


def check(seq, visible, width, *, heads, dim, blocks, warpgroups=im.WARPGROUPS, fq4=False, seed=0):
    args = problem(seq, visible, width, heads=heads, dim=dim, fq4=fq4, seed=seed)
    want = np.asarray(jax.jit(ix.index_scores_reference)(*args))
    got = np.asarray(im.index_scores_mgpu(*args, blocks=blocks, warpgroups=warpgroups, interpret=RACES))
    assert_agree(got, want, np.minimum(np.asarray(visible), width))
    return got, want


@pytest.mark.parametrize("warpgroups", [1, 2])
def test_prefill_tiles_and_causal_visibility(warpgroups):
    # one sequence's 21 tokens (tiles of 8, 8 and 5) seeing a growing prefix: chunks no token of a tile sees take no
    # CTA, their -inf written by the tile's last seen chunk, the tile of 5 row by row; fq4 inputs (the model's)
    # make every sum exact: bit for bit
    got, want = check([0] * 21, np.arange(21) * 6 + 1, 128, heads=32, dim=128, blocks=1, warpgroups=warpgroups,
                      fq4=True)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("heads,dim,blocks,warpgroups", [(32, 128, 2, 1), (8, 64, 1, 1), (16, 256, 3, 1),
                                                         (32, 128, 2, 2), (8, 64, 1, 2)])
def test_ragged_sequences(heads, dim, blocks, warpgroups):
    # four sequences of ragged lengths (tiles cut at every sequence), visible lengths from 0 past the width
    rng = np.random.default_rng(heads)
    seq = np.sort(rng.integers(0, 4, 30))
    check(seq, rng.integers(0, 150, 30), 130, heads=heads, dim=dim, blocks=blocks, warpgroups=warpgroups, seed=heads)


@pytest.mark.parametrize("warpgroups", [1, 2])
def test_slots_refilled_over_a_long_chunk(warpgroups):
    # 10 blocks a chunk: each warpgroup walks 5 (or the one warpgroup 10) blocks through its im.SLOTS key slots, so
    # slots are refilled while later gathers are in flight (the race detector checks the refill order); positions
    # seen up to 700 of 640 + 60 (the blocks past a tile's last seen position written -inf, split between the
    # warpgroups)
    assert 10 // 2 > im.SLOTS
    rng = np.random.default_rng(5)
    check(np.sort(rng.integers(0, 2, 12)), rng.integers(300, 720, 12), 700, heads=8, dim=64, blocks=10,
          warpgroups=warpgroups, seed=5)


@pytest.mark.parametrize("warpgroups", [1, 2])
def test_unseen_chunks(warpgroups):
    # the chunks past a tile's last seen position get no CTA: the last seen chunk's CTA writes their -inf rows; a
    # tile none of whose tokens sees a position (sequence 0's) writes all of them from chunk 0
    seq = [0] * 5 + [1] * 9 + [2] * 8
    visible = [0] * 5 + [1, 2, 3, 64, 65, 129, 130, 200, 1] + [300] * 8
    check(seq, visible, 300, heads=8, dim=64, blocks=1, warpgroups=warpgroups, seed=7)


def test_prefix_count():
    rng = np.random.default_rng(3)
    for t in (1, 127, 128, 1000, 20000):
        x = rng.random(t) < 0.7
        np.testing.assert_array_equal(np.asarray(im.prefix_count(jax.numpy.asarray(x))), np.cumsum(x))


def test_tiles():
    # an engine step's order: one chunk a sequence, end to end, then padding tokens of sequence row 0 (5 runs)
    seq = np.array([1] * 11 + [2] * 3 + [0] * 17 + [3] + [0] * 2, np.int32)
    visible = np.arange(len(seq), dtype=np.int32) % 13
    tiles_X4, visible_XG = (np.asarray(a) for a in im.tiles(jax.numpy.asarray(seq), jax.numpy.asarray(visible), 4))
    assert tiles_X4.shape == (-(-len(seq) // im.TOKENS) + 4 + 1, 4) and visible_XG.shape == (len(tiles_X4), 8)
    used = tiles_X4[tiles_X4[:, 2] > 0]
    # runs of 11, 3, 17, 1 and 2 tokens, split at their starts and at multiples of 8
    np.testing.assert_array_equal(used[:, 1], [0, 8, 11, 14, 16, 24, 31, 32])
    np.testing.assert_array_equal(used[:, 2], [8, 3, 3, 2, 8, 7, 1, 2])
    for x, (s, first, count, seen) in enumerate(tiles_X4):
        if count:
            tokens = np.arange(first, first + count)
            assert (seq[tokens] == s).all() and seen == visible[tokens].max()
            np.testing.assert_array_equal(visible_XG[x], np.pad(visible[tokens], (0, 8 - count)))
        else:
            assert seen == 0 and not visible_XG[x].any()


def test_shape_errors_and_engine():
    assert im.shape_error(32, 128) is None and im.shape_error(8, 64) is None
    assert "heads" in im.shape_error(4, 128) and "heads" in im.shape_error(40, 128)
    assert "J must be" in im.shape_error(32, 32)
    with pytest.raises(ValueError, match="engine must be one of"):
        ix.IndexerConfig(engine="cuda")
    with pytest.raises(ValueError, match="mgpu_blocks must be >= 1"):
        ix.IndexerConfig(mgpu_blocks=0)
    with pytest.raises(ValueError, match="mgpu_warpgroups must be 1 or 2"):
        ix.IndexerConfig(mgpu_warpgroups=3)
    # off a GPU (interpret mode) the 'mgpu' engine takes the Triton kernel: the same values as the Triton engine
    args = problem([0] * 12, np.arange(12) * 3, 64, heads=8, dim=64, seed=1)
    np.testing.assert_array_equal(np.asarray(ix.index_scores_pallas(*args, config=ix.IndexerConfig(engine="mgpu"))),
                                  np.asarray(ix.index_scores_pallas(*args, config=ix.IndexerConfig(engine="triton"))))
