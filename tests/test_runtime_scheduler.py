"""Scheduler behaviour: FCFS admission, chunking, decode, preemption, stale epochs, abort, zero-overhead scheduling.

A fake device stands in for the model: it resolves in-flight inputs (FROM_DEVICE) from the previous step's samples,
as the real runner does on device, and "samples" a deterministic function of (request, output position, input
token). So the reference output of every request is known, and preemption / ZOS must reproduce it exactly.
"""

from __future__ import annotations

import zlib
from collections import deque

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dijax.runtime.block_manager import BlockManager
from dijax.runtime.sampling_params import SamplingParams
from dijax.runtime.scheduler import FROM_DEVICE, Scheduler, SchedulerOutput
from dijax.runtime.sequence import FINISH_REASONS, Sequence, SequenceStatus
from dijax.runtime.state_manager import StateManager

EOS = 11


def fake_token(request_id: str, output_position: int, input_token: int) -> int:
    """A deterministic 'model': the next token from (request, output position, the token fed before it)."""
    return 10 + zlib.crc32(f"{request_id}/{output_position}/{input_token}".encode()) % 40


def reference_output(seq: Sequence, n: int) -> list[int]:
    """The first ``n`` output tokens the fake model must produce for ``seq``, however it was scheduled."""
    out, last = [], seq.prompt_token_ids[-1]
    for position in range(n):
        last = fake_token(seq.request_id, position, last)
        out.append(last)
    return out


class FakeDevice:
    """Runs a SchedulerOutput: resolves FROM_DEVICE inputs from the previous step only, then samples."""

    def __init__(self):
        self.previous: dict[str, tuple[int, int]] = {}

    def run(self, out: SchedulerOutput) -> dict[str, tuple[int, int]]:
        sampled = {}
        for c in out.chunks:
            last = c.token_ids[-1]
            if last == FROM_DEVICE:
                epoch, last = self.previous[c.request_id]  # KeyError: the input was not in the previous step
                assert epoch == c.epoch, f"{c.request_id}: gathered a token of epoch {epoch} into epoch {c.epoch}"
            assert FROM_DEVICE not in c.token_ids[:-1]
            if c.sample:
                sampled[c.request_id] = (c.epoch, fake_token(c.request_id, c.output_position, last))
        self.previous = sampled
        return sampled


def make_scheduler(num_blocks=8, block_size=4, num_slots=4, max_num_seqs=4, max_num_batched_tokens=8,
                   max_model_len=32, eos_token_id=None, ranks=1) -> Scheduler:
    """A scheduler with ``ranks`` attention ranks, each with pools of the given sizes."""
    return Scheduler([BlockManager(num_blocks, block_size) for _ in range(ranks)],
                     [StateManager(num_slots) for _ in range(ranks)], max_num_seqs, max_num_batched_tokens,
                     max_model_len, eos_token_id=eos_token_id)


def make_seq(request_id: str, prompt_len: int, max_tokens: int = 4, **kwargs) -> Sequence:
    prompt = [1 + (i % 9) for i in range(prompt_len)]
    return Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens, seed=0, **kwargs))


def step(sched: Scheduler, device: FakeDevice) -> tuple[SchedulerOutput, list[Sequence]]:
    """One non-overlapped step: schedule, run, process, check."""
    out = sched.schedule()
    finished = sched.process(out, device.run(out))
    sched.check_invariants()
    return out, finished


def ids(out: SchedulerOutput) -> list[str]:
    return [c.request_id for c in out.chunks]


# ------------------------------------------------------------------------------------------------ validation

def test_add_validates_before_queueing():
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match="empty"):
        sched.add(make_seq("a", 0))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(make_seq("b", 17))
    sched.add(make_seq("c", 16))
    with pytest.raises(ValueError, match="already"):
        sched.add(make_seq("c", 2))
    with pytest.raises(TypeError, match="Sequence"):
        sched.add("d")
    assert [s.request_id for s in sched.waiting] == ["c"]


