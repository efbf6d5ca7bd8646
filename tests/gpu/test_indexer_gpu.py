"""The Pallas lightning-indexer kernel on the GPU, at V4.1-Flash sizes, against its jnp reference.

Run on a GPU machine: ``python -m pytest -q tests/gpu/test_indexer_gpu.py``. Outputs are poisoned two ways: with
``IndexerConfig(poison=True)`` the output buffer starts NaN-filled (aliased into the kernel); without it a NaN array
of the output's size is freed just before the call, so the allocator hands the kernel memory full of NaN. Either
way an element the kernel fails to write shows up as NaN.

Agreement (kernels/indexer.py): the -inf mask exactly, zero scores as +0.0, other scores at most one bf16 ulp apart
on a small fraction of entries (fp32 summation order); fq4-quantised inputs (the model's) make the sums exact, so
nearly all of them agree bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dijax  # noqa: F401  (sets XLA flags before JAX starts)
from dijax.kernels import indexer_mgpu, quant
from dijax.kernels.indexer import IndexerConfig, index_scores_pallas, index_scores_reference

TRITON = functools.partial(IndexerConfig, engine="triton")  # the Triton kernel's tests

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="GPU kernels: needs a CUDA backend (jax.default_backend() == 'gpu')")

HEADS, DIM = 32, 128  # V4.1-Flash: index_n_heads, index_head_dim (v41_spec §5.2)


def poison(nbytes: int) -> None:
    """Leave ``nbytes`` of freed device memory holding NaN for the next allocation to reuse."""
    filler = jnp.full((nbytes // 4 + 1,), jnp.nan, jnp.float32)
    filler.block_until_ready()
    filler.delete()


def problem(batch: int, width: int, visible, *, heads: int = HEADS, dim: int = DIM, seqs: int | None = None,
            seed: int = 0, fq4: bool = True):
    """``batch`` tokens over ``seqs`` sequences (default one each, a decode step; fewer: tokens share sequences, a
    prefill), every sequence's positions at randomly permuted rows of one pool."""
    rng = np.random.default_rng(seed)
    seqs = seqs or batch
    n = seqs * width + 1000
    q = jnp.asarray(rng.standard_normal((batch, heads, dim)), jnp.bfloat16)
    keys = jnp.asarray(rng.standard_normal((n, dim)), jnp.bfloat16)
    if fq4:
        q, keys = quant.fq4_pow2(q, 32), quant.fq4_pow2(keys, 32)
    w = jnp.asarray(rng.standard_normal((batch, heads)) * (dim * heads) ** -0.5, jnp.bfloat16)
    rows = jnp.asarray(rng.permutation(n)[:seqs * width].reshape(seqs, width).astype(np.int32))
    seq = jnp.asarray(np.arange(batch) % seqs, jnp.int32)
    return q, w, keys, rows, seq, jnp.asarray(np.asarray(visible, np.int32))


