"""Every Pallas (Triton) kernel of a model step, built for the H200 on a machine without a GPU: lowering and
ptxas errors, registers, spills, shared memory and the SASS instruction mix, before any device time is spent.

    pip install triton==3.6.0          # the GPU machine's version; not a dijax dependency (it brings ptxas)
    PYTHONPATH=. python3 tools/kernel_report.py                          # V4.1-Flash, decode 64 x 64, prefill 1024
    PYTHONPATH=. python3 tools/kernel_report.py --buckets 1x1x8 --sass-top 12 --keep /tmp/kernels
    PYTHONPATH=. python3 tools/kernel_report.py --buckets 1x1x8 --kernel-setting fp8_linear.CONFIG.depth=128

The step (tools/compile_time.py's abstract 40-layer V4.1-Flash config, the engine's ``compiled_step``) is lowered
for CUDA with every kernel on (``dijax.kernels.lowering_for_gpu``; Pallas reads the compute capability from an
abstract sm_90 device here). Each distinct Triton module the lowering produces is compiled with the ``triton``
package for sm_90 (``num_warps`` / ``num_stages`` as the kernel asks), its PTX assembled by ptxas -v, and its SASS
read by cuobjdump. XLA compiles the same Triton IR with its own copy of Triton on the device, so a kernel that
fails here will fail there; one that passes here can still differ there in scheduling (not in legality).

The build column is this host's seconds for Triton's pipeline and ptxas: a kernel's share of the step's compile
time (the first kernel's build includes Triton's start-up, ~10 s here; the twenty-first session found the
Sinkhorn kernel's unrolled rounds at 25-31 s a build on this 2-core host, 1.5 s as a loop).

Static counts are not timings: they show what a kernel's code is made of (tensor-core instructions and of which
kind, conversions, barriers, spills), which says where to look; the device's benchmarks say how fast it is. A
variant's kernels (``--kernel-setting``, as tools/bench.py takes it) can be set beside the default's before a GPU
run: the forty-second session dropped a float16 decode of the fp8 linear on its counts (SASS no shorter, 7x the
barriers; docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dijax  # noqa: E402,F401  (sets XLA flags before JAX starts)
import jax  # noqa: E402
from jax._src.interpreters import mlir  # noqa: E402
from jax._src.pallas.triton import lowering  # noqa: E402
from jax._src.pallas.triton import pallas_call_registration as registration  # noqa: E402

from dijax.kernels import lowering_for_gpu  # noqa: E402
from dijax.kernels.options import kernel_options  # noqa: E402
from tools.bench import apply_kernel_settings  # noqa: E402
from tools.compile_time import abstract_inputs, flash_config, lower_bucket  # noqa: E402

TRITON_CALL = "__gpu$xla.gpu.triton"
# SASS opcode families worth reading apart (the rest are summed as "other")
FAMILIES = {"HGMMA": "wgmma", "HMMA": "mma.sync", "QGMMA": "fp8 wgmma", "FFMA": "fp32", "FMUL": "fp32",
            "FADD": "fp32", "HFMA2": "f16x2", "HMUL2": "f16x2", "HADD2": "f16x2", "F2F": "convert", "F2FP": "convert",
            "I2F": "convert", "F2I": "convert", "LOP3": "int", "SHF": "int", "IMAD": "int", "IADD3": "int",
            "PRMT": "int", "LEA": "int", "LDG": "global load", "STG": "global store", "LDS": "shared load",
            "LDSM": "shared load", "STS": "shared store", "LDL": "spill", "STL": "spill", "BAR": "barrier",
            "SHFL": "shuffle"}


@contextlib.contextmanager
def triton_sm90():
    """Within: Pallas' Triton lowering targets compute capability 9.0 instead of asking the (absent) device."""
    info = registration.gpu_info_lib  # the module the lowering asks (its home moved in jax 0.12.1)
    saved = info.get_gpu_info
    info.get_gpu_info = lambda: info.GpuInfo(gpu_version=None, arch_name="9.0", compute_capability=90)
    try:
        yield
    finally:
        info.get_gpu_info = saved