def test_constructor_validation():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler(num_blocks=2, block_size=4, max_model_len=9)
    with pytest.raises(TypeError, match="max_num_seqs"):
        make_scheduler(max_num_seqs=True)
    with pytest.raises(ValueError, match="one block manager and one state manager per rank"):
        Scheduler([BlockManager(8, 4)] * 2, [StateManager(4)], 4, 8, 32)
    with pytest.raises(ValueError, match=r"block_managers must all have the same sizes, got \[\(8, 4\), \(6, 4\)\]"):
        Scheduler([BlockManager(8, 4), BlockManager(6, 4)], [StateManager(4)] * 2, 4, 8, 32)
    with pytest.raises(TypeError, match="block_managers must be a non-empty list of BlockManager"):
        Scheduler(BlockManager(8, 4), [StateManager(4)], 4, 8, 32)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)
    with pytest.raises(ValueError, match="num_slots"):
        StateManager(0)


def test_sequence_validation():
    with pytest.raises(TypeError, match="request_id"):
        Sequence(3, [1])
    with pytest.raises(TypeError, match="prompt_token_ids"):
        Sequence("a", [1, True])
    with pytest.raises(TypeError, match="params"):
        Sequence("a", [1], {"max_tokens": 3})


def test_process_must_follow_schedule_order():
    sched, device = make_scheduler(), FakeDevice()
    sched.add(make_seq("a", 3))
    out1 = sched.schedule()
    device.run(out1)
    out2 = sched.schedule()
    with pytest.raises(ValueError, match="oldest"):
        sched.process(out2, device.run(out2))
    with pytest.raises(ValueError, match="no sampled result"):
        sched.process(out1, {})


# ----------------------------------------------------------------------------------------------- admission

def test_fcfs_admission_order():
    sched = make_scheduler(max_num_batched_tokens=16)
    for rid, n in (("a", 3), ("b", 5), ("c", 2)):
        sched.add(make_seq(rid, n))
    out = sched.schedule()
    assert ids(out) == ["a", "b", "c"]
    assert [c.slot for c in out.chunks] == [0, 1, 2]


def test_head_of_line_without_blocks_stops_admission():
    # x takes every block; a (head of line) cannot get one, and b (small) must not skip ahead of it.
    sched, device = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=16, max_model_len=16), FakeDevice()
    sched.add(make_seq("x", 13, max_tokens=3))
    step(sched, device)
    sched.add(make_seq("a", 4))
    sched.add(make_seq("b", 1))
    out, _ = step(sched, device)
    assert ids(out) == ["x"]
    assert [s.request_id for s in sched.waiting] == ["a", "b"]
    out, finished = step(sched, device)  # x reaches max_tokens and frees everything
    assert [s.request_id for s in finished] == ["x"]
    out, _ = step(sched, device)
    assert ids(out) == ["a", "b"]


def test_head_of_line_without_slot_stops_admission():
    sched, device = make_scheduler(num_slots=1), FakeDevice()
    sched.add(make_seq("x", 2, max_tokens=2))
    sched.add(make_seq("a", 2))
    out, _ = step(sched, device)
    assert ids(out) == ["x"]
    out, finished = step(sched, device)
    assert ids(out) == ["x"] and finished[0].finish_reason == "length"
    out, _ = step(sched, device)
    assert ids(out) == ["a"]


def test_max_num_seqs_limits_running():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=16)
    for rid in "abc":
        sched.add(make_seq(rid, 2))
    assert ids(sched.schedule()) == ["a", "b"]
    assert [s.request_id for s in sched.waiting] == ["c"]


# ------------------------------------------------------------------------------------------------ chunking

