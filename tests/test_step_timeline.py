"""The engine's step timeline (dijax.runtime.step_timeline) on the embedded tiny model: off by default, and what it
shows of zero-overhead scheduling: step n+1 is launched before step n's sampled tokens are read, and a launch with
step n still in flight makes no transfer but its own host inputs."""

from __future__ import annotations

import jax
import pytest
from jax._src.array import ArrayImpl  # the class of every jax.Array: its value reads are watched below

from dijax.runtime.llm import LLM
from dijax.runtime.sampling_params import SamplingParams
from dijax.runtime.scheduler import FROM_DEVICE
from dijax.runtime.step_timeline import PHASES, StepRecord, StepTimeline, summarize

pytestmark = pytest.mark.cost(15)  # CI seconds, a scheduling hint (tests/conftest.py)

PROMPTS = ["The license", "Permission is hereby granted, free of charge", "You may obtain a copy of the License"]
SIZES = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)  # tests/test_engine.py's buckets
WORK = [SamplingParams(temperature=0.8, top_k=40, top_p=0.95, max_tokens=6, seed=100 + i, ignore_eos=True)
        for i in range(len(PROMPTS))]


def _phases(llm: LLM) -> list:
    return [p for r in llm.engine.timeline.records for p in r.phases]


def test_the_timeline_is_off_by_default(monkeypatch):
    def stamp(*args):
        raise AssertionError("an engine step took a timeline stamp with the timeline off")

    monkeypatch.setattr(StepTimeline, "begin", stamp)
    monkeypatch.setattr(StepRecord, "lap", stamp)
    llm = LLM(**SIZES)
    assert llm.engine.timeline is None
    outs = llm.generate(PROMPTS, WORK, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [6, 6, 6]


@pytest.mark.parametrize("zos", [True, False])
def test_zos_launches_step_n_plus_1_before_it_reads_step_n(zos):
    """With ZOS step n+1 (its tokens' copy the last of it) is dispatched before the wait for step n's tokens begins;
    without it, step n
    is read before step n+1 is even scheduled. Either way every launched step is read once, and a record's phases
    tile the call in ``PHASES`` order per step."""
    llm = LLM(**SIZES, zos=zos, trace_steps=True)
    llm.generate(PROMPTS, WORK, use_tqdm=False)
    records = list(llm.engine.timeline.records)
    phases = _phases(llm)
    launched = {p.step: p for p in phases if p.name == "tokens"}
    read = {p.step: p for p in phases if p.name == "wait"}
    scheduled = {p.step: p for p in phases if p.name == "schedule"}
    assert len(launched) >= 6 and set(launched) <= set(read)
    assert sorted(p.step for p in phases if p.name == "wait") == sorted(read)  # each step read once
    followed = [n for n in launched if n + 1 in launched]
    assert len(followed) == len(launched) - 1
    for n in followed:
        if zos:
            assert launched[n + 1].end <= read[n].start, f"step {n + 1} launched after step {n} was read"
        else:
            assert read[n].end <= scheduled[n + 1].start, f"step {n + 1} scheduled before step {n} was read"
    for r in records:
        assert r.start <= r.phases[0].start and r.phases[-1].end == r.end
        assert all(a.end == b.start for a, b in zip(r.phases, r.phases[1:]))
        assert [p.name for p in r.phases][-1] == "output"
    summary = summarize(records)
    assert summary["decode_steps"] >= 3 and 0 < summary["wait_share"] < 1
    assert all(summary[f"{name}_ms"] >= 0 for name in PHASES) and summary["step_ms"] > 0


def test_a_zos_launch_makes_no_transfer_but_its_host_inputs(monkeypatch):
    """Every launch of a ZOS run, the previous step still in flight, runs under ``jax.transfer_guard("disallow")``
    once its host inputs are placed explicitly (no implicit copy of any other host array, of the cache or of the
    previous step's tokens), and reads no device array's value nor blocks on one: the CPU's transfer guard lets
    device -> host reads through (a CPU array is host memory), so the test watches ``jax.Array``'s value and
    ``block_until_ready`` itself. The tokens are those of the unguarded run."""
    llm = LLM(**SIZES, zos=True)
    runner = llm.engine.runner
    launch = runner.launch
    launching = []  # non-empty while a launch runs
    from_device = []
    value, block = ArrayImpl._value, ArrayImpl.block_until_ready

    def watched_value(array):
        assert not launching, "a launch read a device array's value"
        return value.fget(array)

    def watched_block(array):
        assert not launching, "a launch waited for a device array"
        return block(array)

    def guarded(output, inputs, sampling, rows, record=None):
        from_device.append(any(c.token_ids == (FROM_DEVICE,) for c in output.chunks))
        inputs, sampling = jax.device_put((inputs, sampling))  # the intended host -> device copies, made explicit
        launching.append(output.step)
        try:
            with jax.transfer_guard("disallow"):
                return launch(output, inputs, sampling, rows, record)
        finally:
            launching.clear()

    monkeypatch.setattr(ArrayImpl, "_value", property(watched_value))
    monkeypatch.setattr(ArrayImpl, "block_until_ready", watched_block)
    monkeypatch.setattr(runner, "launch", guarded)
    outs = llm.generate(PROMPTS, WORK, use_tqdm=False)
    assert [o.error for o in outs] == [None] * len(PROMPTS)  # a failed launch would end its requests with "error"
    assert sum(from_device) >= 4  # decodes whose input token was still on the device
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(PROMPTS, WORK, use_tqdm=False)] == [o.token_ids for o in outs]
