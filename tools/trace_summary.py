"""Summarise a JAX profiler trace (``perfetto_trace.json.gz``, written by ``tools/bench.py --dump``): the GPU
kernels by name (launches, total and mean device time), the device-busy time against the traced wall span, and so
the share of the step that is launch gaps rather than work. ``--host`` summarises the host threads' events
instead (XLA's own trace annotations: executable launches, command-buffer records and updates, transfers).
``--streams`` summarises every GPU's streams and its collectives (NCCL kernels): their time per step and how much
of it overlaps compute kernels on the same GPU (expert parallelism: are communication and compute overlapped?).
``--graphs`` lines up each CUDA graph launch (the host's ``cuGraphLaunch``) with the kernels the busiest GPU stream
runs after it: how long the host's launch takes, and when the device starts the graph's work (twenty-second
session: the tiny step's first kernel started as the ~1 ms launch ended, so the launch is on the critical path of
a step the host waits for).

    python tools/trace_summary.py gpu-out/dump/decode_B_1_ctx_256 [--steps 3] [--top 25]
    python tools/trace_summary.py gpu-out/dump/engine_zos_on --host --steps 64
    python tools/trace_summary.py gpu-out/dump-ep2/decode_B_64_ctx_4095 --streams
    python tools/trace_summary.py gpu-out/trace-dispatch --graphs
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import gzip
import json
import os
import re


def _load(folder: str) -> list[dict]:
    """Every event of the folder's newest ``perfetto_trace.json.gz``."""
    [path] = sorted(glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True))[-1:]
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def _names(events: list[dict], kind: str) -> dict:
    """Metadata names: ``process_name`` (pid -> name) or ``thread_name`` ((pid, tid) -> name)."""
    return {(e["pid"] if kind == "process_name" else (e["pid"], e["tid"])): e["args"]["name"]
            for e in events if e.get("ph") == "M" and e.get("name") == kind}


def load_events(folder: str) -> tuple[list[dict], dict[int, str]]:
    """The trace's complete events and its process names (pid -> name)."""
    events = _load(folder)
    return [e for e in events if e.get("ph") == "X"], _names(events, "process_name")


def _is_gpu(process: str) -> bool:
    """Whether a trace process (by its name) is a GPU's."""
    return "gpu" in process.lower()


def kernel_family(name: str) -> str:
    """A kernel's name without XLA's numeric suffixes (``loop_add_fusion.12`` -> ``loop_add_fusion``)."""
    return re.sub(r"([._]\d+)+$", "", name)


def busiest_stream(events: list[dict], names: dict[int, str]) -> list[dict]:
    """The GPU kernels of the busiest (pid, tid) line, by start time (one stream's kernels carry the work; the
    device's other lines repeat them as ops / modules), or [] without GPU events."""
    gpu = {pid for pid, name in names.items() if _is_gpu(name)}
    kernels = [e for e in events if e["pid"] in gpu and e.get("dur", 0) > 0]
    busy: collections.Counter = collections.Counter()
    for e in kernels:
        busy[(e["pid"], e["tid"])] += e["dur"]
    if not busy:
        return []
    busiest = busy.most_common(1)[0][0]
    return sorted((e for e in kernels if (e["pid"], e["tid"]) == busiest), key=lambda e: e["ts"])


def summarise(folder: str, steps: int, top: int) -> str:
    events, names = load_events(folder)
    stream = busiest_stream(events, names)
    if not stream:
        return f"{folder}: no GPU events in the trace (processes: {sorted(set(names.values()))})"
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