def test_chunked_prefill_bounds_and_only_last_chunk_samples():
    sched, device = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=8), FakeDevice()
    seq = make_seq("a", 20)
    sched.add(seq)
    chunks = []
    for _ in range(3):
        out, _ = step(sched, device)
        assert out.num_tokens <= 8
        chunks += out.chunks
    assert [(c.start, c.num_tokens, c.sample) for c in chunks] == [(0, 8, False), (8, 8, False), (16, 4, True)]
    for c in chunks:
        assert c.token_ids == tuple(seq.prompt_token_ids[c.start:c.start + c.num_tokens])
        assert len(c.block_table) * 4 >= c.start + c.num_tokens
    assert chunks[-1].output_position == 0
    assert seq.output_token_ids == reference_output(seq, 1)


def test_running_prefill_continues_next_to_new_prompt():
    sched, device = make_scheduler(max_num_batched_tokens=8), FakeDevice()
    sched.add(make_seq("a", 5))
    sched.add(make_seq("b", 6))
    out, _ = step(sched, device)
    assert [(c.request_id, c.num_tokens, c.sample) for c in out.chunks] == [("a", 5, True), ("b", 3, False)]
    out, _ = step(sched, device)  # a decodes (first), b finishes its prompt
    assert [(c.request_id, c.start, c.num_tokens, c.sample) for c in out.chunks] == [
        ("a", 5, 1, True), ("b", 3, 3, True)]


# -------------------------------------------------------------------------------------------------- decode

def test_decode_advances_every_running_sequence_until_length():
    sched, device = make_scheduler(max_num_batched_tokens=16), FakeDevice()
    a, b = make_seq("a", 3, max_tokens=4), make_seq("b", 2, max_tokens=2)
    sched.add(a)
    sched.add(b)
    step(sched, device)
    out, finished = step(sched, device)
    assert [(c.request_id, c.start, c.num_tokens, c.token_ids) for c in out.chunks] == [
        ("a", 3, 1, (a.output_token_ids[0],)), ("b", 2, 1, (b.output_token_ids[0],))]
    assert [c.output_position for c in out.chunks] == [1, 1]
    assert [s.request_id for s in finished] == ["b"] and b.finish_reason == "length"
    while sched.has_unfinished():
        step(sched, device)
    assert a.finish_reason == "length" and a.output_token_ids == reference_output(a, 4)
    assert a.status is SequenceStatus.FINISHED and a.slot is None and a.block_table == []
    assert sched.all_free()


def test_stop_reasons():
    sched, device = make_scheduler(eos_token_id=EOS, max_model_len=8), FakeDevice()
    probe = make_seq("s", 2)
    first = reference_output(probe, 1)[0]
    stop = make_seq("s", 2, max_tokens=9, stop_token_ids=[first])
    eos_seq = Sequence("e", [1, 2], SamplingParams(max_tokens=9, seed=0))
    model_len = make_seq("m", 6, max_tokens=9, ignore_eos=True)
    for seq in (stop, eos_seq, model_len):
        sched.add(seq)
    sched.eos_token_id = reference_output(eos_seq, 1)[0]  # make the model's first token the eos for 'e'
    while sched.has_unfinished():
        step(sched, device)
    assert stop.finish_reason == "stop" and len(stop.output_token_ids) == 1
    assert eos_seq.finish_reason == "stop" and eos_seq.output_token_ids == [sched.eos_token_id]
    assert model_len.finish_reason == "length" and len(model_len) == 8


# ---------------------------------------------------------------------------------------------- preemption

