"""Which source lines a compiled step's kernels come from: every kernel launched by the entry computation of an
optimised GPU HLO dump (``tools/bench.py --dump`` writes them), attributed through XLA's stack-frame tables to the
innermost frame in the given package, then counted per function (or per line).

    python tools/hlo_kernels.py gpu-out/dump-on/decode_B_1_ctx_256.hlo.txt [--by line] [--top 40]

Only the entry computation's kernels are attributed (a ``while`` body's are not; ``tools/bench.py``'s
``kernel_launches`` counts them per trip); the tiny model's step has no loop, so there the count is the launch count.

``--gemm`` lists the tilings XLA gave its Triton GEMM fusions instead. One tiling for every GEMM of a step, with
16 x 8 output tiles, 2 warps and 1 stage, is XLA's fallback when its autotuner did not run: sessions 7-9 compiled
the step so, and flash-slice decode at batch 64 ran 1.7x slower (docs/benchmarks.md, tenth session).
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


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """The instruction lines of every computation of an HLO text, by name, and the entry computation's name."""
    found: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line) if line and not line.startswith(" ") else None
        if header:
            current = header.group(2)
            found[current] = []
            entry = current if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current and " = " in line:
            found[current].append(line.strip())
    return found, entry


def opcode(instruction: str) -> str:
    """The opcode of one HLO instruction line (``%x = SHAPE opcode(operands), ...``), '' if none. SHAPE may be a
    tuple, ``(f32[8,24]{1,0}, s8[1024]{0})``: the opcode is the first lower-case word after the ' = ' that an
    opening parenthesis follows and a space or the start precedes (a layout's memory space, ``S(1)``, is neither)."""
    rhs = instruction.split(" = ", 1)[1] if " = " in instruction else ""
    found = re.search(r"(?:^|\s)([a-z][\w\-]*)\(", rhs)
    return found.group(1) if found else ""


def attribute(hlo_text: str, package: str = "dijax/", by: str = "function") -> collections.Counter:
    """Kernels of the entry computation per innermost ``package`` frame ('file:function' or 'file:line')."""
    files, functions, locations, frames = _tables(hlo_text.splitlines())
    bodies, entry = computations(hlo_text)

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
    for ins in bodies.get(entry, []):
        if opcode(ins) not in LAUNCHING:
            continue
        ids = [int(i) for i in re.findall(r"stack_frame_id=(\d+)", ins)]
        called = re.search(r"calls=%([\w.\-]+)", ins)
        if called:
            ids += [int(i) for body in bodies.get(called.group(1), [])
                    for i in re.findall(r"stack_frame_id=(\d+)", body)]
        places = collections.Counter(p for p in map(where, ids) if p)
        counts[places.most_common(1)[0][0] if places else f"(no {package} frame)"] += 1
    return counts


def _tiling(config: str) -> str:
    """One GEMM fusion's tiling from its backend_config text: XLA's nested-GEMM form (``output_tiles``) or the older
    ``triton_gemm_config`` form."""
    fields = dict(re.findall(r'"(block_m|block_n|block_k|split_k|num_warps|num_stages)":"?(\d+)', config))
    tiles = re.search(r'"output_tiles":\[\{"sizes":\[([^\]]*)\]', config)
    if tiles:
        shape = "x".join(re.findall(r"\d+", tiles.group(1)))
        head = f"output tiles {shape}"
    elif "block_m" in fields:
        head = (f"blocks {fields['block_m']}x{fields['block_n']}x{fields.get('block_k', '?')}, "
                f"split_k {fields.get('split_k', '1')}")
    else:
        return "(no tiling in its backend_config)"
    return f"{head}, {fields.get('num_warps', '?')} warps, {fields.get('num_stages', '?')} stages"


def gemm_tilings(hlo_text: str) -> collections.Counter:
    """How many Triton GEMM fusions of an optimised GPU HLO dump have each tiling (``_tiling``)."""
    counts: collections.Counter = collections.Counter()
    for line in hlo_text.splitlines():
        if " fusion(" in line and re.search(r'"kind":"__triton_(nested_)?gemm', line):
            counts[_tiling(line[line.index("backend_config"):] if "backend_config" in line else "")] += 1
    return counts


def print_counts(counts: collections.Counter, top: int | None = None) -> None:
    """The ``top`` most common entries of ``counts``, a row each: the count, then the entry."""
    for entry, n in counts.most_common(top):
        print(f"{n:5d}  {entry}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hlo", help="optimised HLO text (tools/bench.py --dump)")
    parser.add_argument("--by", choices=("function", "line"), default="function")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--gemm", action="store_true", help="list the Triton GEMM fusions' tilings instead")
    args = parser.parse_args(argv)
    with open(args.hlo) as f:
        text = f.read()
    if args.gemm:
        tilings = gemm_tilings(text)
        print(f"{sum(tilings.values())} Triton GEMM fusions in {args.hlo}")
        print_counts(tilings)
        return 0
    counts = attribute(text, by=args.by)
    print(f"{sum(counts.values())} kernels in the entry computation of {args.hlo}")
    print_counts(counts, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
