"""Which source lines a compiled step's kernels come from: every kernel launched by the entry computation of an
optimised GPU HLO dump (``tools/bench.py --dump`` writes them), attributed through XLA's stack-frame tables to the
innermost frame in the given package, then counted per function (or per line).

    python tools/hlo_kernels.py gpu-out/dump-on/decode_B_1_ctx_256.hlo.txt [--by line] [--top 40]

Loops are counted once per instruction (a ``while`` body is not multiplied); the step's layer scans are unrolled by
XLA at the tiny model's sizes, so there the count is the launch count.
"""

from __future__ import annotations

import argparse
import collections
import re

LAUNCHING = {"fusion", "custom-call", "copy", "sort", "scatter", "gather", "reduce", "dot", "convolution",
             "dynamic-update-slice", "all-reduce", "all-gather", "reduce-scatter", "all-to-all"}


def _tables(lines: list[str]) -> tuple[dict, dict, dict, dict]:
    """XLA's FileNames, FunctionNames, FileLocations and StackFrames sections, by id."""
    sections: dict[str, dict[int, str]] = collections.defaultdict(dict)
    current = None
    for line in lines:
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = line
        elif current and re.match(r"^\d+ ", line):
            key, value = line.split(" ", 1)
            sections[current][int(key)] = value
        elif current and line.strip() and not re.match(r"^\d+ ", line):
            current = None
    return sections["FileNames"], sections["FunctionNames"], sections["FileLocations"], sections["StackFrames"]


def attribute(hlo_text: str, package: str = "dijax/", by: str = "function") -> collections.Counter:
    """Kernels of the entry computation per innermost ``package`` frame ('file:function' or 'file:line')."""
    lines = hlo_text.splitlines()
    files, functions, locations, frames = _tables(lines)
    computations: dict[str, list[str]] = {}
    entry, current = None, None
    for line in lines:
        header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line) if line and not line.startswith(" ") else None
        if header:
            current = header.group(2)
            computations[current] = []
            entry = current if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current and " = " in line:
            computations[current].append(line.strip())

    def where(frame: int) -> str | None:
        seen = set()
        while frame and frame not in seen:
            seen.add(frame)
            parts = dict(re.findall(r"(\w+)=(\d+)", frames.get(frame, "")))
            loc = dict(re.findall(r"(\w+)=(\d+)", locations.get(int(parts.get("file_location_id", 0)), "")))
            file = files.get(int(loc.get("file_name_id", 0)), "").strip('"')
            if package in file:
                name = file.split(package, 1)[1]
                what = functions.get(int(loc.get("function_name_id", 0)), "").strip('"')
                return f"{name}:{what}" if by == "function" else f"{name}:{loc.get('line')}"
            frame = int(parts.get("parent_frame_id", 0))
        return None

    counts: collections.Counter = collections.Counter()
    for ins in computations.get(entry, []):
        op = re.search(r"=\s*\S+\s+([\w\-]+)\(", ins)
        if not op or op.group(1) not in LAUNCHING:
            continue
        ids = [int(i) for i in re.findall(r"stack_frame_id=(\d+)", ins)]
        called = re.search(r"calls=%([\w.\-]+)", ins)
        if called:
            ids += [int(i) for body in computations.get(called.group(1), [])
                    for i in re.findall(r"stack_frame_id=(\d+)", body)]
        places = collections.Counter(p for p in map(where, ids) if p)
        counts[places.most_common(1)[0][0] if places else f"(no {package} frame)"] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hlo", help="optimised HLO text (tools/bench.py --dump)")
    parser.add_argument("--by", choices=("function", "line"), default="function")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    with open(args.hlo) as f:
        counts = attribute(f.read(), by=args.by)
    print(f"{sum(counts.values())} kernels in the entry computation of {args.hlo}")
    for place, n in counts.most_common(args.top):
        print(f"{n:5d}  {place}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