def test_preemption_picks_longest_output_and_puts_it_at_the_head():
    # 4 blocks of 4. 'a' decodes alone for a while, then b and c take the remaining blocks.
    sched, device = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=8, max_model_len=16), FakeDevice()
    a = make_seq("a", 3, max_tokens=12)
    sched.add(a)
    for _ in range(3):
        step(sched, device)  # a: 6 tokens, 3 of them output, 2 blocks
    b, c = make_seq("b", 4, max_tokens=12), make_seq("c", 3, max_tokens=12)
    sched.add(b)
    sched.add(c)
    step(sched, device)  # b, c admitted: all 4 blocks owned
    sched.add(make_seq("d", 1))
    assert sched.block_managers[0].num_free == 0
    while True:
        before = {s.request_id: len(s.output_token_ids) for s in sched.running}
        old_epoch = a.epoch
        out, _ = step(sched, device)
        if out.preempted:
            break
    assert out.preempted == ("a",) and max(before, key=before.get) == "a"
    assert sched.waiting[0] is a and [s.request_id for s in sched.waiting] == ["a", "d"]
    assert a.block_table == [] and a.slot is None and a.num_cached == 0 and a.num_inflight == 0
    assert a.epoch != old_epoch and "a" not in ids(out)
    # It recomputes prompt + generated tokens, samples the next output position, and the tokens are unchanged.
    generated = len(a.output_token_ids)
    while a.status is not SequenceStatus.RUNNING:
        out, _ = step(sched, device)
    recompute = [ch for ch in out.chunks if ch.request_id == "a"][0]
    assert recompute.start == 0 and recompute.token_ids == tuple(a.token_ids[:recompute.num_tokens])
    while sched.has_unfinished():
        step(sched, device)
    assert generated < len(a.output_token_ids) == 12
    for seq in (a, b, c):
        assert seq.output_token_ids == reference_output(seq, len(seq.output_token_ids))
    assert sched.all_free()


def test_stale_epoch_result_is_dropped():
    # 2 blocks: a and b fill them; under ZOS the next schedule preempts b (tie on output -> latest admitted)
    # while b's first result is still in flight.
    sched, device = make_scheduler(num_blocks=2, block_size=4, max_num_seqs=2, max_model_len=8), FakeDevice()
    a, b = make_seq("a", 4), make_seq("b", 4)
    sched.add(a)
    sched.add(b)
    out1 = sched.schedule()
    res1 = device.run(out1)
    out2 = sched.schedule()
    assert out2.preempted == ("b",) and ids(out2) == ["a"] and out2.chunks[0].token_ids == (FROM_DEVICE,)
    finished = sched.process(out1, res1)
    assert finished == [] and b.output_token_ids == [] and a.output_token_ids == reference_output(a, 1)
    sched.check_invariants()
    # b recomputes and samples the dropped position again, with the same token.
    sched.process(out2, device.run(out2))
    while sched.has_unfinished():
        step(sched, device)
    assert b.output_token_ids == reference_output(b, 4) and sched.all_free()


# --------------------------------------------------------------------------------------------------- abort

def test_abort_waiting_request_is_immediate():
    sched = make_scheduler(num_slots=1)
    sched.add(make_seq("a", 2))
    sched.add(make_seq("b", 2))
    sched.schedule()
    seq = sched.abort("b")
    assert seq is not None and seq.finish_reason == "abort" and seq.status is SequenceStatus.FINISHED
    assert not sched.waiting and sched.get("b") is None
    with pytest.raises(KeyError):
        sched.abort("b")
    with pytest.raises(ValueError, match="reason"):
        sched.abort("a", reason="cancelled")


def test_abort_in_flight_waits_for_the_step_then_releases_everything():
    sched, device = make_scheduler(max_num_batched_tokens=16), FakeDevice()
    a, b = make_seq("a", 6), make_seq("b", 3)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert sched.abort("a") is None  # its step is in flight
    assert a.block_table and a.slot is not None and a not in sched.running  # still owned until processed
    sched.check_invariants()
    finished = sched.process(out, device.run(out))
    assert finished == [a] and a.finish_reason == "abort" and a.output_token_ids == []
    assert a.block_table == [] and a.slot is None
    sched.check_invariants()
    assert sched.abort("b") is not None  # nothing in flight: immediate
    assert b.finish_reason == "abort" and b.output_token_ids == reference_output(b, 1)
    assert not sched.has_unfinished() and sched.all_free()


