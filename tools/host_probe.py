"""The engine's host work per decode step, without the device: schedule, the step's inputs, and the processing of
sampled tokens, each timed alone (issue 11 item 2: at 64 prompts the tiny engine's ZOS step is host-bound).

    PYTHONPATH=. python3 tools/host_probe.py [--batch 1,64] [--steps 200] [--profile]

B requests of 32 prompt tokens decode as under ZOS, with the model and the sampler left out: step n + 1 is
scheduled and its inputs built (``ModelRunner.step_inputs``, the previous step's handle standing in for the one in
flight) before step n is processed with made-up tokens. Each phase is timed with ``time.perf_counter`` around its
call; the table gives the median milliseconds over the decode steps. ``--profile`` prints the hottest functions
of the three phases (cProfile, internal time) for the last batch size. The engine's own timeline
(``LLMEngine(trace_steps=True)``, tools/bench.py's engine rows) measures the same phases with the device running; on
a CPU backend the device's work then shares the host's cores, so this probe is the cleaner host figure there.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dijax.runtime.llm_engine import LLMEngine  # noqa: E402
from dijax.runtime.model_runner import StepHandle  # noqa: E402
from dijax.runtime.sampling_params import SamplingParams  # noqa: E402
from tools.bench import _counts  # noqa: E402

PHASES = ("schedule", "inputs", "process")


def host_steps(batch: int, steps: int, profiler: cProfile.Profile | None = None) -> dict[str, float]:
    """Median milliseconds of each phase over ``steps`` decode steps of ``batch`` requests (module docstring)."""
    engine = LLMEngine(max_num_seqs=batch, max_num_batched_tokens=batch * 32, max_model_len=steps + 64,
                       block_size=16)
    scheduler, runner = engine.scheduler, engine.runner
    rng = np.random.default_rng(0)
    for i in range(batch):
        prompt = rng.integers(3, engine.cfg.vocab_size, 32).tolist()
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=steps + 8,
                                                          ignore_eos=True, seed=i))
    times = {name: [] for name in PHASES}
    pending: tuple | None = None  # (output, handle) of the step in flight
    for _ in range(steps + 2):
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        output = scheduler.schedule()
        scheduled = time.perf_counter()
        _, sampling, rows = runner.step_inputs(output, pending[1] if pending else None)
        built = time.perf_counter()
        # what the sampler would return: one token per row (rows past the step's are never read)
        handle = StepHandle(output, rows, np.full(runner.num_ranks * runner.max_rows, 7, np.int32))
        if pending is not None:
            done = pending[0]
            scheduler.process(done, {c.request_id: (c.epoch, 7) for c in done.chunks if c.sample})
        processed = time.perf_counter()
        if profiler is not None:
            profiler.disable()
        if all(c.num_tokens == 1 for c in output.chunks) and len(output.chunks) == batch:
            for name, seconds in zip(PHASES, (scheduled - start, built - scheduled, processed - built)):
                times[name].append(seconds)
        pending = (output, handle)
    return {name: float(np.median(v)) * 1e3 for name, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=_counts, default=[1, 64], help="comma list of requests decoding together")
    parser.add_argument("--steps", type=int, default=200, help="decode steps per batch size")
    parser.add_argument("--profile", action="store_true", help="cProfile the three phases of the last batch size")
    args = parser.parse_args(argv)
    rows = {}
    profiler = None
    for batch in args.batch:
        profiler = cProfile.Profile() if args.profile and batch == args.batch[-1] else None
        rows[batch] = host_steps(batch, args.steps, profiler)
    print("| host ms per decode step | " + " | ".join(f"B={b}" for b in rows) + " |")
    print("|---" * (len(rows) + 1) + "|")
    for name in PHASES:
        print(f"| {name} | " + " | ".join(f"{r[name]:.3f}" for r in rows.values()) + " |")
    print("| total | " + " | ".join(f"{sum(r.values()):.3f}" for r in rows.values()) + " |")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
