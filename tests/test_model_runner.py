"""The runner's bucket plan: the block-table width follows the step's longest sequence, not max_model_len,
padding tokens are routed to no expert, and the sampler mode the step's rows pick keys no executable: the model step
samples in every mode."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dijax.model.moe as moe_module
from dijax.io.loader import load
from dijax.model.moe import moe
from dijax.model.param_map import checkpoint_tree
from dijax.model.step import PackedBatch, SeqChunk, StepBatch, build_step, unpack_batch
from dijax.runtime import model_runner
from dijax.runtime.model_runner import (ModelRunner, engine_buckets, min_width, step_buckets, token_bucket,
                                        width_bucket)
from dijax.runtime.sampling_params import SamplingParams
from dijax.runtime.scheduler import FROM_DEVICE, ScheduledChunk, SchedulerOutput


@pytest.fixture(scope="module")
def tiny():
    """(config, params, Engram constants, tokenizer) of the embedded tiny model."""
    return load(None)


def test_width_follows_the_context_not_the_capacity():
    assert [width_bucket(b, 8192) for b in (1, 2, 4, 5, 16, 17, 33)] == [1, 4, 4, 16, 16, 64, 64]
    assert width_bucket(30, 32) == 32 and width_bucket(3, 2) == 2  # capped by max_model_len's blocks
    # a 4k context in 128-token blocks: 32 blocks under max_model_len 4k, 64 (not 8192) under max_model_len 1M
    assert width_bucket(4096 // 128, 4096 // 128) == 32 and width_bucket(4096 // 128, 2 ** 20 // 128) == 64
    # the engine's tables cover at least 8192 positions: 64 blocks of 128 (fewer under a smaller max_model_len)
    assert min_width(128, 2 ** 20 // 128) == 64 and min_width(128, 32) == 32 and min_width(16, 4) == 4
    assert [width_bucket(b, 8192, 64) for b in (1, 64, 65, 256, 257, 5000)] == [64, 64, 256, 256, 1024, 8192]
    # a 1M-context engine of 8192-token steps: 12 token buckets (one token, then 8 .. 8192) x 5 widths (not 8: no
    # width below 64 blocks)
    buckets = step_buckets(8192, 2 ** 20 // 128, 64)
    assert len(buckets) == 60 and sorted({w for _, w in buckets}) == [64, 256, 1024, 4096, 8192]
    assert step_buckets(32, 4, 4) == [(1, 4), (8, 4), (16, 4), (32, 4)]
    # the engine's own plan: the same 60, rows tied to tokens up to the 256-sequence capacity
    plan = engine_buckets(8192, 256, 2 ** 20, 128)
    assert [(t, w) for t, _, w in plan] == buckets and {s for t, s, _ in plan if t >= 256} == {256}
    assert all(s == min(t, 256) for t, s, _ in plan)


def test_small_token_buckets(monkeypatch):
    """By default one sequence's decode step runs at T = 1 and from two tokens the steps pad to MIN_TOKENS and
    powers of two; ``small`` (the engine's ``small_token_buckets``) adds or removes the buckets below MIN_TOKENS,
    the module default too."""
    assert [token_bucket(n) for n in (0, 1, 2, 7, 8, 9, 300)] == [8, 1, 8, 8, 8, 16, 512]
    assert [token_bucket(n, (4, 1, 2)) for n in (1, 2, 3, 4, 5, 9)] == [1, 2, 4, 4, 8, 16]
    assert step_buckets(32, 4, 4, (1, 2, 4)) == [(1, 4), (2, 4), (4, 4), (8, 4), (16, 4), (32, 4)]
    assert token_bucket(1, ()) == 8 and step_buckets(32, 4, 4, ()) == [(8, 4), (16, 4), (32, 4)]
    monkeypatch.setattr(model_runner, "SMALL_TOKEN_BUCKETS", ())
    assert token_bucket(1) == 8 and engine_buckets(32, 4, 64, 16)[0] == (8, 4, 4)
    assert engine_buckets(32, 4, 64, 16, (2,))[:2] == [(2, 2, 4), (8, 4, 4)]


def test_padding_tokens_reach_no_expert(monkeypatch, tiny):
    cfg, params, _, _ = tiny
    layer = checkpoint_tree(cfg, params)["layers"][0]["ffn"]
    x_TD = jax.random.normal(jax.random.key(0), (6, cfg.dim), jnp.float32).astype(jnp.bfloat16)
    valid_T = jnp.array([True, True, True, False, False, False])
    seen = {}
    real = moe_module.routed_experts_ep

    def spy(experts, x, weights_TX, experts_TX, limit, **kw):
        seen["experts_TX"] = np.asarray(experts_TX)
        return real(experts, x, weights_TX, experts_TX, limit, **kw)

    monkeypatch.setattr(moe_module, "routed_experts_ep", spy)
    y_masked = moe(layer, x_TD, cfg, valid_T)
    assert (seen["experts_TX"][3:] == -1).all() and (seen["experts_TX"][:3] >= 0).all()
    y_all = moe(layer, x_TD, cfg)
    np.testing.assert_array_equal(np.asarray(y_masked[:3]), np.asarray(y_all[:3]))


def _decodes(*temperatures: float, start: int = 3, tokens: tuple[int, ...] | None = None) -> SchedulerOutput:
    """One decode step of a sequence per temperature, each ``start`` tokens into its own block; sequence i's input
    token is ``tokens[i]`` (default 5 + i)."""
    tokens = tokens or tuple(5 + i for i in range(len(temperatures)))
    chunks = tuple(ScheduledChunk(request_id=str(i), slot=i, block_table=(i,), start=start, num_tokens=1,
                                  token_ids=(tokens[i],), sample=True, epoch=0, seed=i, output_position=0,
                                  params=SamplingParams(temperature=t, top_p=0.9)) for i, t in enumerate(temperatures))
    return SchedulerOutput(step=0, chunks=chunks, num_tokens=len(chunks), preempted=())


def test_the_sampler_mode_keys_no_executable(tiny):
    """Steps of one bucket whose rows pick different sampler modes lower to one model step, which samples in every
    mode on the device: it returns the bucket's 4 logit rows and the runner's token array, sorts and draws noise
    (the sample mode's work), and has no conditional (on the GPU one around a vocabulary sort runs on the host:
    dijax.runtime.sampler)."""
    cfg, params, consts, _ = tiny
    runner = ModelRunner(cfg, params, consts, num_blocks=4, num_slots=4, block_size=16, max_model_len=64,
                         max_num_seqs=4, max_num_batched_tokens=8)
    (greedy_inputs, greedy, _), (mixed_inputs, mixed, _) = (runner.step_inputs(_decodes(*temperatures), None)
                                                      for temperatures in ((0.0, 0.0), (0.0, 0.8, 0.0)))
    assert greedy.mode == "greedy" and mixed.mode == "sample"
    step = runner.lower(greedy_inputs)
    text = step.as_text()
    assert text == runner.lower(mixed_inputs).as_text()
    logits_RV, tokens_M = step.out_info[0]
    assert logits_RV.shape == (4, cfg.vocab_size) and logits_RV.dtype == jnp.float32
    assert tokens_M.shape == (runner.max_rows,) and tokens_M.dtype == jnp.int32
    assert "stablehlo.sort" in text and "threefry" in text
    assert "stablehlo.case" not in text and "stablehlo.if" not in text


def test_the_sampler_feeds_the_next_model_step_on_the_device(tiny):
    """``execute`` (device reads disallowed) samples the model step's logits: greedy rows take the debug logits'
    argmax, in the runner's [max rows] token array; a decode whose token is in flight (FROM_DEVICE) reads it from
    that array and gets the logits a second runner gets with the token given."""
    cfg, params, consts, _ = tiny
    zos, given = (ModelRunner(cfg, params, consts, num_blocks=4, num_slots=4, block_size=16, max_model_len=64,
                              max_num_seqs=4, max_num_batched_tokens=8, debug_logits=True) for _ in range(2))
    first = zos.execute(_decodes(0.0, 0.0), None)
    sampled = first.wait()
    tokens = tuple(sampled[rid][1] for rid in ("0", "1"))
    assert tokens == tuple(int(np.argmax(first.logits[rid])) for rid in ("0", "1"))
    assert first.tokens_R.shape == (zos.max_rows,) and first.tokens_R.dtype == jnp.int32
    in_flight = zos.execute(_decodes(0.0, 0.0, start=4, tokens=(FROM_DEVICE, FROM_DEVICE)), first)
    in_flight.wait()
    given.execute(_decodes(0.0, 0.0), None).wait()
    second = given.execute(_decodes(0.0, 0.0, start=4, tokens=tokens), None)
    second.wait()
    for rid in ("0", "1"):
        np.testing.assert_array_equal(in_flight.logits[rid], second.logits[rid])


def test_the_step_inputs_travel_as_one_array_per_executable(tiny):
    """The batch's ten fields reach the device as one int32 array and come back exact in the trace."""
    cfg, params, consts, _ = tiny
    runner = ModelRunner(cfg, params, consts, num_blocks=4, num_slots=4, block_size=16, max_model_len=64,
                         max_num_seqs=4, max_num_batched_tokens=8)
    (packed, *_), sampling, _ = runner.step_inputs(_decodes(0.0, 0.8), None)
    assert isinstance(packed, PackedBatch) and len(jax.tree.leaves(packed)) == 1
    assert len(jax.tree.leaves(sampling)) == 1
    chunks = [SeqChunk(slot=c.slot, block_table=c.block_table, start=c.start, tokens=c.token_ids)
              for c in _decodes(0.0, 0.8).chunks]
    batch, _ = build_step(chunks, 8, 4, runner.min_width, 4)  # width: max_model_len's 4 blocks
    unpacked = jax.jit(unpack_batch)(packed)
    for field in dataclasses.fields(StepBatch):
        want, got = getattr(batch, field.name), np.asarray(getattr(unpacked, field.name))
        assert got.dtype == (bool if field.name == "valid_T" else np.int32) and np.array_equal(got, want), field.name


@pytest.mark.parametrize("logits", ["last", "all", "none"])
def test_build_step_lays_out_every_chunk(logits):
    """``build_step`` (built column-wise) against a chunk-by-chunk reading of the StepBatch fields: tokens,
    positions, sequence rows and validity of each chunk's tokens, back to back then padding; each row's slot,
    start, query length and offset; block tables of several widths, zero-padded; the logit rows each chunk asks
    for. Also a step of no chunks."""
    rng = np.random.default_rng(3)
    lengths, widths = [3, 1, 7, 1], [2, 5, 1, 3]
    chunks = [SeqChunk(slot=int(rng.integers(0, 9)), block_table=tuple(rng.integers(0, 50, w).tolist()),
                       start=int(rng.integers(0, 40)), tokens=tuple(rng.integers(0, 500, n).tolist()),
                       logits=logits) for n, w in zip(lengths, widths)]
    batch, rows_per_chunk = build_step(chunks, 16, 6, 5, 16)
    t = 0
    want_rows = []
    for s, c in enumerate(chunks):
        n = len(c.tokens)
        np.testing.assert_array_equal(batch.tokens_T[t:t + n], c.tokens)
        np.testing.assert_array_equal(batch.positions_T[t:t + n], np.arange(c.start, c.start + n))
        assert (batch.seq_T[t:t + n] == s).all() and batch.valid_T[t:t + n].all()
        assert (batch.slot_S[s], batch.start_S[s], batch.qlen_S[s], batch.qstart_S[s]) == (c.slot, c.start, n, t)
        np.testing.assert_array_equal(batch.block_table_SB[s], list(c.block_table) + [0] * (5 - len(c.block_table)))
        wanted = {"last": [t + n - 1], "all": list(range(t, t + n)), "none": []}[logits]
        assert rows_per_chunk[s] == list(range(len(want_rows), len(want_rows) + len(wanted)))
        want_rows += wanted
        t += n
    assert not batch.valid_T[t:].any() and not batch.tokens_T[t:].any() and not batch.block_table_SB[4:].any()
    np.testing.assert_array_equal(batch.logit_rows_R, want_rows + [0] * (16 - len(want_rows)))
    empty, rows = build_step([], 8, 2, 3, 2)
    assert rows == [] and not empty.valid_T.any() and empty.block_table_SB.shape == (2, 3)
    with pytest.raises(ValueError, match="max_blocks"):
        build_step(chunks, 16, 6, 4, 16)