def test_abort_leaves_others_unchanged():
    results = {}
    for abort in (False, True):
        sched, device = make_scheduler(max_num_batched_tokens=16), FakeDevice()
        seqs = [make_seq(r, 3 + i, max_tokens=5) for i, r in enumerate("abc")]
        for s in seqs:
            sched.add(s)
        step(sched, device)
        if abort:
            sched.abort("b")
        while sched.has_unfinished():
            step(sched, device)
        results[abort] = {s.request_id: s.output_token_ids for s in seqs}
        assert sched.all_free()
    assert results[True]["a"] == results[False]["a"] and results[True]["c"] == results[False]["c"]


# --------------------------------------------------------------------------------------- zero-overhead (ZOS)

def test_zos_double_schedule_before_process():
    sched, device = make_scheduler(), FakeDevice()
    a = make_seq("a", 3, max_tokens=3)
    sched.add(a)
    out1 = sched.schedule()
    res1 = device.run(out1)
    out2 = sched.schedule()  # a's first token is still in flight
    (c,) = out2.chunks
    assert (c.start, c.num_tokens, c.token_ids, c.sample, c.output_position) == (3, 1, (FROM_DEVICE,), True, 1)
    assert a.num_inflight == 2 and a.num_cached == 4 and a.reserved_len == 5
    sched.check_invariants()
    res2 = device.run(out2)
    assert sched.process(out1, res1) == []
    out3 = sched.schedule()  # a reaches max_tokens with the in-flight token: nothing more to schedule for it
    (c,) = out3.chunks
    assert (c.start, c.token_ids, c.output_position) == (4, (FROM_DEVICE,), 2)
    res3 = device.run(out3)
    assert sched.process(out2, res2) == []
    assert sched.schedule().is_empty
    assert sched.process(out3, res3) == [a] and a.finish_reason == "length"
    assert a.output_token_ids == reference_output(a, 3)


def run_to_completion(zos: bool, seqs: list[Sequence], **kwargs) -> dict[str, list[int]]:
    """Every request of ``seqs`` to its end (ZOS: processing one step behind); their output tokens."""
    sched, device = make_scheduler(**kwargs), FakeDevice()
    for s in seqs:
        sched.add(s)
    inflight: deque = deque()
    while sched.has_unfinished():
        out = sched.schedule()
        inflight.append((out, device.run(out)))
        if not zos or len(inflight) > 1:
            sched.process(*inflight.popleft())
        sched.check_invariants()
    while inflight:
        sched.process(*inflight.popleft())
    assert sched.all_free()
    return {s.request_id: s.output_token_ids for s in seqs}


def test_zos_on_and_off_give_the_same_tokens():
    def requests():
        return [make_seq(f"r{i}", 2 + 3 * i, max_tokens=3 + i) for i in range(5)]
    kwargs = dict(num_blocks=6, block_size=4, num_slots=3, max_num_seqs=3, max_model_len=24)
    off, on = run_to_completion(False, requests(), **kwargs), run_to_completion(True, requests(), **kwargs)
    assert off == on
    for seq in requests():
        assert on[seq.request_id] == reference_output(seq, seq.params.max_tokens)


def test_ranks_spread_admissions_keep_their_sequences_and_give_the_same_tokens():
    """Two attention ranks: admission goes to the least loaded rank (tokens planned in the step, then blocks held,
    then the lower rank), a sequence keeps its rank and draws blocks and a slot from that rank's pools only, and
    the tokens are the one-rank ones, with ZOS on and off."""
    sched = make_scheduler(max_num_batched_tokens=8, ranks=2)
    for name in "abc":
        sched.add(make_seq(name, 3))
    out = sched.schedule()
    # a: both ranks empty -> 0; b: rank 1 has no tokens planned; c: 3 tokens planned on each, 1 block each -> 0
    assert [(c.request_id, c.rank) for c in out.chunks] == [("a", 0), ("b", 1), ("c", 0)]
    a, b, c = (sched.get(name) for name in "abc")
    assert sched.block_managers[1].owner[b.block_table[0]] == "b" and sched.state_managers[1].owner[b.slot] == "b"
    assert a.slot == 0 and b.slot == 0 and c.slot == 1  # slots (and blocks) are numbered per rank
    sched.check_invariants()

    def requests():
        return [make_seq(f"r{i}", 2 + 3 * i, max_tokens=3 + i) for i in range(6)]
    one = run_to_completion(True, requests(), num_blocks=6, block_size=4, num_slots=3, max_num_seqs=3,
                            max_model_len=24)
    for zos in (True, False):
        kwargs = dict(num_blocks=6, block_size=4, num_slots=2, max_num_seqs=2, max_model_len=24, ranks=2)
        assert run_to_completion(zos, requests(), **kwargs) == one