class TritonCapture:
    """Collects (name, Triton IR text, num_warps, num_stages) of every ``pallas_call`` lowered while active."""

    def __init__(self):
        self.kernels: list[tuple[str, str, int, int]] = []
        self._modules: list[str] = []

    def __enter__(self):
        self._saved = (lowering.lower_jaxpr_to_triton_module, mlir.custom_call)

        def lower_module(*args, **kwargs):
            result = self._saved[0](*args, **kwargs)
            self._modules.append(str(result.module))
            return result

        def custom_call(call_target_name, *args, backend_config=None, **kwargs):
            if call_target_name == TRITON_CALL and self._modules:
                config = backend_config
                self.kernels.append((mlir.ir.StringAttr(config["name"]).value, self._modules.pop(),
                                     mlir.ir.IntegerAttr(config["num_warps"]).value,
                                     mlir.ir.IntegerAttr(config["num_stages"]).value))
            return self._saved[1](call_target_name, *args, backend_config=backend_config, **kwargs)

        lowering.lower_jaxpr_to_triton_module = lower_module
        registration.mlir.custom_call = custom_call
        return self

    def __exit__(self, *exc):
        lowering.lower_jaxpr_to_triton_module, mlir.custom_call = self._saved


def lower_step_kernels(buckets: list[tuple[int, int, int]]) -> list[tuple[str, str, int, int]]:
    """The distinct Triton kernels of the V4.1-Flash step for each (tokens, sequences, max_blocks) bucket."""
    cfg = flash_config()
    params, consts = abstract_inputs(cfg, fold=True)
    options = kernel_options("on", "gpu")
    seen, kernels = set(), []
    with TritonCapture() as capture, triton_sm90(), lowering_for_gpu():
        for tokens, seqs, width in buckets:
            lower_bucket(cfg, params, consts, tokens, seqs, width, num_blocks=4096, block_size=128, fold=True,
                         options=options, platforms=("cuda",))
            for name, text, warps, stages in capture.kernels:
                if (text, warps, stages) not in seen:
                    seen.add((text, warps, stages))
                    kernels.append((f"{name} [{tokens}x{seqs}]", text, warps, stages))
            capture.kernels.clear()
    return kernels


try:
    import triton
    from triton._C.libtriton import ir as triton_ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
except ImportError:  # reported by main(): the lowering half works without it
    triton = None


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def first_stage(path: str, options: dict, target) -> str:
    """The Triton IR at ``path`` after Triton's own first stage (``make_ttir``: inlining, canonicalisation, the
    combine patterns such as ``acc + dot`` into the dot's accumulator, CSE, loop unrolling), as text.

    ``triton.compile`` skips the stage of the file it is given, but XLA runs these passes on a Pallas kernel's IR
    before the rest of the pipeline; compiling the lowering's raw IR counted instructions the GPU build does not
    have (an unfused accumulator add: 16 FADD per K step of the routed experts' GEMM)."""
    backend = CUDABackend(target)
    context = triton_ir.context()
    triton_ir.load_dialects(context)
    backend.load_dialects(context)
    module = triton_ir.parse_mlir_module(path, context)
    module.context = context
    backend.make_ttir(module, {}, backend.parse_options(options), target.arch)
    return str(module)


