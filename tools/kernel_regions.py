"""Sum up a Mosaic GPU on-device timeline: where each warpgroup's clocks go, region by region.

A Mosaic GPU kernel compiled with ``CompilerParams(profile_space=..., profile_dir=DIR)`` records, on one thread of
each warpgroup, the SM clock at the start and end of every named region of its code (``jax.named_scope`` in the
kernel body), and each call writes DIR/<kernel>-<ns>-trace.json: Chrome trace events ``ph`` "B" / "E" with ``tid``
one trace (a warpgroup of a CTA), ``pid`` its multiprocessor + 1, and ``ts`` that trace's start (globaltimer, ns)
plus its clock count since its first event, over 1000. So within one trace ``ts`` differences times 1000 are clock
cycles. ``sparse_attn_mgpu`` names its steps when given a ``trace_dir`` (``SparseAttnConfig.mgpu_trace_dir``;
tools/profile_attn.py --trace-dir).

    python3 tools/kernel_regions.py gpu-out/attn-trace [--clock-ghz 1.98]

For each region: how many times a trace enters it (outermost entries only: a region whose name is already open is
part of it), the mean cycles an entry, and its share of the traces' spans (first event to last); "(unmarked)" is
the rest of the span. Multiprocessor clocks are per trace, so only durations, never cross-trace times, are compared.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os

UNMARKED = "(unmarked)"


def newest_trace(folder: str) -> str:
    """The most recently written ``*-trace.json`` of a folder (a file is taken as it is)."""
    if os.path.isfile(folder):
        return folder
    paths = glob.glob(os.path.join(folder, "*-trace.json"))
    if not paths:
        raise FileNotFoundError(f"no *-trace.json in {folder}: was the kernel run with a profile_dir?")
    return max(paths, key=os.path.getmtime)


def load(path: str) -> tuple[str, list[dict]]:
    """(the trace file read, its events): ``path`` itself, or a folder's newest trace (``newest_trace``)."""
    path = newest_trace(path)
    with open(path) as f:
        return path, json.load(f)["traceEvents"]


def summarise(events: list[dict]) -> dict:
    """Per region name: {'entries': mean entries a trace, 'cycles': mean cycles an entry, 'share': share of the
    traces' summed spans}, plus UNMARKED (span not in any region) and 'traces' / 'span' (mean cycles a trace).
    Events are the trace's B / E events (any order across traces; in order within one)."""
    by_trace = collections.defaultdict(list)
    for event in events:
        if event.get("ph") in ("B", "E"):
            by_trace[(event["pid"], event["tid"])].append(event)
    if not by_trace:
        raise ValueError("the trace holds no begin / end events")
    cycles, entries = collections.Counter(), collections.Counter()
    span_total = covered = 0.0
    for trace in by_trace.values():
        trace.sort(key=lambda e: e["ts"])
        open_names: list[tuple[str, float]] = []
        for event in trace:
            if event["ph"] == "B":
                open_names.append((event["name"], event["ts"]))
                continue
            name, begin = open_names.pop()
            if name != event["name"]:
                raise ValueError(f"unbalanced trace: {event['name']!r} ends while {name!r} is open")
            if all(other != name for other, _ in open_names):  # an outermost entry of this name
                cycles[name] += (event["ts"] - begin) * 1e3
                entries[name] += 1
                if not open_names:
                    covered += (event["ts"] - begin) * 1e3
        span_total += (trace[-1]["ts"] - trace[0]["ts"]) * 1e3
    n = len(by_trace)
    out = {name: {"entries": entries[name] / n, "cycles": cycles[name] / entries[name],
                  "share": cycles[name] / span_total if span_total else 0.0} for name in cycles}
    out[UNMARKED] = {"entries": 0.0, "cycles": 0.0, "share": 1 - covered / span_total if span_total else 0.0}
    out["traces"], out["span"] = n, span_total / n
    return out


def table(summary: dict, clock_ghz: float | None = None) -> str:
    """The summary as a markdown table, regions in order of their share (us at ``clock_ghz`` when given)."""
    regions = sorted((k for k in summary if k not in ("traces", "span")), key=lambda k: -summary[k]["share"])
    us = f" | us an entry at {clock_ghz} GHz" if clock_ghz else ""
    lines = [f"{summary['traces']} traces, {summary['span']:.0f} cycles a trace",
             f"| region | entries a trace | cycles an entry{us} | share of the span |",
             "|---|---:|---:|" + ("---:|" if clock_ghz else "") + "---:|"]
    for name in regions:
        row = summary[name]
        time = f" | {row['cycles'] / clock_ghz / 1e3:.2f}" if clock_ghz else ""
        lines.append(f"| {name} | {row['entries']:.1f} | {row['cycles']:.0f}{time} | {100 * row['share']:.1f} % |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="a *-trace.json, or the folder whose newest one to read")
    parser.add_argument("--clock-ghz", type=float, default=None, help="the SM clock, to add microseconds")
    args = parser.parse_args()
    path, events = load(args.path)
    print(path)
    print(table(summarise(events), args.clock_ghz))


if __name__ == "__main__":
    main()
