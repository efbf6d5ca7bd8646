"""The Mosaic GPU kernels built for the H200 on a machine without a GPU: ptxas errors, registers and spills, and the
SASS instruction mix, before any device time is spent (tools/kernel_report.py does the same for the Triton kernels;
tools/mgpu_lower.py stops at the lowering).

    pip install --no-deps "jax-cuda13-pjrt==X" "jax-cuda13-plugin==X"    # X: this venv's jaxlib; tool-only
    PYTHONPATH=. python3 tools/mgpu_build.py [--cuda-root /usr/local/cuda-13.0] [--sass-top 10] [--keep DIR]

How: Mosaic GPU compiles a kernel (MLIR -> LLVM -> PTX -> ptxas -> cubin) in the CUDA PJRT plugin's
``MosaicGpuCompile``, which asks the driver for the device first and loads the cubin last. ``tools/cuda_stub.c``,
built here with the host's C compiler and loaded under the soname libcuda.so.1 before the plugin opens the driver,
answers as a compute-capability 9.0 device and accepts the load: nothing runs. The plugin's own dumps
(``MOSAIC_GPU_DUMP_PTX`` / ``_PTXAS``) give each kernel's PTX and ptxas report; ptxas and nvdisasm from
``--cuda-root`` (the H200 image has CUDA 13.0, PTX ISA 9.0: use the same here, so a PTX feature the device's ptxas
refuses fails here too) give the SASS. The kernels and shapes are tools/mgpu_lower.py's.

Static counts are not timings. They show what a kernel is made of: registers (a warp-specialised kernel's
``setmaxnreg`` ceiling), spills, tensor-core instructions, and the integer work of the in-register weight decode.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin is only a compiler here
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from jax.experimental.mosaic.gpu import core  # noqa: E402

from tools import mgpu_lower  # noqa: E402

STUB_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_stub.c")
SASS_GROUPS = ("HGMMA", "LOP3", "SHF", "IMAD", "HMUL2", "PRMT", "LDS", "LDG", "LDGSTS", "STS", "SYNCS", "BAR")


def load_stub(workdir: str) -> None:
    """Build ``cuda_stub.c`` and load it under the soname libcuda.so.1 (the plugin's later dlopen finds it)."""
    path = os.path.join(workdir, "libcuda.so.1")
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("mgpu_build: needs a C compiler (cc or gcc) for the driver stub")
    subprocess.run([compiler, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", path, STUB_SOURCE], check=True)
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def mosaic_compile():
    """The CUDA PJRT plugin's ``MosaicGpuCompile(module_bytes, length) -> handle or NULL``, and its runtime library."""
    try:
        from jax_plugins import xla_cuda13 as plugin
        import jax_cuda13_plugin
    except ImportError as error:
        raise SystemExit(f"mgpu_build: needs jax-cuda13-pjrt and jax-cuda13-plugin {jax.__version__} installed with "
                         f"--no-deps ({error})") from None
    runtime = os.path.join(os.path.dirname(jax_cuda13_plugin.__file__), "libmosaic_gpu_runtime.so")
    fn = ctypes.CDLL(plugin._get_library_path()).MosaicGpuCompile
    fn.argtypes, fn.restype = [ctypes.c_char_p, ctypes.c_int], ctypes.POINTER(ctypes.c_void_p)
    return fn, runtime


def find_tool(name: str, cuda_root: str) -> str | None:
    """``name`` from the CUDA root, PATH, or the triton package's bundled binaries."""
    candidates = [os.path.join(cuda_root, "bin", name), shutil.which(name) or ""]
    try:
        import triton
        candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name))
    except ImportError:
        pass
    return next((c for c in candidates if c and os.path.exists(c)), None)


def sass_counts(ptx_path: str, ptxas: str, nvdisasm: str | None) -> collections.Counter:
    """Opcode counts of the kernel's SASS (its PTX assembled for sm_90a, then disassembled); empty without
    nvdisasm."""
    if nvdisasm is None:
        return collections.Counter()
    cubin = ptx_path.replace(".ptx", ".cubin")
    subprocess.run([ptxas, "-arch=sm_90a", ptx_path, "-o", cubin], check=True, capture_output=True)
    sass = subprocess.run([nvdisasm, "-c", cubin], check=True, capture_output=True, text=True).stdout
    return collections.Counter(m.group(1).split(".")[0]
                               for m in re.finditer(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass,
                                                    re.M))


def compile_quietly(compile_fn, module: bytes, log_path: str) -> tuple[bool, str]:
    """``compile_fn(module)`` with the process's stderr (the plugin's C++ messages, among them its failed attempt to
    disassemble through /usr/local/cuda/bin/nvdisasm) sent to ``log_path``; -> (compiled, the log)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 2)
        try:
            ok = bool(compile_fn(module, len(module)))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    return ok, open(log_path).read()


def build(name: str, lower, dump_root: str, compile_fn, ptxas: str, nvdisasm: str | None) -> list[dict]:
    """Lower one kernel configuration, compile each Mosaic GPU module it holds; -> a row per module."""
    core.KNOWN_KERNELS.clear()
    lower()
    rows = []
    for n, module in enumerate(core.KNOWN_KERNELS.values()):
        dump = os.path.join(dump_root, f"{re.sub(r'[^A-Za-z0-9]+', '_', name)}_{n}")
        os.makedirs(dump, exist_ok=True)
        os.environ["MOSAIC_GPU_DUMP_TO"] = dump
        ok, log = compile_quietly(compile_fn, module, os.path.join(dump, "compile.log"))
        report = "".join(open(p).read() for p in glob.glob(os.path.join(dump, "*.ptxas"))) or log
        registers = re.search(r"Used (\d+) registers", report)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
        ptx = glob.glob(os.path.join(dump, "*.ptx"))
        rows.append(dict(name=name, ok=ok and registers is not None, registers=registers and int(registers[1]),
                         spills=spills and (int(spills[1]), int(spills[2])),
                         sass=sass_counts(ptx[0], ptxas, nvdisasm) if ok and ptx else collections.Counter(),
                         report=report.strip()))
    return rows


def configurations() -> list[tuple[str, object]]:
    """(label, lowering thunk) for every kernel shape tools/mgpu_lower.py lowers."""
    return [(f"{name} {shape}", lambda lower=lower, shape=shape: lower(*shape))
            for name, _, lower, shapes in mgpu_lower.kernels() for shape in shapes]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuda-root", default=os.environ.get("CUDA_ROOT", "/usr/local/cuda"),
                        help="a CUDA toolkit with bin/ptxas (the device's version: 13.0 on the H200 image)")
    parser.add_argument("--nvdisasm", help="nvdisasm to use (default: the CUDA root's, PATH's or triton's)")
    parser.add_argument("--sass-top", type=int, default=10, help="opcodes listed per kernel")
    parser.add_argument("--keep", help="keep the dumps (PTX, ptxas reports, cubins) in this folder")
    parser.add_argument("--only", default="", help="only configurations whose label contains this")
    args = parser.parse_args()
    ptxas = find_tool("ptxas", args.cuda_root)
    if ptxas is None:
        raise SystemExit(f"mgpu_build: no ptxas under {args.cuda_root}/bin or on PATH (--cuda-root)")
    nvdisasm = args.nvdisasm or find_tool("nvdisasm", args.cuda_root)
    cuda_root = os.path.dirname(os.path.dirname(ptxas))
    workdir = args.keep or tempfile.mkdtemp(prefix="mgpu-build-")
    os.makedirs(workdir, exist_ok=True)
    load_stub(workdir)
    compile_fn, runtime = mosaic_compile()
    os.environ.update(MOSAIC_GPU_CUDA_ROOT=cuda_root, MOSAIC_GPU_RUNTIME_LIB_PATH=runtime, MOSAIC_GPU_DUMP_PTX="1",
                      MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_SASS_CTRL="0")
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    print(f"jax {jax.__version__}; ptxas {version}; nvdisasm {'found' if nvdisasm else 'not found (no SASS)'}")
    failed = 0
    for name, lower in configurations():
        if args.only not in name:
            continue
        try:
            rows = build(name, lower, workdir, compile_fn, ptxas, nvdisasm)
        except Exception as error:  # noqa: BLE001 (every configuration is reported)
            failed += 1
            print(f"{name}: FAILED to lower: {type(error).__name__}: {str(error)[-400:]}")
            continue
        for row in rows:
            failed += not row["ok"]
            if not row["ok"]:
                print(f"{name}: FAILED to build: {row['report'][-800:] or 'no ptxas report (see stderr)'}")
                continue
            sass = row["sass"]
            groups = " ".join(f"{g} {sass[g]}" for g in SASS_GROUPS if sass[g])
            print(f"{name}: {row['registers']} registers, spills {row['spills']}, {sum(sass.values())} SASS "
                  f"instructions ({groups})")
            if args.sass_top:
                print("    top: " + ", ".join(f"{op} {n}" for op, n in sass.most_common(args.sass_top)))
    if args.keep:
        print(f"dumps kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
