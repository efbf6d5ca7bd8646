"""The scheduler: turns the waiting and running queues into one plain ``SchedulerOutput`` per step.

One engine iteration (zero-overhead scheduling, ZOS) is::

    out_N = scheduler.schedule()          # decisions from reservations only (num_cached / num_inflight)
    handle_N = runner.execute(out_N)      # asynchronous launch
    scheduler.process(out_{N-1}, handle_{N-1}.wait())   # the only host <- device synchronisation

Without ZOS the engine calls ``process(out_N, ...)`` before the next ``schedule()``; both orders are legal and
produce the same tokens. ``process`` must receive the outputs in the order ``schedule`` made them.

Block and slot reuse across overlapping steps is safe because the device runs steps in order (the cache pytree
is donated from each step to the next), so a block freed while step N is in flight is only written by a later
step after step N is done with it.

Attention ranks (attention data parallelism, dijax.parallel.ranks): the scheduler is given one block manager and
one state manager per rank, all of the same sizes, and every limit (``max_num_seqs``, ``max_num_batched_tokens``)
holds per rank. A sequence is assigned a rank when it is admitted and keeps it while it runs; its blocks and slot
come from that rank's pools. Preemption releases the rank with the blocks and the slot (the recomputation starts
from nothing anyway), so a preempted sequence is placed again, possibly elsewhere, when it is re-admitted. One
rank is the one-device case.
"""

from __future__ import annotations

import functools
import itertools
from collections import deque
from dataclasses import dataclass

from dijax.runtime.block_manager import BlockManager
from dijax.runtime.sampling_params import SamplingParams
from dijax.runtime.sequence import FINISH_REASONS, Sequence, SequenceStatus
from dijax.runtime.state_manager import StateManager

FROM_DEVICE = -1
"""Token id placeholder of a decode input still in flight: gather it from the previous step's sampled output."""