def build(text: str, warps: int, stages: int, workdir: str, stem: str) -> dict:
    """Compile one Triton module for sm_90 as XLA does (``first_stage``, then the rest of Triton's pipeline):
    registers, spills, shared bytes and the SASS opcode counts."""
    options, target = {"num_warps": warps, "num_stages": stages}, GPUTarget("cuda", 90, 32)
    path = os.path.join(workdir, f"{stem}.ttir")
    with open(path, "w") as f:
        f.write(text)
    text = first_stage(path, options, target)
    with open(path, "w") as f:
        f.write(text)
    kernel = triton.compile(path, target=target, options=options)
    ptx, cubin = os.path.join(workdir, f"{stem}.ptx"), os.path.join(workdir, f"{stem}.cubin")
    with open(ptx, "w") as f:
        f.write(kernel.asm["ptx"])
    with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
    target = re.search(r"\.target\s+(\S+)", kernel.asm["ptx"]).group(1)
    report = subprocess.run([_tool("ptxas"), f"-arch={target}", "-v", ptx, "-o", os.devnull],
                            capture_output=True, text=True, check=True).stderr
    sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    instruction = r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)"  # /*0040*/ [@P0] OPCODE.MODS
    opcodes = collections.Counter(m.group(1).split(".")[0] for m in re.finditer(instruction, sass))
    find = lambda pattern: int(m.group(1)) if (m := re.search(pattern, report)) else 0  # noqa: E731
    return {"registers": find(r"Used (\d+) registers"), "spill_stores": find(r"(\d+) bytes spill stores"),
            "spill_loads": find(r"(\d+) bytes spill loads"), "shared": kernel.metadata.shared, "opcodes": opcodes}


def families(opcodes: collections.Counter) -> dict[str, int]:
    """SASS opcode counts grouped by FAMILIES."""
    out = collections.Counter()
    for op, n in opcodes.items():
        out[FAMILIES.get(op, "other")] += n
    return dict(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buckets", default="64x64x32,1024x1x8",
                        help="comma-separated TOKENSxSEQUENCESxBLOCKS step buckets (block size 128)")
    parser.add_argument("--sass-top", type=int, default=0, help="also list each kernel's N most frequent opcodes")
    parser.add_argument("--keep", help="keep the .ttir / .ptx / .cubin files in this directory")
    parser.add_argument("--kernel-setting", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="a kernel module's constant or CONFIG field for this build (tools/bench.py's)")
    args = parser.parse_args()
    apply_kernel_settings(args.kernel_setting)
    if triton is None:
        sys.exit("kernel_report: needs the triton package (pip install triton==3.6.0, the GPU machine's version)")
    buckets = [tuple(int(v) for v in spec.split("x")) for spec in args.buckets.split(",")]
    if any(len(bucket) != 3 for bucket in buckets):
        raise SystemExit(f"--buckets takes TOKENSxSEQUENCESxBLOCKS triples, got {args.buckets!r}")
    kernels = lower_step_kernels(buckets)
    print(f"{len(kernels)} distinct Triton kernels; jax {jax.__version__}, sm_90")
    workdir = args.keep or tempfile.mkdtemp(prefix="dijax-kernels-")
    os.makedirs(workdir, exist_ok=True)
    columns = ["wgmma", "mma.sync", "fp32", "f16x2", "convert", "int", "global load", "shared load", "shared store",
               "barrier", "spill", "other"]
    print("| kernel | build s | warps | stages | registers | spill bytes (st / ld) | shared KB | "
          + " | ".join(columns) + " | total |")
    print("|---" * (8 + len(columns)) + "|")
    failures, printed = 0, set()
    for i, (name, text, warps, stages) in enumerate(kernels):
        try:
            start = time.perf_counter()
            r = build(text, warps, stages, workdir, f"k{i:02d}")
            seconds = time.perf_counter() - start
        except Exception as exc:  # one kernel's failure must not hide the others
            failures += 1
            print(f"| {name} | | {warps} | {stages} | FAILED: {type(exc).__name__}: {str(exc)[:300]} |")
            continue
        fam = families(r["opcodes"])
        row = (f"{warps} | {stages} | {r['registers']} | {r['spill_stores']} / {r['spill_loads']} | "
               f"{r['shared'] / 1024:.1f} | " + " | ".join(str(fam.get(c, 0)) for c in columns)
               + f" | {sum(r['opcodes'].values())}")
        if (name, row) in printed:  # the same kernel in another layer (its IR differs only in source locations)
            continue
        printed.add((name, row))
        print(f"| {name} | {seconds:.1f} | {row} |")
        if args.sass_top:
            print("    " + ", ".join(f"{op} {n}" for op, n in r["opcodes"].most_common(args.sass_top)))
    print(f"files in {workdir}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