def bf16_ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Distance in bf16 ulps between float32 arrays of bf16 values."""
    def ordered(x):
        bits = x.view(np.int32) >> 16
        return np.where(bits < 0, np.int32(-0x8000) - bits, bits).astype(np.int64)
    return np.abs(ordered(got) - ordered(want))


def check(args, config: IndexerConfig, max_fraction: float, kernel=None) -> float:
    """Run both implementations (``kernel``, default the Pallas one with ``config``), assert the agreement above;
    returns the fraction of scores that differ."""
    want = np.asarray(jax.jit(index_scores_reference)(*args))
    kernel = jax.jit(kernel or (lambda *a: index_scores_pallas(*a, config=config)))
    if not config.poison:
        poison(want.nbytes * 2)
    got = np.asarray(kernel(*args))
    assert not np.isnan(got).any(), f"{np.isnan(got).sum()} scores never written"
    visible = np.minimum(np.asarray(args[5]), want.shape[1])
    masked = np.arange(want.shape[1])[None, :] >= visible[:, None]
    np.testing.assert_array_equal(np.isneginf(got), masked)
    np.testing.assert_array_equal(np.isneginf(want), masked)
    live_got, live_want = got[~masked], want[~masked]
    assert np.isfinite(live_got).all()
    assert not (live_got.view(np.uint32) == np.float32(-0.0).view(np.uint32)).any(), "a zero score is -0.0"
    ulps = bf16_ulps(live_got, live_want)
    fraction = float((ulps > 0).mean()) if ulps.size else 0.0
    assert ulps.max(initial=0) <= 1, f"max {ulps.max()} bf16 ulps"
    assert fraction <= max_fraction, f"{fraction:.3%} of the scores one bf16 ulp apart"
    return fraction


@pytest.mark.parametrize("batch,width,config", [
    (1, 262_144, TRITON()),
    (64, 65_536, TRITON()),
    (256, 4096, TRITON(poison=True)),
    (64, 65_536, TRITON(block_p=64, blocks=1, num_warps=4, poison=True)),
    (64, 65_536, TRITON(block_p=256, blocks=2, num_warps=8)),
])
def test_decode_matches_reference(batch, width, config):
    rng = np.random.default_rng(batch)
    visible = rng.integers(0, width + 1, batch)
    visible[0] = width
    if batch > 2:
        visible[1], visible[2] = 0, 1  # a token with nothing visible, one with a single position
    args = problem(batch, width, visible, seed=batch)
    check(args, config, max_fraction=1e-3)


def test_prefill_tokens_of_few_sequences():
    # a chunk of 48 tokens of 3 sequences, P not a multiple of the chunk: visible lengths grow token by token
    width = 3000
    visible = np.concatenate([np.arange(16) * 37, 1500 + np.arange(16), width - np.arange(16)])
    args = problem(48, width, visible, seqs=3, seed=7)
    check(args, TRITON(poison=True), max_fraction=1e-3)


@pytest.mark.parametrize("heads", [32, 64])
def test_random_bf16_inputs_within_one_ulp(heads):
    # unquantised inputs: the dot and head sums round, in another order than XLA's
    args = problem(16, 8192, np.linspace(0, 8192, 16).astype(int), heads=heads, seed=heads, fq4=False)
    check(args, TRITON(poison=True), max_fraction=0.02)


def test_tiny_model_heads_and_zero_scores():
    # the parity fixtures' 4 heads of 32, padded to 16 inside the call; token 0's scores are all sums of -0.0
    # terms (every dot negative, every weight negative), which must come back +0.0
    q, w, keys, rows, seq, visible = problem(7, 300, [300, 0, 1, 17, 150, 299, 64], heads=4, dim=32, seqs=3,
                                             seed=3, fq4=False)
    q = q.at[0].set(-jnp.abs(q[0]))
    keys = jnp.abs(keys)
    w = w.at[0].set(-jnp.abs(w[0]))
    args = (q, w, keys, rows, seq, visible)
    check(args, TRITON(block_p=16, poison=True), max_fraction=0.02)
    got = np.asarray(jax.jit(lambda *a: index_scores_pallas(*a, config=TRITON(block_p=16)))(*args))
    assert (got[0].view(np.uint32) == 0).all()


def engine_order(args, runs):
    """``args`` with its tokens' sequences in an engine step's order: ``runs`` (sequence, tokens) end to end."""
    seq = np.concatenate([np.full(n, s_, np.int32) for s_, n in runs])
    return (*args[:4], jnp.asarray(seq), args[5])


@pytest.mark.parametrize("warpgroups", [1, 2])
def test_mgpu_prefill_of_one_sequence(warpgroups):
    # the Mosaic GPU kernel at prefill: 8192 tokens of one sequence over 2048 compressed positions, each seeing a
    # growing prefix (t // 4 + 1), as an index layer's chunk does
    assert indexer_mgpu.available()
    t, width = 8192, 2048
    args = problem(t, width, np.arange(t) // 4 + 1, seqs=1, seed=11)
    check(args, IndexerConfig(), max_fraction=1e-3,
          kernel=lambda *a: indexer_mgpu.index_scores_mgpu(*a, warpgroups=warpgroups))


@pytest.mark.parametrize("blocks,width,warpgroups", [
    (8, 3000, 1), (1, 3000, 1), (3, 3001, 1), (32, 3000, 1), (8, 3000, 2), (1, 3000, 2), (3, 3001, 2)])
def test_mgpu_ragged_runs_and_padding(blocks, width, warpgroups):
    # three sequences' chunks of ragged lengths (tiles cut at each), then padding tokens of sequence row 0 that
    # see nothing; one block a chunk leaves the second warpgroup idle (with two); the tiles of runs starting at
    # odd tokens have their visible lengths as rows (a vector load from [T] was misaligned there); the last
    # block of 3000 / 3001 positions is part-filled (the rows written 3008 wide, then sliced: a one-row store past
    # P had spilled into the next row's first scores)
    runs = [(0, 37), (1, 5), (2, 100), (0, 18)]
    visible = np.concatenate([np.arange(37) * 40 + 1, [0, 1, 63, 64, 65], 3000 - np.arange(100), np.zeros(18)])
    args = engine_order(problem(160, width, visible, seqs=3, seed=blocks), runs)
    check(args, IndexerConfig(), max_fraction=1e-3,
          kernel=lambda *a: indexer_mgpu.index_scores_mgpu(*a, blocks=blocks, warpgroups=warpgroups))


@pytest.mark.parametrize("t,width", [(3, 40), (20, 61)])
def test_mgpu_small_shapes(t, width):
    # the kernel where the scores are smaller than a store's box: fewer tokens than a tile, fewer positions than a
    # block, a width that is no multiple of 4 (written wider, then sliced)
    args = problem(t, width, np.arange(t) * 3 + 1, seqs=1, seed=t)
    check(args, IndexerConfig(), max_fraction=1e-3,
          kernel=lambda *a: indexer_mgpu.index_scores_mgpu(*a, blocks=2))


def test_mgpu_random_bf16_and_seam():
    # unquantised inputs within one ulp; then the seam: IndexerConfig(engine='mgpu') takes a prefill-shaped call
    args = engine_order(problem(512, 4096, np.linspace(0, 4096, 512).astype(int), seqs=2, seed=3, fq4=False),
                        [(0, 256), (1, 256)])
    check(args, IndexerConfig(), max_fraction=0.02, kernel=indexer_mgpu.index_scores_mgpu)
    check(args, IndexerConfig(engine="mgpu"), max_fraction=0.02)
    check(args, IndexerConfig(engine="mgpu", mgpu_warpgroups=2), max_fraction=0.02)
