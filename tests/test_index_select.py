"""The index sources' selection at any context length: the candidate blocks published as picks (not a [T, P] mask),
and the step's tokens selected in chunks when their [T, P] scores would exceed ``INDEX_CHUNK_ELEMENTS``: the
chunked step computes exactly what the one-chunk step computes."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dijax.config import ModelConfig
from dijax.io.loader import ASSETS
from dijax.io.random_init import random_params
from dijax.model import attention
from dijax.model.attention import candidate_mask, index_chunk, select_candidate_blocks
from dijax.model.step import CacheSpec, SeqChunk, build_step, init_cache
from dijax.model.transformer import graphdef

pytestmark = pytest.mark.cost(30)  # CI seconds, a scheduling hint (tests/conftest.py)


def test_index_chunk_bounds_the_scores():
    limit = attention.INDEX_CHUNK_ELEMENTS
    assert index_chunk(64, 4096) == 64  # decode and short prefill: one chunk, no loop
    assert index_chunk(8192, limit // 8192) == 8192
    # an 8192-token step at 1M context (block 128, 64 positions per block), the kernel's [T, P] scores: 128 tokens
    # at a time; the reference's [T, P, J] keys (J = 128, I = 32 heads): one token at a time
    assert index_chunk(8192, 8192 * 64) == limit // (8192 * 64) == 128
    assert index_chunk(8192, 8192 * 64 * (128 + 32)) == 1
    assert index_chunk(3, 2 * limit) == 1  # never below one token
    for tokens, per_token in ((8192, 8192 * 64), (1000, 99_999), (7, limit)):
        chunk = index_chunk(tokens, per_token)
        assert chunk * per_token <= max(limit, per_token) and chunk & (chunk - 1) == 0


def test_candidate_picks_and_their_mask():
    rng = np.random.default_rng(3)
    t, width, size = 5, 61, 8  # 8 blocks, the last one partial
    score = rng.standard_normal((t, width)).astype(np.float32)
    visible = np.array([0, 1, 9, 40, 61], np.int32)
    score = np.where(np.arange(width)[None, :] < visible[:, None], score, -np.inf).astype(np.float32)
    picks = np.asarray(select_candidate_blocks(jnp.asarray(score), jnp.asarray(visible), 3, size))
    assert picks.shape == (t, 3) and picks.dtype == np.int32
    assert (picks[0] == -1).all()  # nothing visible: every pick dropped
    assert sorted(picks[1][picks[1] >= 0]) == [0]  # one visible block, one pick, the rest dropped
    for row in range(1, t):
        assert (visible[row] - 1) // size in picks[row]  # the newest visible position's block is pinned
    mask = np.asarray(candidate_mask(jnp.asarray(picks), width, size))
    expect = np.array([[p // size in set(picks[row][picks[row] >= 0]) for p in range(width)] for row in range(t)])
    np.testing.assert_array_equal(mask, expect)


def _repeating() -> ModelConfig:
    """Ten layers with a candidate source and two index layers that use its candidates (as tests/test_nnx_model.py)."""
    with open(os.path.join(ASSETS, "config.json")) as f:
        raw = json.load(f)
    raw["text_config"].update(num_hidden_layers=10, num_nextn_predict_layers=0,
                              compress_ratios=[0, 2, 2, 2, 2, 1, 1, 1, 1, 1], kv_source_layer_ids=[1, 3, 5],
                              index_source_layer_ids=[1, 3, 5, 6, 8], candidate_source_layer_id=5,
                              engram_layer_ids=[], engram_num_embeddings=[], index_topk=8, candidate_topk_blocks=2)
    return ModelConfig.from_dict(raw)


def test_chunked_selection_computes_what_one_chunk_computes(monkeypatch):
    cfg = _repeating()
    params = random_params(cfg, seed=11)
    spec = CacheSpec(num_blocks=12, num_slots=3, block_size=16)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (40, 29, 7)]
    # a prefill of 76 tokens, padded to 80 (not a power of two: the chunked loop pads its last chunk), then a
    # decode of each row; the block tables are 4 wide
    steps = [[SeqChunk(slot=0, block_table=[0, 1, 2, 3], start=0, tokens=prompts[0], logits="all"),
              SeqChunk(slot=1, block_table=[4, 5], start=0, tokens=prompts[1], logits="all"),
              SeqChunk(slot=2, block_table=[6], start=0, tokens=prompts[2], logits="all")],
             [SeqChunk(slot=0, block_table=[0, 1, 2, 3], start=40, tokens=[5]),
              SeqChunk(slot=1, block_table=[4, 5], start=29, tokens=[9]),
              SeqChunk(slot=2, block_table=[6], start=7, tokens=[11])]]

    def run():
        step = jax.jit(lambda p, c, b: nnx.merge(graphdef(cfg), p)(c, b, {}))  # traced anew: reads the constant
        cache = init_cache(cfg, spec)
        out = []
        for chunks in steps:
            batch, _ = build_step(chunks, 80, 3, 4, 80)
            logits, cache, topk = step(params, cache, batch)
            out.append((np.asarray(logits), {layer: np.asarray(v) for layer, v in topk.items()}))
        return out

    whole = run()
    # at most 16 tokens a chunk in every index layer: the widest table has 4 blocks of 16 positions (ratio 1), and
    # the reference indexer that runs here holds J + I elements per token and position
    per_token = 4 * spec.block_size * (cfg.index_head_dim + cfg.index_n_heads)
    monkeypatch.setattr(attention, "INDEX_CHUNK_ELEMENTS", 16 * per_token)
    assert index_chunk(80, per_token) == 16
    chunked = run()
    for (logits_a, topk_a), (logits_b, topk_b) in zip(whole, chunked):
        np.testing.assert_array_equal(logits_a, logits_b)
        assert sorted(topk_a) == sorted(topk_b) == list(cfg.index_source_layers)
        for layer in topk_a:
            np.testing.assert_array_equal(topk_a[layer], topk_b[layer])
            assert (topk_a[layer] >= 0).any()  # the selections are not all empty
