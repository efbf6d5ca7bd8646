"""The engine on the embedded tiny model: ZOS on/off, preemption, batch composition, cancellation, compilation
count, sampler modes, bad input. Tokens must not depend on how requests were batched, scheduled, preempted or
overlapped, nor on the sampler mode a step took."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from jax import monitoring
from jax._src.dispatch import BACKEND_COMPILE_EVENT  # XLA's compile event (jax.monitoring)

import dijax.runtime.model_runner as model_runner
from dijax.runtime.llm import LLM
from dijax.runtime.sampler import MODES, StepSampling, sampling_inputs, step_sampling
from dijax.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.cost(95)  # CI seconds, a scheduling hint (tests/conftest.py)

# a compile served by the persistent compilation cache (tests/conftest.py shares one between the run's processes)
# fires no BACKEND_COMPILE_EVENT: this event instead
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

PROMPTS = ["The license", "Permission is hereby granted, free of charge", "You may obtain a copy of the License"]
# One engine size for every test here but the preemption one: its step buckets (tokens 8 / 16 / 32 x the one
# block-table width 4: max_model_len's blocks, below model_runner.min_width; test_no_new_compilations_after_warm_up)
# are compiled once for the whole module, each a whole-model compile on CPU. The preemption test's pool has its own
# shapes (4 blocks) and a one-bucket token budget.
SIZES = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_k=40, top_p=0.95, max_tokens=10, seed=100 + i, ignore_eos=True)


@pytest.fixture(scope="module")
def reference():
    llm = LLM(**SIZES, zos=False)
    return [o.token_ids for o in llm.generate(PROMPTS, [_params(i) for i in range(3)], use_tqdm=False)]


@pytest.fixture(scope="module")
def warm():
    """(an LLM built with ``warmup=True`` first in this file, the model-step executables its warm-up compiled)."""
    jax.clear_caches()  # the runners of the tests before shared these executables: count every one
    steps = sum(model_runner._COMPILES.values())
    llm = LLM(**SIZES, warmup=True)  # 4 blocks: width 4
    return llm, sum(model_runner._COMPILES.values()) - steps


def test_no_new_compilations_after_warm_up(warm):
    """After the warm-up, generations taking every bucket and every sampler mode trace no model step and compile
    nothing at all (XLA's compile events counted: the step, the inputs' writer, the buffers' fills, the tokens'
    copy; and loads from the persistent compilation cache, which replace a compile)."""
    llm, steps = warm
    work = [_params(i) for i in range(3)]
    # one sequence's decode at T = 1, then S = min(T, 4 sequences)
    assert llm.engine.runner.buckets() == [(1, 1, 4), (8, 4, 4), (16, 4, 4), (32, 4, 4)]
    assert steps == 4  # one model step per bucket, sampling in every mode
    traces = llm.engine.runner.compiles
    compiled = []

    def count(event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            compiled.append(kwargs.get("fun_name", "?"))

    def count_hit(event: str, **kwargs) -> None:
        if event == CACHE_HIT_EVENT:
            compiled.append("a persistent-cache load")

    monitoring.register_event_duration_secs_listener(count)
    monitoring.register_event_listener(count_hit)
    try:
        llm.generate(PROMPTS[::-1], work, use_tqdm=False)
        llm.generate(PROMPTS, work, use_tqdm=False)
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # greedy-mode steps
        llm.generate(PROMPTS, SamplingParams(temperature=0.9, max_tokens=4, seed=1), use_tqdm=False)  # temperature
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3), use_tqdm=False)  # one-token steps
    finally:
        monitoring.unregister_event_duration_listener(count)
        monitoring.unregister_event_listener(count_hit)
    assert llm.engine.runner.compiles == traces and compiled == []


def test_a_mixed_workload_gives_the_same_tokens_in_every_sampler_mode(warm, monkeypatch):
    """Two greedy requests beside a filtered sampled one that finishes first and an unfiltered one that finishes
    next: the run takes all three sampler modes (sample, then temperature, then greedy), and forcing every step
    through the sample mode changes no token."""
    llm, _ = warm
    work = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
            dataclasses.replace(_params(1), max_tokens=3),
            SamplingParams(temperature=0.0, top_k=5, top_p=0.5, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=0.9, max_tokens=6, seed=7, ignore_eos=True)]
    modes = []

    def picked(chunks, num_rows):
        sampling = step_sampling(chunks, num_rows)
        modes.append(sampling.mode)
        return sampling

    monkeypatch.setattr(model_runner, "step_sampling", picked)
    prompts = PROMPTS + PROMPTS[:1]
    tokens = [o.token_ids for o in llm.generate(prompts, work, use_tqdm=False)]
    assert set(modes) == set(MODES)
    monkeypatch.setattr(model_runner, "step_sampling",
                        lambda chunks, num_rows: StepSampling.of(sampling_inputs(chunks, num_rows), "sample"))
    assert [o.token_ids for o in llm.generate(prompts, work, use_tqdm=False)] == tokens
    assert [len(t) for t in tokens] == [10, 3, 8, 6]


def test_zos_matches_synchronous_scheduling(reference):
    llm = LLM(**SIZES, zos=True)
    outs = llm.generate(PROMPTS, [_params(i) for i in range(3)], use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" and len(o.token_ids) == 10 for o in outs)


def test_preemption_recomputes_the_same_tokens(reference):
    llm = LLM(max_num_seqs=4, max_num_batched_tokens=8, num_blocks=4, block_size=16, max_model_len=48, zos=True)
    outs = llm.generate(PROMPTS, [_params(i) for i in range(3)], use_tqdm=False)
    assert llm.engine.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference


def test_one_row_and_reversed_order_give_the_same_tokens(reference):
    llm = LLM(**SIZES)
    alone = [llm.generate([PROMPTS[i]], _params(i), use_tqdm=False)[0].token_ids for i in range(3)]
    reverse = llm.generate(PROMPTS[::-1], [_params(i) for i in (2, 1, 0)], use_tqdm=False)
    assert alone == reference and [o.token_ids for o in reverse][::-1] == reference


def test_cancelling_one_request_leaves_the_others_unchanged(reference):
    llm = LLM(**SIZES)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, _params(i))
    results = {}
    for _ in range(3):
        results.update({o.request_id: o for o in engine.step()})
    assert engine.abort("r1") and not engine.abort("r1")  # the second call: already finishing, a no-op
    while engine.has_unfinished():
        results.update({o.request_id: o for o in engine.step()})
    assert results["r1"].finish_reason == "abort"
    assert results["r0"].token_ids == reference[0] and results["r2"].token_ids == reference[2]
    assert engine.scheduler.all_free()


def test_bad_requests_are_rejected_before_anything_is_queued(reference):
    llm = LLM(**SIZES)
    good = [_params(i) for i in range(3)]
    cases = [([""] * 1, ValueError, "empty"), ([[1, 2, 9999]], ValueError, r"\[0, 512\)"),
             ([list(range(1, 80))], ValueError, "max_model_len=64"), ([3.5], TypeError, "prompt must be")]
    for bad, error, match in cases:
        with pytest.raises(error, match=match):
            llm.generate(PROMPTS + bad, good + [good[0]], use_tqdm=False)
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate(PROMPTS, good[:2] + [{"temperature": 1.0}], use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert [o.token_ids for o in llm.generate(PROMPTS, good, use_tqdm=False)] == reference


def test_stop_strings_end_the_request_and_are_cut_from_the_text():
    llm = LLM(**SIZES)
    free = llm.generate(["The license"], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    stop = free.text[len(free.text) // 2:][:4]  # a piece of what greedy decoding will produce
    out = llm.generate(["The license"], SamplingParams(temperature=0.0, max_tokens=12, stop=[stop]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and stop not in out.text
    assert free.text.startswith(out.text) and len(out.token_ids) < len(free.token_ids)
    assert free.token_ids[:len(out.token_ids)] == out.token_ids
