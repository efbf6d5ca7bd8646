"""Summarise a JAX profiler trace (``perfetto_trace.json.gz``, written by ``tools/bench.py --dump``): the GPU
kernels by name (launches, total and mean device time), the device-busy time against the traced wall span, and so
the share of the step that is launch gaps rather than work. ``--host`` summarises the host threads' events
instead (XLA's own trace annotations: executable launches, command-buffer records and updates, transfers).

    python tools/trace_summary.py gpu-out/dump/decode_B_1_ctx_256 [--steps 3] [--top 25]
    python tools/trace_summary.py gpu-out/dump/engine_zos_on --host --steps 64
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re


def load_events(folder: str) -> tuple[list[dict], dict[int, str]]:
    """The trace's complete events and its process names (pid -> name)."""
    [path] = sorted(glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True))[-1:]
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    return [e for e in events if e.get("ph") == "X"], names


def _is_gpu(process: str) -> bool:
    """Whether a trace process (by its name) is a GPU's."""
    return "gpu" in process.lower()


def kernel_family(name: str) -> str:
    """A kernel's name without XLA's numeric suffixes (``loop_add_fusion.12`` -> ``loop_add_fusion``)."""
    return re.sub(r"([._]\d+)+$", "", name)


def summarise(folder: str, steps: int, top: int) -> str:
    events, names = load_events(folder)
    gpu = {pid for pid, name in names.items() if _is_gpu(name)}
    kernels = [e for e in events if e["pid"] in gpu and e.get("dur", 0) > 0]
    if not kernels:
        return f"{folder}: no GPU events in the trace (processes: {sorted(set(names.values()))})"
    # one stream's kernels carry the work; the device's other lines repeat them as ops / modules
    by_thread = collections.Counter((e["pid"], e["tid"]) for e in kernels)
    busiest = max(by_thread, key=lambda k: sum(e["dur"] for e in kernels if (e["pid"], e["tid"]) == k))
    stream = sorted((e for e in kernels if (e["pid"], e["tid"]) == busiest), key=lambda e: e["ts"])
    span = stream[-1]["ts"] + stream[-1]["dur"] - stream[0]["ts"]
    busy = sum(e["dur"] for e in stream)
    families: dict[str, list[float]] = collections.defaultdict(list)
    for e in stream:
        families[kernel_family(e["name"])].append(e["dur"])
    lines = [f"{folder}: {len(stream) / steps:.0f} kernels per step, device busy {busy / steps:.0f} us of a "
             f"{span / steps:.0f} us span per step ({100 * busy / span:.0f} %), "
             f"mean kernel {busy / len(stream):.1f} us",
             "| kernel | per step | us per step | mean us |", "|---|---|---|---|"]
    ranked = sorted(families.items(), key=lambda kv: -sum(kv[1]))
    for family, durs in ranked[:top]:
        lines.append(f"| {family[:70]} | {len(durs) / steps:.0f} | {sum(durs) / steps:.0f} | "
                     f"{sum(durs) / len(durs):.1f} |")
    return "\n".join(lines)


def summarise_host(folder: str, steps: int, top: int) -> str:
    """The host events (every process that is not a GPU's) by name: count and time per step, mean duration."""
    events, names = load_events(folder)
    host = [e for e in events if not _is_gpu(names.get(e["pid"], ""))]
    families: dict[str, list[float]] = collections.defaultdict(list)
    for e in host:
        families[kernel_family(e["name"])].append(e.get("dur", 0))
    lines = [f"{folder}: host events per step ({steps} steps)", "| host event | per step | us per step | mean us |",
             "|---|---|---|---|"]
    for family, durs in sorted(families.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"| {family[:70]} | {len(durs) / steps:.1f} | {sum(durs) / steps:.0f} | "
                     f"{sum(durs) / len(durs):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="trace folders written by tools/bench.py --dump")
    parser.add_argument("--steps", type=int, default=3, help="steps in each trace")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--host", action="store_true", help="summarise the host threads' events instead")
    args = parser.parse_args(argv)
    for folder in args.folders:
        print((summarise_host if args.host else summarise)(folder, args.steps, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
