"""kernels.indexer: the Pallas lightning-indexer kernel (interpret mode on CPU) against the jnp reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dijax  # noqa: F401  (sets XLA flags before JAX starts)
from dijax.kernels import quant
from dijax.kernels.indexer import (IndexerConfig, blocks_per_program, index_scores, index_scores_pallas,
                                   index_scores_reference)

# the tiny parity models' indexer: 4 heads of 32
HEADS, DIM = 4, 32


def problem(seq_T, visible_T, width: int, *, heads: int = HEADS, dim: int = DIM, spare_rows: int = 37,
            seed: int = 0, fq4: bool = False):
    """Tokens of several sequences over a paged pool: every sequence's positions live at randomly permuted pool
    rows (no two positions share a row), with rows no sequence uses between them."""
    rng = np.random.default_rng(seed)
    seq_T = np.asarray(seq_T, np.int32)
    t, s = seq_T.shape[0], int(seq_T.max()) + 1
    n = s * width + spare_rows
    q = jnp.asarray(rng.standard_normal((t, heads, dim)), jnp.bfloat16)
    keys = jnp.asarray(rng.standard_normal((n, dim)) * 2, jnp.bfloat16)
    if fq4:  # the model's inputs: fp4 values with ue8m0 scales per 32 (quant.fq4_pow2)
        q, keys = quant.fq4_pow2(q, 32), quant.fq4_pow2(keys, 32)
    w = jnp.asarray(rng.standard_normal((t, heads)) * dim ** -0.5, jnp.bfloat16)
    rows = rng.permutation(n)[:s * width].reshape(s, width).astype(np.int32)
    return q, w, keys, jnp.asarray(rows), jnp.asarray(seq_T), jnp.asarray(np.asarray(visible_T, np.int32))


def run_both(args, config=None):
    want = np.asarray(jax.jit(index_scores_reference)(*args))
    got = np.asarray(index_scores_pallas(*args, config=config))
    return got, want


def bf16_ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Distance in bf16 ulps between float32 arrays of bf16 values (finite entries of the same mask)."""
    def ordered(x):
        bits = x.view(np.int32) >> 16
        return np.where(bits < 0, np.int32(-0x8000) - bits, bits)
    return np.abs(ordered(got).astype(np.int64) - ordered(want).astype(np.int64))


def assert_agree(got, want, visible_T, *, max_fraction: float = 0.02):
    """The -inf mask exactly at p >= visible, bf16 values everywhere else, at most one bf16 ulp apart on at most
    ``max_fraction`` of the visible entries (fp32 summation-order ties)."""
    masked = np.arange(want.shape[1])[None, :] >= np.asarray(visible_T)[:, None]
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(want), masked)
    np.testing.assert_array_equal(np.isneginf(got), masked)
    live = got[~masked]
    assert np.isfinite(live).all()
    np.testing.assert_array_equal(live, live.astype(jnp.bfloat16).astype(np.float32))
    ulps = bf16_ulps(got[~masked], want[~masked])
    assert ulps.max(initial=0) <= 1, f"max {ulps.max()} bf16 ulps"
    fraction = float((ulps > 0).mean()) if ulps.size else 0.0
    assert fraction <= max_fraction, f"{fraction:.1%} of the scores one bf16 ulp apart"


# three sequences, tokens interleaved as a mixed prefill / decode step: visible lengths 0, 1, at and around block
# edges, the whole width, and past it (clamped to the width)
SEQ = [0, 1, 1, 2, 0, 2, 1, 0]
VISIBLE = [0, 1, 16, 17, 150, 64, 999, 95]
WIDTH = 150  # not a multiple of any block


@pytest.mark.parametrize("config", [IndexerConfig(block_p=16), IndexerConfig(block_p=16, blocks=2),
                                    IndexerConfig(block_p=32, blocks=4), IndexerConfig()],
                         ids=["b16", "b16x2", "b32x4", "default"])
def test_matches_reference_ragged_paged(config):
    args = problem(SEQ, VISIBLE, WIDTH, seed=1)
    got, want = run_both(args, config)
    assert_agree(got, want, np.minimum(VISIBLE, WIDTH))


def test_fq4_inputs_agree_bit_for_bit():
    # fp4 values times power-of-two scales: every dot and head sum is exact in fp32, so no order can round apart
    args = problem(SEQ, VISIBLE, WIDTH, heads=32, dim=64, seed=2, fq4=True)
    got, want = run_both(args, IndexerConfig(block_p=32))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("heads", [1, 4, 24])