@dataclass(frozen=True)
class ScheduledChunk:
    """One sequence's part of a step.

    request_id       the request; also how the runner finds this sequence's row in the previous step (ZOS remap).
    rank             the attention rank whose pools hold its blocks and slot (0 with one rank).
    slot             its state slot. A chunk with ``start == 0`` must initialise the slot state, not read it
                     (the slot may hold a previous owner's ring / tail / history).
    block_table      its KV blocks, in position order, covering at least ``start + num_tokens`` positions.
    start            position of its first query token (= tokens already cached); positions are
                     ``start .. start + num_tokens - 1``.
    num_tokens       query tokens in this step (>= 1).
    token_ids        the query token ids. A decode whose input is still in flight has ``(FROM_DEVICE,)``: the
                     runner gathers it on device from the row of the previous step that sampled this request.
    sample           whether this chunk's last token produces a sampled token (a prompt's last chunk, decodes).
    epoch            the sequence's epoch now; the sampled result must carry it back to ``process``.
    seed, output_position   key of the sampling noise: (request seed, index of the sampled token in the output).
    params           the request's sampling parameters (temperature, top_k, top_p).
    """

    request_id: str
    slot: int
    block_table: tuple[int, ...]
    start: int
    num_tokens: int
    token_ids: tuple[int, ...]
    sample: bool
    epoch: int
    seed: int
    output_position: int
    params: SamplingParams
    rank: int = 0


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything one step does: its chunks in row order, its total query tokens, and who was preempted.

    step       a counter, increasing by one per ``schedule()`` call.
    chunks     one per sequence in the step (at most ``max_num_seqs`` per rank), decodes first, then prefill chunks.
    num_tokens sum of the chunks' ``num_tokens`` (<= ``max_num_batched_tokens`` per rank).
    preempted  request ids pushed back to the waiting queue while planning this step (their in-flight results,
               if any, are now stale).
    """

    step: int
    chunks: tuple[ScheduledChunk, ...]
    num_tokens: int
    preempted: tuple[str, ...]

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @functools.cached_property
    def sampled_request_ids(self) -> frozenset[str]:
        """Request ids of the sampling chunks (computed on first use, then kept: the next step's in-flight check
        asks it once per decode)."""
        return frozenset(c.request_id for c in self.chunks if c.sample)


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Scheduler.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"Scheduler.{name} must be >= 1, got {value}")
    return value


class Scheduler:
    """FCFS scheduler with chunked prefill, recompute preemption, cancellation and zero-overhead scheduling.

    Queues: ``waiting`` (FCFS deque; owns nothing), ``running`` (admission order; each owns a rank, a slot and the
    blocks covering its cached tokens, both from its rank's pools). A sequence being aborted (or failed) while a
    step that contains it is in flight sits in neither queue until that step is processed; it keeps its blocks and
    slot until then.

    Each step (``schedule``):
      1. every running sequence that is decoding (one token left to feed) gets one token;
      2. running sequences still prefilling (a chunked prompt, or a recompute) continue, in admission order,
         chunked to the remaining token budget;
      3. waiting sequences are admitted FCFS, each on a rank (``_choose_rank``: the least loaded of the ranks it
         fits on), chunked to that rank's remaining budget and free blocks; admission stops at the first one that
         fits on no rank (no slot, no block, no budget, or ``max_num_seqs`` reached on each): no skipping. No
         admission happens in a step that had to preempt (the freed blocks would only be fought over again).
    When a running sequence needs a block and none is free on its rank, the running sequence of that rank with the
    longest output (ties: the most recently admitted) is preempted to the head of the waiting queue and will
    recompute its prompt and generated tokens; repeat until the sequence fits or is itself the one preempted.
    """

    def __init__(self, block_managers: list[BlockManager], state_managers: list[StateManager], max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, eos_token_id: int | None = None):
        """``block_managers`` / ``state_managers``: one per attention rank (a list of one without attention DP), all
        of the same sizes; the other limits hold per rank."""
        for name, managers, kind in (("block_managers", block_managers, BlockManager),
                                     ("state_managers", state_managers, StateManager)):
            if not isinstance(managers, (list, tuple)) or not managers or not all(
                    isinstance(m, kind) for m in managers):
                raise TypeError(f"Scheduler.{name} must be a non-empty list of {kind.__name__}, one per rank, got "
                                f"{managers!r:.80}")
        if len(block_managers) != len(state_managers):
            raise ValueError(f"Scheduler needs one block manager and one state manager per rank, got "
                             f"{len(block_managers)} block managers and {len(state_managers)} state managers")
        for name, managers, sizes in (("block_managers", block_managers, lambda m: (m.num_blocks, m.block_size)),
                                      ("state_managers", state_managers, lambda m: m.num_slots)):
            if len({sizes(m) for m in managers}) > 1:
                raise ValueError(f"Scheduler.{name} must all have the same sizes, got {[sizes(m) for m in managers]}")
        self.max_num_seqs = _check_positive_int("max_num_seqs", max_num_seqs)
        self.max_num_batched_tokens = _check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        self.max_model_len = _check_positive_int("max_model_len", max_model_len)
        # Every running sequence must be able to decode in every step: under ZOS an in-flight input token is
        # gathered from the previous step's output only, so a decode can never be postponed for lack of budget.
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"Scheduler.max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({max_num_seqs}) so every running sequence can decode each step")
        # A sequence alone in the pool must always fit, or preempting it would loop forever.
        if max_model_len > block_managers[0].capacity_tokens:
            raise ValueError(f"Scheduler.max_model_len ({max_model_len}) must be <= the KV pool capacity (of one "
                             f"rank) num_blocks * block_size = {block_managers[0].capacity_tokens}")
        if eos_token_id is not None and (isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int)):
            raise TypeError(f"Scheduler.eos_token_id must be an int or None, got {eos_token_id!r}")
        self.block_managers = list(block_managers)
        self.state_managers = list(state_managers)
        self.num_ranks = len(block_managers)
        self.eos_token_id = eos_token_id

        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._seqs: dict[str, Sequence] = {}      # every live sequence: waiting, running or aborting
        self._aborting: dict[str, Sequence] = {}  # aborted while in flight; released once its steps are processed
        self._pending: deque[SchedulerOutput] = deque()  # scheduled, not yet processed (oldest first)
        # Epochs come from one counter, so a new request reusing a finished request's id can never match a stale
        # result of the old one.
        self._epochs = itertools.count(1)
        self._steps = itertools.count()

    # ----------------------------------------------------------------------------------------------- requests

    def add(self, seq: Sequence) -> None:
        """Queue a new request at the back of the waiting queue (validated first; nothing is queued on error)."""
        if not isinstance(seq, Sequence):
            raise TypeError(f"Scheduler.add expects a Sequence, got {type(seq).__name__}")
        if seq.request_id in self._seqs:
            raise ValueError(f"request_id {seq.request_id!r} is already in the scheduler")
        if seq.status is not SequenceStatus.WAITING or seq.output_token_ids or seq.num_cached or seq.block_table:
            raise ValueError(f"Scheduler.add expects a fresh Sequence, got {seq!r}")
        if seq.num_prompt_tokens == 0:
            raise ValueError(f"request {seq.request_id!r}: the prompt is empty (it needs >= 1 token)")
        if seq.num_prompt_tokens > self.max_model_len:
            raise ValueError(f"request {seq.request_id!r}: the prompt has {seq.num_prompt_tokens} tokens, "
                             f"more than max_model_len = {self.max_model_len}")
        seq.epoch = next(self._epochs)
        self._seqs[seq.request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str, reason: str = "abort") -> Sequence | None:
        """Cancel a live request: it leaves the queues, its epoch is bumped (in-flight results become stale).

        If no unprocessed step contains it, its blocks and slot are released now and the finished sequence is
        returned. Otherwise the in-flight steps are left to finish; the release happens in the ``process`` call
        that handles the last of them, which returns the sequence among its finished ones; this returns None.
        ``reason`` is the finish reason to record; the engine uses "stop" when it matched a stop string, and
        ``fail`` uses "error". Raises KeyError for an id that is not live (the engine checks first).
        """
        if reason not in FINISH_REASONS:
            raise ValueError(f"Scheduler.abort reason must be one of {FINISH_REASONS}, got {reason!r}")
        seq = self._seqs.get(request_id)
        if seq is None:
            raise KeyError(f"Scheduler.abort: no live request {request_id!r}")
        if request_id in self._aborting:
            return None
        seq.epoch = next(self._epochs)
        self._remove_from_queues(seq)
        if self._in_flight(request_id):
            seq.finish_reason = reason
            self._aborting[request_id] = seq
            return None
        return self._finish(seq, reason)

    def fail(self, output: SchedulerOutput, error: str) -> list[Sequence]:
        """Forget an unprocessed step whose launch or run failed: it will never be processed.

        Every request the step computed for (its chunk's epoch is still the sequence's) finishes with reason
        "error" and ``error`` as its ``Sequence.error``; as with ``abort``, one that another unprocessed step still
        contains is released when that step is processed. Requests whose chunk was already stale are unaffected.
        Returns the sequences released now.
        """
        index = next((i for i, out in enumerate(self._pending) if out is output), None)
        if index is None:
            raise ValueError(f"Scheduler.fail: step {output.step} is not an unprocessed step")
        del self._pending[index]
        finished: list[Sequence] = []
        for chunk in output.chunks:
            seq = self._seqs.get(chunk.request_id)
            if seq is not None and seq.epoch == chunk.epoch:
                seq.error = error
                released = self.abort(chunk.request_id, reason="error")
                if released is not None:
                    finished.append(released)
        return finished + self._release_aborted()

    def is_aborting(self, request_id: str) -> bool:
        """Whether the request was aborted (or failed) and waits for an in-flight step before its release."""
        return request_id in self._aborting

    def has_unfinished(self) -> bool:
        """Whether any request is still waiting, running or being aborted."""
        return bool(self._seqs)

    def get(self, request_id: str) -> Sequence | None:
        """The live sequence with this id, or None."""
        return self._seqs.get(request_id)

    def all_free(self) -> bool:
        """Whether every block and every slot of every rank is free."""
        return (all(m.num_free == m.num_blocks for m in self.block_managers)
                and all(m.num_free == m.num_slots for m in self.state_managers))

    # --------------------------------------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Plan the next step from reservations only. May be called again before the last step is processed."""
        planned: dict[str, tuple[Sequence, int]] = {}  # request_id -> (sequence, query tokens), in row order
        preempted: list[str] = []

        def budget(rank: int) -> int:
            return self.max_num_batched_tokens - sum(n for seq, n in planned.values() if seq.rank == rank)

        # 1. Decodes: one token per running sequence that has exactly one token left to feed.
        prefilling = []  # the others, in admission order, for step 2
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if not seq.is_prefill_done:
                prefilling.append(seq)
                continue
            # Its in-flight token will finish the request (max_tokens / max_model_len): nothing more to compute.
            if seq.num_inflight and (seq.output_position >= seq.params.max_tokens
                                     or seq.reserved_len >= self.max_model_len):
                continue
            if self._make_room(seq, 1, planned, preempted):
                planned[seq.request_id] = (seq, 1)

        # 2. Running prefills (chunked prompts and recomputes) continue, in admission order (step 1's decodes only
        # preempt, which takes a sequence out of the running queue: the status check)
        for seq in prefilling:
            if seq.status is not SequenceStatus.RUNNING or budget(seq.rank) == 0:
                continue
            n = min(seq.num_uncached, budget(seq.rank))
            room = self.block_managers[seq.rank].room(seq, seq.num_cached)
            # Take what fits without preempting; with no room at all, ask for exactly one more block.
            n = min(n, room) if room > 0 else min(n, self.block_managers[seq.rank].block_size)
            if self._make_room(seq, n, planned, preempted):
                planned[seq.request_id] = (seq, n)

        # 3. Admission, FCFS with no skipping.
        while not preempted and self.waiting:
            seq = self.waiting[0]
            placed = self._choose_rank(seq, budget)
            if placed is None:
                break
            seq.rank, n = placed
            self.waiting.popleft()
            self.state_managers[seq.rank].allocate(seq)
            self.block_managers[seq.rank].allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            planned[seq.request_id] = (seq, n)

        previous = self._pending[-1] if self._pending else None
        chunks = tuple(self._emit(seq, n, previous) for seq, n in planned.values())
        output = SchedulerOutput(step=next(self._steps), chunks=chunks, num_tokens=sum(c.num_tokens for c in chunks),
                                 preempted=tuple(preempted))
        self._pending.append(output)
        return output

    def _choose_rank(self, seq: Sequence, budget) -> tuple[int, int] | None:
        """Where to admit ``seq``: (rank, tokens of its first chunk there), or None when it fits on no rank.

        A rank can take it with a free slot, fewer than ``max_num_seqs`` running, token budget (``budget(rank)``)
        and block room left. Of those, the least loaded: the fewest query tokens already planned on it in this
        step (its decodes and chunks: the step's token bucket is the busiest rank's), then the fewest blocks held,
        then the lowest rank.
        """
        best = None
        for rank in range(self.num_ranks):
            blocks = self.block_managers[rank]
            if (sum(s.rank == rank for s in self.running) >= self.max_num_seqs
                    or not self.state_managers[rank].can_allocate()):
                continue
            n = min(seq.num_uncached, budget(rank), blocks.room(seq, 0))
            load = (self.max_num_batched_tokens - budget(rank), blocks.num_blocks - blocks.num_free, rank)
            if n > 0 and (best is None or load < best[0]):
                best = (load, rank, n)
        return None if best is None else best[1:]

    def _make_room(self, seq: Sequence, n: int, planned: dict, preempted: list[str]) -> bool:
        """Make ``seq``'s table cover ``num_cached + n`` positions, preempting longest outputs of its rank while its
        rank's blocks lack.

        Returns False when ``seq`` itself was preempted.
        """
        up_to = seq.num_cached + n
        blocks = self.block_managers[seq.rank]
        while not blocks.can_allocate(seq, up_to):
            # Longest output first; ties go to the most recently admitted (the back of the running list).
            victim = max(((i, s) for i, s in enumerate(self.running) if s.rank == seq.rank),
                         key=lambda item: (len(item[1].output_token_ids), item[0]))[1]
            self._preempt(victim)
            planned.pop(victim.request_id, None)
            preempted.append(victim.request_id)
            if victim is seq:
                return False
        blocks.allocate(seq, up_to)
        return True

    def _emit(self, seq: Sequence, n: int, previous: SchedulerOutput | None) -> ScheduledChunk:
        """Describe ``seq``'s chunk of ``n`` tokens and advance its reservations (num_cached, num_inflight)."""
        start = seq.num_cached
        if start < len(seq):
            token_ids = seq.tokens(start, start + n)
            assert len(token_ids) == n, f"{seq!r}: chunk of {n} tokens runs past the known tokens"
        else:
            # Its input was sampled by the previous step and is not on the host yet.
            assert n == 1 and seq.num_inflight > 0, f"{seq!r}: only a decode may read an in-flight token"
            assert previous is not None and seq.request_id in previous.sampled_request_ids, (
                f"{seq!r}: in-flight input must come from the previous step")
            token_ids = (FROM_DEVICE,)
        sample = start + n == seq.reserved_len
        chunk = ScheduledChunk(request_id=seq.request_id, slot=seq.slot, block_table=tuple(seq.block_table),
                               start=start, num_tokens=n, token_ids=token_ids, sample=sample, epoch=seq.epoch,
                               seed=seq.seed, output_position=seq.output_position, params=seq.params,
                               rank=seq.rank)
        seq.num_cached += n
        if sample:
            seq.num_inflight += 1
        return chunk

    # ---------------------------------------------------------------------------------------------- process

    def process(self, output: SchedulerOutput, sampled: dict[str, tuple[int, int]]) -> list[Sequence]:
        """Apply the results of the oldest unprocessed step; return the sequences that finished in this call.

        ``sampled`` maps the request id of every sampling chunk to ``(epoch, token_id)``, the epoch being the
        chunk's. A result whose epoch is not the sequence's current one (it was preempted or aborted since, or it
        finished) is dropped.
        """
        if not self._pending or output is not self._pending[0]:
            expected = self._pending[0].step if self._pending else None
            raise ValueError(f"Scheduler.process got step {output.step}, expected the oldest unprocessed step "
                             f"{expected}")
        self._pending.popleft()
        finished: list[Sequence] = []
        for chunk in output.chunks:
            if not chunk.sample:
                continue
            if chunk.request_id not in sampled:
                raise ValueError(f"Scheduler.process: step {output.step} has no sampled result for "
                                 f"{chunk.request_id!r}")
            epoch, token = sampled[chunk.request_id]
            seq = self._seqs.get(chunk.request_id)
            if seq is None or epoch != seq.epoch:
                continue  # stale: the sequence was preempted, aborted or finished after this step was planned
            seq.num_inflight -= 1
            seq.output_token_ids.append(int(token))
            reason = self._stop_reason(seq, int(token))
            if reason is not None:
                self._remove_from_queues(seq)
                finished.append(self._finish(seq, reason))
        return finished + self._release_aborted()

    def _release_aborted(self) -> list[Sequence]:
        """Finish every aborting sequence that no unprocessed step contains any more."""
        finished = []
        for request_id, seq in list(self._aborting.items()):
            if not self._in_flight(request_id):
                del self._aborting[request_id]
                finished.append(self._finish(seq, seq.finish_reason))
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token == self.eos_token_id and not params.ignore_eos:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    # ------------------------------------------------------------------------------------ resource lifetimes

    def _release(self, seq: Sequence) -> None:
        """The one place blocks and slots are given back: always both, always together, with the rank."""
        if seq.rank is not None:
            self.block_managers[seq.rank].free(seq)
            self.state_managers[seq.rank].free(seq)
        seq.rank = None

    def _preempt(self, seq: Sequence) -> None:
        """Push a running sequence back to the head of the waiting queue; it will recompute all its tokens."""
        self._release(seq)
        self.running.remove(seq)
        seq.epoch = next(self._epochs)  # its in-flight results are now stale
        seq.num_cached = 0
        seq.num_inflight = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: str) -> Sequence:
        """Release a sequence that is in no queue any more and mark it finished."""
        self._release(seq)
        del self._seqs[seq.request_id]
        seq.epoch = next(self._epochs)
        seq.num_inflight = 0
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        return seq

    def _remove_from_queues(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _in_flight(self, request_id: str) -> bool:
        """Whether any scheduled-but-unprocessed step contains this request."""
        return any(c.request_id == request_id for out in self._pending for c in out.chunks)

    def check_invariants(self) -> None:
        """Assert the resource and queue invariants (cheap enough for every step in tests / debug mode)."""
        live = list(self._seqs.values())
        for seq in live:
            assert seq.rank is not None or (not seq.block_table and seq.slot is None), (
                f"{seq!r} holds blocks or a slot but no rank")
        for rank in range(self.num_ranks):
            mine = [seq for seq in live if seq.rank == rank]
            self.block_managers[rank].check_invariants(mine)
            self.state_managers[rank].check_invariants(mine)
            running = sum(seq.rank == rank for seq in self.running)
            assert running <= self.max_num_seqs, f"{running} running on rank {rank} > {self.max_num_seqs}"
        ids = [s.request_id for s in self.waiting] + [s.request_id for s in self.running] + list(self._aborting)
        assert len(ids) == len(set(ids)), f"a request is in two queues: {sorted(ids)}"
        assert set(ids) == set(self._seqs), f"queues {sorted(ids)} != live requests {sorted(self._seqs)}"
        for seq in self.waiting:
            assert seq.status is SequenceStatus.WAITING, f"waiting {seq!r} has the wrong status"
            assert not seq.block_table and seq.slot is None and seq.rank is None, f"waiting {seq!r} owns resources"
            assert seq.num_cached == 0 and seq.num_inflight == 0, f"waiting {seq!r} has reservations"
        for seq in self.running:
            assert seq.status is SequenceStatus.RUNNING, f"running {seq!r} has the wrong status"
            assert seq.slot is not None, f"running {seq!r} has no slot"
            assert seq.num_uncached >= 1, f"running {seq!r} has nothing left to feed"
            assert len(seq.block_table) == self.block_managers[seq.rank].blocks_for(seq.num_cached), (
                f"running {seq!r}: {len(seq.block_table)} blocks for {seq.num_cached} cached tokens")
            assert seq.reserved_len <= self.max_model_len + 1, f"running {seq!r} is past max_model_len"