def test_a_failed_step_finishes_its_requests_with_error_and_frees_them():
    sched, device = make_scheduler(max_num_batched_tokens=16), FakeDevice()
    a, b = make_seq("a", 3, max_tokens=6), make_seq("b", 3, max_tokens=6)
    sched.add(a)
    out1 = sched.schedule()
    res1 = device.run(out1)
    sched.add(b)
    out2 = sched.schedule()  # a decodes from out1's in-flight token, b prefills; this step fails to launch
    assert ids(out2) == ["a", "b"] and out2.chunks[0].token_ids == (FROM_DEVICE,)
    assert sched.fail(out2, "RuntimeError: boom") == [b]  # b is in no other step: released now
    assert b.finish_reason == "error" and b.error == "RuntimeError: boom" and sched.is_aborting("a")
    assert sched.process(out1, res1) == [a] and a.finish_reason == "error" and a.output_token_ids == []
    sched.check_invariants()
    assert sched.all_free() and not sched.has_unfinished()
    with pytest.raises(ValueError, match="not an unprocessed step"):
        sched.fail(out2, "again")
    c = make_seq("c", 2, max_tokens=3)
    sched.add(c)
    while sched.has_unfinished():
        step(sched, device)
    assert c.finish_reason == "length" and c.output_token_ids == reference_output(c, 3)


# -------------------------------------------------------------------------------------------- state machine