def summarise_graphs(folder: str) -> str:
    """One row per host ``cuGraphLaunch``: its duration, and the busiest GPU stream's kernels that start from it to
    the next launch (count, first start and last end after the launch's start, busy time); a median row last."""
    events, names = load_events(folder)
    launches = sorted((e for e in events if e["name"].startswith("cuGraphLaunch")), key=lambda e: e["ts"])
    stream = busiest_stream(events, names)
    if not launches or not stream:
        return (f"{folder}: needs host cuGraphLaunch events and GPU kernels ({len(launches)} launches, "
                f"{len(stream)} kernels)")
    lines = [f"{folder}: CUDA graph launches and the kernels after each (us from the launch's start)",
             "| launch | host launch us | kernels | first kernel at | last kernel end at | busy us |",
             "|---|---|---|---|---|---|"]
    starts = [e["ts"] for e in stream]  # sorted: each launch's kernels are one slice of the stream
    rows = []
    for i, launch in enumerate(launches):
        end = launches[i + 1]["ts"] if i + 1 < len(launches) else float("inf")
        after = stream[bisect.bisect_left(starts, launch["ts"]):bisect.bisect_left(starts, end)]
        if not after:
            continue
        rows.append((launch["dur"], len(after), after[0]["ts"] - launch["ts"],
                     max(e["ts"] + e["dur"] for e in after) - launch["ts"], sum(e["dur"] for e in after)))
        lines.append(f"| {i} | " + " | ".join(f"{v:.0f}" for v in rows[-1]) + " |")
    if rows:
        lines.append("| median | " + " | ".join(f"{sorted(col)[len(col) // 2]:.0f}" for col in zip(*rows)) + " |")
    return "\n".join(lines)


COLLECTIVE = re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|collective_permute", re.I)
# the lines of a GPU's process that repeat its kernels as XLA ops / modules rather than run them
_REPEATS = re.compile(r"xla (ops|modules)|steps|launch stats|source|name scope", re.I)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, merged [start, end) intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarise_streams(folder: str, steps: int) -> str:
    """Per GPU: each stream's kernels and busy time per step, then its collective kernels (``COLLECTIVE``): time per
    step, and the part of it during which a compute kernel runs on the same GPU (any stream). Time a collective
    spends beside compute is hidden; the rest is on the step's critical path unless the host is."""
    events = _load(folder)
    processes, threads = _names(events, "process_name"), _names(events, "thread_name")
    lines = [f"{folder}: GPU streams and collectives, per step ({steps} steps)",
             "| GPU | stream | kernels | busy us | collectives | collective us | of it beside compute |",
             "|---|---|---|---|---|---|---|"]
    gpus = sorted(pid for pid, name in processes.items() if _is_gpu(name))
    for pid in gpus:
        kernels = [e for e in events if e.get("ph") == "X" and e["pid"] == pid and e.get("dur", 0) > 0
                   and not _REPEATS.search(threads.get((pid, e["tid"]), ""))]
        compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if not COLLECTIVE.search(e["name"])])
        by_stream: dict[int, list[dict]] = collections.defaultdict(list)
        for e in kernels:
            by_stream[e["tid"]].append(e)
        for tid, stream in sorted(by_stream.items()):
            comm = [e for e in stream if COLLECTIVE.search(e["name"])]
            comm_time = sum(e["dur"] for e in comm)
            hidden = _overlap(_union([(e["ts"], e["ts"] + e["dur"]) for e in comm]), compute)
            share = f"{100 * hidden / comm_time:.0f} %" if comm_time else "-"
            lines.append(f"| {processes[pid][:30]} | {threads.get((pid, tid), tid)} | {len(stream) / steps:.0f} | "
                         f"{sum(e['dur'] for e in stream) / steps:.0f} | {len(comm) / steps:.0f} | "
                         f"{comm_time / steps:.0f} | {share} |")
    if not gpus:
        lines.append(f"(no GPU process in the trace: {sorted(set(processes.values()))})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="trace folders written by tools/bench.py --dump")
    parser.add_argument("--steps", type=int, default=3, help="steps in each trace")
    parser.add_argument("--top", type=int, default=25)
    view = parser.add_mutually_exclusive_group()
    view.add_argument("--host", action="store_true", help="summarise the host threads' events instead")
    view.add_argument("--streams", action="store_true",
                      help="every GPU's streams and its collectives' time beside compute instead")
    view.add_argument("--graphs", action="store_true",
                      help="each CUDA graph launch and when the device starts its kernels instead")
    args = parser.parse_args(argv)
    for folder in args.folders:
        if args.streams:
            print(summarise_streams(folder, args.steps))
        elif args.graphs:
            print(summarise_graphs(folder))
        else:
            print((summarise_host if args.host else summarise)(folder, args.steps, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
