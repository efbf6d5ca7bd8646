"""Where a step's host dispatch goes (issue 11 item 1): the engine's launches timed apart, and no-op executables
that take the same arguments, so the per-argument cost and the executable's own launch cost show separately.

    PYTHONPATH=. python3 tools/dispatch_probe.py [--model tiny] [--batch 1,32] [--context 256] [--trace DIR]

Each row is the median wall time of the launch call alone (no wait; 50 runs after 5, each followed by a wait
outside the timed span), at the engine's bucket for B decode sequences at the given context (block size 16, a cache
of random values, ``tools/bench.step_runner``; ``--kernels`` as the engine's option):

* ``engine launch``: ``ModelRunner.launch``, what an engine step launches (its inputs staged into their fixed
  buffers, the model step, which samples, writing into the last step's logits and tokens buffers, the tokens'
  copy), the previous step's handle alive as under ZOS; ``, a fresh logits buffer each step``: the same with the
  logits not recycled, so the step's output moves every step, as before the twelfth session (XLA then updates the
  step's CUDA graphs before each replay);
* ``stage``: that launch alone (host inputs; ``placed``: the inputs on the device first);
* ``model step, fixed buffers``: the model step alone on staged inputs, its logits and tokens buffers recycled;
* ``tokens' copy``: the copy of the step's tokens that the host and the next step read;
* ``no-op on the step's arguments``: a jitted function that takes the parameters, the donated cache and the inputs
  and returns the cache: the argument handling alone;
* ``no-op on the parameters`` and ``no-op on one array``: the same with fewer arguments.

``engine, back to back``: 50 engine launches without waiting, one wait at the end (max of host and device per step).
``ZOS: launch while a step runs`` and ``ZOS: per step``: 50 engine launches as the engine makes them under ZOS (step
n + 1 launched, then step n's tokens read): the median launch and the time per step; ``tokens chained``: each
launch's previous tokens are the last launch's sampled tokens, as in the engine. The fifteenth session's run named
the cause of the engine's slow ZOS step (4.0 ms to launch against 1.3 ms without ZOS on the H200, fourteenth
session): the then separate sampler's host arguments, landing at new addresses every step (docs/benchmarks.md).
``--trace DIR`` writes a JAX profiler trace of 10 engine steps of the first batch size launched as under ZOS, tokens
chained (host and device events: ``tools/trace_summary.py DIR --host --steps 10``). ``--step-xla-option`` changes
the step's XLA options (A/B runs of its command buffers: ``tools/gpu_validate.sh dispatch``). First run on the H200
in the eleventh session (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dijax.cli.options import add_kernels_option  # noqa: E402
from dijax.runtime.model_runner import STEP_COMPILER_OPTIONS, ModelRunner  # noqa: E402
from tools.bench import _counts, add_step_option_argument, apply_step_options, load_model, step_runner  # noqa: E402

BLOCK_SIZE = 16


def launch_ms(fn, runs: int = 50, keep_last: bool = True) -> float:
    """Median milliseconds of ``fn()`` alone (the launch), each run waited for outside the timed span.

    ``keep_last``: the previous run's output is still alive during the next launch, as in the engine (ZOS keeps
    step N's results while it launches N + 1); False drops it first, so the allocator can hand the next run the
    same buffers (an executable's CUDA graph then needs no update for them)."""
    for _ in range(5):
        jax.block_until_ready(fn())
    times = []
    out = None
    for _ in range(runs):
        if not keep_last:
            out = None
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
        jax.block_until_ready(out)
    return float(np.median(times)) * 1e3


def probe(runner: ModelRunner, output, inputs: tuple, sampling, rows: dict[str, int]) -> dict[str, float]:
    """The rows of the module docstring for one runner, in milliseconds."""
    leaves = runner.param_leaves
    batch, consts, prev_tokens, remap = inputs
    num_rows, vocab = runner.logit_rows(batch), runner.cfg.vocab_size

    def engine():
        return runner.launch(output, inputs, sampling, rows).tokens_R

    def fresh_logits():
        taken = runner.buffers.logits(num_rows, vocab)  # held through the launch, which so gets a new one
        tokens_R = engine()
        del taken
        return tokens_R

    held = {}  # the model step's own staged inputs and output buffers, taken after the rows that stage

    def model_step():
        if not held:
            held["staged"], held["sampling"] = runner.buffers.stage(batch, remap, prev_tokens, sampling)
            held["logits"] = runner.buffers.logits(num_rows, vocab)
            held["tokens"] = runner.buffers.tokens(prev_tokens.shape[0])
        (held["logits"], held["tokens"]), runner.cache = runner._step(
            leaves, runner.cache, held["staged"], consts, None, held["logits"], held["tokens"],
            held["sampling"].packed_7R)
        return held["tokens"]

    placed_batch, placed_remap, placed_sampling = jax.device_put((batch, remap, sampling))
    take_all = jax.jit(lambda leaves, cache, *rest: (cache, jnp.zeros(())), donate_argnums=(1,))

    def no_op_all():
        runner.cache, zero = take_all(leaves, runner.cache, *inputs)
        return zero

    take_params = jax.jit(lambda leaves: jnp.zeros(()))
    take_one = jax.jit(lambda x: x + 1)
    one = jnp.zeros(())
    rows_ms = [("engine launch", lambda: launch_ms(engine)),
               ("engine launch, a fresh logits buffer each step", lambda: launch_ms(fresh_logits)),
               ("stage", lambda: launch_ms(lambda: runner.buffers.stage(batch, remap, prev_tokens, sampling)[1])),
               ("stage, placed", lambda: launch_ms(lambda: runner.buffers.stage(
                   placed_batch, placed_remap, prev_tokens, placed_sampling)[1])),
               ("model step, fixed buffers", lambda: launch_ms(model_step, keep_last=False)),
               ("tokens' copy", lambda: launch_ms(lambda: runner.buffers.copy(held["tokens"]))),
               ("no-op on the step's arguments", lambda: launch_ms(no_op_all)),
               ("no-op on the parameters", lambda: launch_ms(lambda: take_params(leaves))),
               ("no-op on one array", lambda: launch_ms(lambda: take_one(one)))]
    table = {}
    for name, measure in rows_ms:
        print(f"-- row: {name}", flush=True)  # splits an XLA log of the run by row (gpu_validate.sh dispatch)
        table[name] = measure()
    runner.buffers.recycle(held["logits"], held["tokens"])
    jax.block_until_ready(engine())
    start = time.perf_counter()
    for _ in range(50):
        out = engine()
    jax.block_until_ready(out)
    table["engine, back to back"] = (time.perf_counter() - start) / 50 * 1e3
    for name, chained in (("ZOS", False), ("ZOS, tokens chained", True)):
        print(f"-- row: {name}", flush=True)
        table[f"{name}: launch while a step runs"], table[f"{name}: per step"] = in_flight_ms(
            runner, output, inputs, sampling, rows, chained)
    return table


def in_flight_ms(runner: ModelRunner, output, inputs: tuple, sampling, rows: dict[str, int], chained: bool,
                 runs: int = 50) -> tuple[float, float]:
    """Engine launches as under ZOS: launch step n + 1 while step n runs, then wait for step n's tokens (one step in
    flight, as ``LLMEngine`` keeps). -> (median milliseconds of the launch, issued while the previous step runs;
    milliseconds per step of the whole run). ``chained``: each launch takes the previous launch's sampled tokens as
    its previous tokens, as the engine's ZOS steps do (the staging then reads tokens not yet computed);
    else the same host tokens every time."""
    batch, consts, prev_tokens, remap = inputs
    previous = jax.block_until_ready(runner.launch(output, inputs, sampling, rows).tokens_R)
    times = []
    for i in range(runs + 5):
        if i == 5:
            start = time.perf_counter()
        begin = time.perf_counter()
        step_inputs = (batch, consts, previous if chained else prev_tokens, remap)
        tokens_R = runner.launch(output, step_inputs, sampling, rows).tokens_R
        times.append(time.perf_counter() - begin)
        np.asarray(previous)  # the engine's wait: step n's tokens to the host
        previous = tokens_R
    jax.block_until_ready(previous)
    return float(np.median(times[5:])) * 1e3, (time.perf_counter() - start) / runs * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a tools/bench.py model")
    parser.add_argument("--batch", type=_counts, default=[1, 32], help="comma list of decode batch sizes")
    parser.add_argument("--context", type=int, default=256)
    add_kernels_option(parser)
    parser.add_argument("--trace", help="write a profiler trace of 10 steps of the first batch size here")
    add_step_option_argument(parser)
    args = parser.parse_args(argv)
    apply_step_options(args.step_xla_option)
    cfg, params, consts = load_model(args.model, 384)
    print(f"dispatch probe | {jax.devices()[0].device_kind} | jax {jax.__version__} | model {args.model} | "
          f"kernels {args.kernels} | context {args.context} | block size {BLOCK_SIZE} | step XLA options "
          f"{STEP_COMPILER_OPTIONS}")
    table = {}
    for batch in args.batch:
        runner, output, inputs, sampling, rows = step_runner(cfg, params, consts, [(args.context, 1)] * batch,
                                                             BLOCK_SIZE, args.kernels)
        print(f"B={batch}: {len(runner.param_leaves)} parameter arrays, {len(jax.tree.leaves(runner.cache))} cache "
              f"arrays, {len(jax.tree.leaves(inputs))} input arrays", flush=True)
        table[batch] = probe(runner, output, inputs, sampling, rows)
        if args.trace and batch == args.batch[0]:
            with jax.profiler.trace(args.trace, create_perfetto_trace=True):
                in_flight_ms(runner, output, inputs, sampling, rows, chained=True, runs=5)
        del runner
    print("| launch (ms) | " + " | ".join(f"B={b}" for b in table) + " |")
    print("|---" * (len(table) + 1) + "|")
    for name in next(iter(table.values())):
        print(f"| {name} | " + " | ".join(f"{rows[name]:.3f}" for rows in table.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