class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, lengths, budgets, aborts and failed steps on tiny pools, with and without ZOS."""

    @initialize(num_blocks=st.integers(6, 12), num_slots=st.integers(2, 3), max_num_seqs=st.integers(1, 4),
                max_model_len=st.integers(6, 48), zos=st.booleans(), ranks=st.integers(1, 3))
    def setup(self, num_blocks, num_slots, max_num_seqs, max_model_len, zos, ranks):
        self.max_model_len = min(max_model_len, num_blocks * 4)
        self.sched = make_scheduler(num_blocks=num_blocks, block_size=4, num_slots=num_slots,
                                    max_num_seqs=max_num_seqs, max_num_batched_tokens=8,
                                    max_model_len=self.max_model_len, eos_token_id=EOS, ranks=ranks)
        self.device = FakeDevice()
        self.zos = zos
        self.inflight: deque = deque()
        self.seqs: dict[str, Sequence] = {}
        self.finished: dict[str, str] = {}

    def _record(self, finished):
        for seq in finished:
            assert seq.request_id not in self.finished, f"{seq.request_id} finished twice"
            assert seq.finish_reason in FINISH_REASONS
            self.finished[seq.request_id] = seq.finish_reason

    def _check_output(self, out: SchedulerOutput):
        assert out.num_tokens == sum(c.num_tokens for c in out.chunks)
        for rank in range(self.sched.num_ranks):  # every limit and pool is per rank
            chunks = [c for c in out.chunks if c.rank == rank]
            assert sum(c.num_tokens for c in chunks) <= 8 and len(chunks) <= self.sched.max_num_seqs
            slots = [c.slot for c in chunks]
            assert len(set(slots)) == len(slots)
            blocks = [b for c in chunks for b in c.block_table]
            assert len(set(blocks)) == len(blocks), "two chunks share a block"
        for c in out.chunks:
            assert c.num_tokens >= 1 and len(c.block_table) * 4 >= c.start + c.num_tokens
            assert c.output_position < c.params.max_tokens

    @rule(prompt_len=st.integers(1, 30), max_tokens=st.integers(1, 12), ignore_eos=st.booleans())
    def add(self, prompt_len, max_tokens, ignore_eos):
        rid = f"r{len(self.seqs)}"
        seq = make_seq(rid, min(prompt_len, self.max_model_len), max_tokens=max_tokens, ignore_eos=ignore_eos)
        self.sched.add(seq)
        self.seqs[rid] = seq

    @rule()
    def step(self):
        out = self.sched.schedule()
        self._check_output(out)
        self.inflight.append((out, self.device.run(out)))
        if not self.zos or len(self.inflight) > 1:
            self._record(self.sched.process(*self.inflight.popleft()))

    @rule()
    def fail_step(self):
        """The newest step fails to launch: its requests end with 'error'."""
        out = self.sched.schedule()
        self._check_output(out)
        self._record(self.sched.fail(out, "launch failed"))

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(data=st.data())
    def abort(self, data):
        live = sorted(rid for rid in self.seqs if self.sched.get(rid) is not None)
        rid = data.draw(st.sampled_from(live))
        finished = self.sched.abort(rid)
        if finished is not None:
            self._record([finished])

    @invariant()
    def invariants_hold(self):
        if hasattr(self, "sched"):
            self.sched.check_invariants()

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(5000):
            if not (self.sched.has_unfinished() or self.inflight):
                break
            if self.sched.has_unfinished():
                self.step()
            else:
                self._record(self.sched.process(*self.inflight.popleft()))
            self.sched.check_invariants()
        else:
            raise AssertionError(f"no progress: running {self.sched.running}, waiting {list(self.sched.waiting)}")
        assert self.sched.all_free(), "blocks or slots leaked"
        assert set(self.finished) == set(self.seqs), f"unfinished: {set(self.seqs) - set(self.finished)}"
        for rid, seq in self.seqs.items():
            reason, out = seq.finish_reason, seq.output_token_ids
            assert reason == self.finished[rid] and seq.status is SequenceStatus.FINISHED
            assert out == reference_output(seq, len(out)), f"{rid}: tokens differ from the reference"
            assert len(out) <= seq.params.max_tokens and len(seq) <= self.max_model_len + 1
            if reason == "length":
                assert len(out) == seq.params.max_tokens or len(seq) >= self.max_model_len
            elif reason == "stop":
                assert out[-1] == EOS and not seq.params.ignore_eos
            else:
                assert reason in ("abort", "error")
                assert (seq.error == "launch failed") == (reason == "error")


SchedulerMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=40, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
TestSchedulerMachine = SchedulerMachine.TestCase


def test_invariant_checker_catches_corruption():
    sched = make_scheduler(max_num_batched_tokens=16)
    a, b = make_seq("a", 6), make_seq("b", 6)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.check_invariants()
    a.block_table.append(b.block_table[0])  # a block in two tables
    with pytest.raises(AssertionError, match=r"block \d+ is held by 'a' but owned by 'b'"):
        sched.check_invariants()
    a.block_table.pop()
    leaked = a.block_table.pop()  # owned but in no table
    with pytest.raises(AssertionError, match=f"blocks \\[{leaked}\\] are owned"):
        sched.check_invariants()
    a.block_table.append(leaked)
    a.slot, b.slot = b.slot, b.slot  # one slot, two holders
    with pytest.raises(AssertionError, match=r"slot \d+ is held by"):
        sched.check_invariants()


def test_sequence_tokens_slices_prompt_and_output_without_concatenating():
    seq = Sequence("r", [5, 6, 7], SamplingParams(max_tokens=8))
    seq.output_token_ids.extend([20, 21, 22, 23])
    whole = seq.token_ids
    for start in range(len(whole) + 1):
        for stop in range(start, len(whole) + 2):
            assert seq.tokens(start, stop) == tuple(whole[start:stop]), (start, stop)
