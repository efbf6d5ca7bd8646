"""The step timeline: where the engine's host time goes, step by step, recorded only when asked for.

``LLMEngine(trace_steps=True)`` (or ``LLM(..., trace_steps=True)``) keeps one ``StepRecord`` per ``step()`` call in
``engine.timeline``, a ring of the last ``capacity`` calls; by default ``engine.timeline`` is None and the engine
takes no stamp at all. A record is the call's entry and exit stamps and its host phases, in the order they ran, each
a ``Phase`` (name, the scheduler step it worked on, start, end), every stamp ``time.perf_counter()`` seconds:

  schedule  ``Scheduler.schedule()``: the step planned from reservations.
  inputs    ``ModelRunner.step_inputs``: the step's host arrays (batch, ZOS remap, sampling columns).
  model     dispatch of the model step (which samples its logits), with the host -> device copy of those arrays
            (written into the step's fixed buffers first): it returns once the step is queued, unless the device's
            queue is full.
  tokens    dispatch of the sampled tokens' copy (the queueing of its transfer to the host counts in ``wait``).
  wait      ``StepHandle.wait()``: the host blocked until a launched step's sampled tokens are on it (device ->
            host). The one phase in which the host only waits for the device.
  process   ``Scheduler.process`` and the stop strings: the sampled tokens applied.
  output    the finished requests' ``RequestOutput``s (detokenised), once per call (step None).

Phases are laps: each runs from the end of the one before (the call's entry for the first) to its own stamp, so the
phases of a record tile it and the little bookkeeping between two stamps counts in the later phase. With
zero-overhead scheduling a call launches step n (schedule, inputs, model, tokens of step n) and then waits for and
processes step n-1: ``Phase.step`` says which.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

PHASES = ("schedule", "inputs", "model", "tokens", "wait", "process", "output")


class Phase(NamedTuple):
    """One host phase of an engine step: ``name`` (one of ``PHASES``), the scheduler ``step`` it worked on (None
    for ``output``), ``start`` and ``end`` perf_counter seconds."""

    name: str
    step: int | None
    start: float
    end: float


@dataclass
class StepRecord:
    """One ``LLMEngine.step()`` call: ``start`` / ``end`` perf_counter seconds, its ``phases`` in order, and what it
    launched: the scheduler step (None when it launched nothing) and whether every chunk of it was a decode (one
    token)."""

    start: float
    launched: int | None = None
    decode_only: bool = False
    phases: list[Phase] = field(default_factory=list)

    @property
    def end(self) -> float:
        """Where the call's last phase ended (NaN before its first)."""
        return self.phases[-1].end if self.phases else float("nan")

    def lap(self, name: str, step: int | None) -> None:
        """Close phase ``name`` of scheduler step ``step`` now; it began where the last phase (or the call) ended."""
        now = time.perf_counter()
        self.phases.append(Phase(name, step, self.phases[-1].end if self.phases else self.start, now))

    def seconds(self, name: str) -> float:
        """Total seconds of this call's phases called ``name`` (0 when it had none)."""
        return sum(p.end - p.start for p in self.phases if p.name == name)


class StepTimeline:
    """The last ``capacity`` ``StepRecord``s of an engine, oldest first in ``records``."""

    def __init__(self, capacity: int = 4096):
        self.records: deque[StepRecord] = deque(maxlen=capacity)

    def begin(self) -> StepRecord:
        """Open the record of a ``step()`` call starting now."""
        record = StepRecord(start=time.perf_counter())
        self.records.append(record)
        return record

    def clear(self) -> None:
        """Forget every record (e.g. those of a warm-up run)."""
        self.records.clear()


def summarize(records: list[StepRecord]) -> dict[str, float]:
    """The timeline of a run in a few numbers, from its ``step()`` records (oldest first, at least two):

    ``<phase>_ms``   for each of ``PHASES``, the median milliseconds of that phase per decode call (a call that
                     launched a decode-only step and was followed by another such call: the steady state);
    ``step_ms``      the end-to-end decode step: the median time from the start of such a call to the start of
                     the next (host and device together, whatever overlaps);
    ``wait_share``   the fraction of the run's wall time (first call's start to last call's end) the host spent in
                     ``wait``, blocked on the device;
    ``decode_steps`` how many calls the medians are over.
    """
    if len(records) < 2:
        raise ValueError(f"summarize needs at least two step records, got {len(records)}")
    decode = [(a, b) for a, b in zip(records, records[1:]) if a.decode_only and b.decode_only]
    summary = {f"{name}_ms": float(np.median([a.seconds(name) for a, _ in decode])) * 1e3 if decode else float("nan")
               for name in PHASES}
    summary["step_ms"] = float(np.median([b.start - a.start for a, b in decode])) * 1e3 if decode else float("nan")
    wall = records[-1].end - records[0].start
    summary["wait_share"] = sum(r.seconds("wait") for r in records) / wall
    summary["decode_steps"] = len(decode)
    return summary