def test_padded_heads_and_zero_scores(heads):
    # heads are padded to a power of two >= 16 with zero queries and weights (terms of +0.0, which change no sum);
    # a score whose every head gives -0.0 (all dots negative, all weights negative) is +0.0 in both: the top-k
    # orders -0.0 below +0.0, and the sign of such a sum depends on the backend's reduction
    q, w, keys, rows, seq, visible = problem([0, 1, 0], [40, 33, 7], 40, heads=heads, seed=heads)
    w = -jnp.abs(w)
    q = q.at[0].set(-jnp.abs(q[0]))
    keys = jnp.abs(keys)
    got, want = run_both((q, w, keys, rows, seq, visible), IndexerConfig(block_p=16))
    assert (want[0].view(np.uint32) == 0).all()
    np.testing.assert_array_equal(got[0].view(np.uint32), want[0].view(np.uint32))
    assert_agree(got, want, [40, 33, 7])


def test_no_visible_positions_and_one_token():
    args = problem([0], [0], 70, seed=3)
    got, want = run_both(args, IndexerConfig(block_p=16))
    assert np.isneginf(got).all() and np.isneginf(want).all()
    args = problem([2], [70], 70, seed=4)
    got, want = run_both(args, IndexerConfig(block_p=64))
    assert_agree(got, want, [70])


def test_poisoned_output_is_fully_written():
    # the output starts NaN (aliased into the kernel): every element, masked or not, must be written
    args = problem(SEQ, VISIBLE, WIDTH, seed=5)
    got = np.asarray(index_scores_pallas(*args, config=IndexerConfig(block_p=16, blocks=2, poison=True)))
    assert not np.isnan(got).any()
    assert_agree(got, np.asarray(index_scores_reference(*args)), np.minimum(VISIBLE, WIDTH))


def test_blocks_per_program():
    # as many blocks as keep target_programs programs for T x P, at most max_blocks
    config = IndexerConfig(block_p=128, target_programs=1056, max_blocks=8)
    assert blocks_per_program(config, 1, 4096) == 1
    assert blocks_per_program(config, 1, 262_144) == 1
    assert blocks_per_program(config, 64, 65_536) == 8
    assert blocks_per_program(config, 64, 4096) == 1
    assert blocks_per_program(config, 256, 4096) == 4
    assert blocks_per_program(IndexerConfig(blocks=4), 1, 128) == 4


def test_dispatcher_and_errors():
    args = problem([0, 1], [30, 12], 40, seed=6)
    ref = np.asarray(index_scores(*args, impl="reference"))
    ker = np.asarray(index_scores(*args, impl="pallas"))
    assert_agree(ker, ref, [30, 12])
    with pytest.raises(ValueError, match="impl must be one of"):
        index_scores(*args, impl="triton")
    with pytest.raises(ValueError, match="block_p"):
        index_scores_pallas(*args, config=IndexerConfig(block_p=24))
    with pytest.raises(ValueError, match="blocks"):
        index_scores_pallas(*args, config=IndexerConfig(block_p=16, blocks=3))
    with pytest.raises(ValueError, match="J=48"):
        index_scores_pallas(*problem([0], [5], 10, dim=48))
    too_big = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in
               [((1, 4, 128), jnp.bfloat16), ((1, 4), jnp.bfloat16), ((1 << 24, 128), jnp.bfloat16),
                ((1, 128), jnp.int32), ((1,), jnp.int32), ((1,), jnp.int32)]]
    with pytest.raises(ValueError, match="keys_NJ has 2147483648 elements"):
        jax.eval_shape(index_scores_pallas, *too_big)


def test_lowers_to_triton_without_a_gpu(lower_for_cuda):
    """The kernel lowers to Triton IR at the V4.1-Flash sizes (conftest ``lower_for_cuda``)."""
    t, i, j, width, n = 64, 32, 128, 65_536, 1 << 20
    shapes = [((t, i, j), jnp.bfloat16), ((t, i), jnp.bfloat16), ((n, j), jnp.bfloat16), ((t, width), jnp.int32),
              ((t,), jnp.int32), ((t,), jnp.int32)]
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    for config in (IndexerConfig(), IndexerConfig(block_p=64, blocks=1, poison=True)):
        assert "triton" in lower_for_cuda(lambda *a, c=config: index_scores_pallas(*a, config=c, interpret=False),
                                          *args)



def test_jitted_reference_keeps_every_bf16_rounding():
    """Jitted (as in the model) the reference equals its op-by-op run bit for bit: XLA:CPU must not fuse the
    weighted terms' bf16 rounding away into the head sum (it did at 24+ heads before the optimization barrier)."""
    args = problem(np.arange(16) % 2, [150] * 16, 150, heads=24, dim=64)
    with jax.disable_jit():
        eager = np.asarray(index_scores_reference(*args))
    np.testing.assert_array_equal(np.asarray(jax.jit(index_scores_reference)(*args)), eager)
