"""Launch decode sparse attention once per batch at V4.1-Flash's shapes, for a kernel profiler.

    ncu -k regex:^kernel_mosaic_gpu python3 tools/profile_attn.py 64 256
    python3 tools/profile_attn.py 64 --config "{'engine': 'triton'}"     # SparseAttnConfig fields to change
    python3 tools/profile_attn.py 64 256 --trace-dir gpu-out/attn-trace   # each warpgroup's timeline, by step

The inputs are tools/bench_kernels.py's (``sparse_attn_inputs``: 640 rows x 512, 64 heads), in the model's layout
(``attention.attend_lists``: the ring and new rows as one source, the pool as the second from lane ``window``), so
the counters belong to the rows that benchmark times as "window + pool". Each batch runs once (ncu replays what it
profiles). ``--trace-dir``: the Mosaic GPU kernel records where each warpgroup's clocks go, step by step
(``SparseAttnConfig.mgpu_trace_dir``); each batch runs first without the timeline (warming L2 with the same rows)
and then once with it, whose trace is summed up (tools/kernel_regions.py). (Until the fifty-fifth session it ran the
timed kernel twice and summed up a trace Mosaic GPU had written at the first call and kept: its figures are a
first launch's.)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dijax  # noqa: E402,F401  (sets XLA flags before JAX starts)
import jax  # noqa: E402

from dijax.kernels import sparse_attn as sa  # noqa: E402
from dijax.kernels import sparse_attn_mgpu  # noqa: E402
from tools import kernel_regions  # noqa: E402
from tools.bench_kernels import sparse_attn_inputs, window_and_pool  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("batches", nargs="+", type=int, help="decode tokens, each >= 1")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--config", default="{}", help="SparseAttnConfig fields to change, as a Python dict")
    parser.add_argument("--trace-dir", default="", help="record and sum up each warpgroup's timeline, written here")
    parser.add_argument("--clock-ghz", type=float, default=1.98, help="with --trace-dir: the SM clock, for us")
    args = parser.parse_args()
    if min(args.batches) < 1:
        parser.error(f"batches must be >= 1, got {args.batches}")
    config = sa.SparseAttnConfig(**ast.literal_eval(args.config))
    if args.trace_dir and not (config.engine == "mgpu" and sparse_attn_mgpu.available()):
        parser.error("--trace-dir times the Mosaic GPU kernel's steps: it needs engine 'mgpu' on a compute-capability-9 "
                     "GPU")
    for batch in args.batches:
        sources, sink, [q], [idx] = sparse_attn_inputs(batch, window=args.window)
        srcs, first = window_and_pool(sources, args.window)
        trace_dir = os.path.join(args.trace_dir, f"B{batch}") if args.trace_dir else ""
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)
        # with a timeline: the kernel without one first (L2 and the TLBs warmed by the same rows), then once with
        # it: Mosaic GPU writes a kernel's trace once and keeps the first if the same kernel runs again
        runs = [dataclasses.replace(config, mgpu_trace_dir="")] if trace_dir else []
        runs.append(dataclasses.replace(config, mgpu_trace_dir=os.path.abspath(trace_dir) if trace_dir else ""))
        for run_config in runs:
            jax.jit(lambda q, srcs, i, s, f, c=run_config: sa.sparse_attn_pallas(
                q, srcs, i, s, q.shape[-1] ** -0.5, config=c, first_T=f))(q, srcs, idx, sink, first).block_until_ready()
        print(f"sparse attention: B={batch}, {idx.shape[1]} rows x {q.shape[-1]}, {q.shape[1]} heads")
        if trace_dir:
            jax.effects_barrier()  # the timeline is written by a host callback
            _, events = kernel_regions.load(trace_dir)
            print(kernel_regions.table(kernel_regions.summarise(events), args.clock_ghz))
    print(config)


if __name__ == "__main__":
    main()
