"""The engine's model step compiled for an NVIDIA H100 or H200 on a machine without a GPU: how many kernels a step
launches, which source lines they come from, and the step's temporary memory, before any device time is spent.

    pip install --no-deps "jax-cuda13-pjrt==X" "jax-cuda13-plugin==X"    # X: this venv's jaxlib; tool-only
    PYTHONPATH=. python3 tools/deviceless.py [--model tiny|flash|flash-slice|flash-stack] [--decode 1,64]
        [--context 256] [--prefill 256] [--kernels auto] [--target h100|h200] [--top 20] [--dump DIR]
        [--step-xla-option NAME=VALUE] [--kernel-setting MODULE.NAME=VALUE]    # A/B by launch count

How: the CUDA PJRT plugin compiles without a device when it is given a compile-only topology whose GPU is described
by a ``GpuTargetConfigProto`` (``target_config``; ``TARGETS`` holds the two cards' figures). The step's arguments
are ``ShapeDtypeStruct``s placed on that topology's device, so ``jit(...).lower(...).compile()`` runs XLA's GPU
compiler for sm_90: every pass it runs on the device (fusion, scheduling, command buffers, buffer assignment)
except the autotuners, which need the device (GEMM fusions take XLA's default tilings, which can change a fusion's
form but rarely the launch count), and CUB's sort, whose scratch size needs the device (XLA warns and emits its own
sort: still one instruction, counted once either way). The kernels take their GPU form
(``dijax.kernels.lowering_for_gpu``) and Pallas' Triton lowering is told it targets compute capability 9.0
(``tools.kernel_report.triton_sm90``); XLA then compiles the Triton kernels itself. Mosaic GPU kernels are chosen
as on an sm_90 device (``fp4_wgmma.available``) and stay MLIR in the executable (the driver would build them when
it loads; tools/mgpu_build.py builds them here).

Checked against the GPU (docs/benchmarks.md, thirty-third session): on one tree the H100's own compile gave 475 /
701 / 734 launches at tiny decode B=1 / 64 and prefill 256, this tool 473 / 701 / 734.

Each row is one engine bucket as tools/bench.py's rows take it (decode: B sequences of ``--context`` cached tokens
and one new token each; prefill: one sequence of N tokens; block size ``--block-size``): the step's launches as
``tools/bench.kernel_launches`` counts them (a ``while`` body once per known trip), the XLA temporaries and the
arguments' bytes (``memory_analysis``), and the compile seconds. ``--top`` lists the launches per source function
of the first row (``tools/hlo_kernels.attribute``). The parameters and the Engram constants are abstract
(``tools/compile_time.abstract_inputs``: no weights are read) and the kernels are chosen by ``--kernels`` alone (the
engine also hands a kernel whose exact scale range a weight leaves to the reference: the weights decide that).

Static counts are not timings: this says what a step is made of; the device says how fast it runs. (Without a GPU
the plugin logs that ``cuInit`` failed, once, as it looks for one: expected here.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin is only a compiler here
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from dijax.cli.options import add_kernels_option  # noqa: E402
from dijax.config import ModelConfig  # noqa: E402
from dijax.kernels import lowering_for_gpu  # noqa: E402
from dijax.kernels.options import kernel_options  # noqa: E402
from dijax.io.loader import ASSETS  # noqa: E402
from dijax.model.step import CacheSpec, init_cache  # noqa: E402
from dijax.runtime import model_runner  # noqa: E402
from dijax.runtime.model_runner import (bucket, bucket_inputs, compiled_step, min_width,  # noqa: E402
                                       width_bucket)
from dijax.runtime.step_buffers import StepBuffers  # noqa: E402
from tools.bench import (PRESETS, _ints, add_step_option_argument, apply_kernel_settings,  # noqa: E402
                         apply_step_options, flash_slice_config, kernel_launches)
from tools.compile_time import abstract_inputs, flash_config  # noqa: E402
from tools.hlo_kernels import attribute, print_counts  # noqa: E402
from tools.kernel_report import triton_sm90  # noqa: E402

# The cards' figures XLA's cost models read (its GpuDeviceInfo), from NVIDIA's published specifications: SMs, clock,
# memory size and bandwidth, L2, and the per-SM shared memory and register files of compute capability 9.0.
TARGETS = {
    "h100": {"name": "NVIDIA H100 80GB HBM3", "memory": 84_942_979_072, "bandwidth": 3_352_320_000_000},
    "h200": {"name": "NVIDIA H200", "memory": 150_754_820_096, "bandwidth": 4_800_000_000_000},
}
SM90 = {"core_count": 132, "clock_rate_ghz": 1.98, "l2_cache_size": 52_428_800, "shared_memory_per_block": 49_152,
        "shared_memory_per_block_optin": 232_448, "shared_memory_per_core": 233_472, "threads_per_block_limit": 1024,
        "threads_per_core_limit": 2048, "threads_per_warp": 32, "registers_per_core_limit": 65_536,
        "registers_per_block_limit": 65_536, "fpus_per_core": 128, "block_dim_limit_x": 2_147_483_647,
        "block_dim_limit_y": 65_535, "block_dim_limit_z": 65_535}
# The CUDA driver and runtime the compile assumes. Without them XLA takes version 0 and its command-buffer pass drops
# the command types that need stream capture (custom calls, cuBLAS: 12.3 and up), so every Mosaic GPU kernel would
# split the step's CUDA graph here, which the GPU's own compile does not do.
CUDA = (13, 0, 0)


def target_config(target: str) -> str:
    """``GpuTargetConfigProto`` text for ``target`` (a ``TARGETS`` key): what the plugin compiles for."""
    card = TARGETS[target]
    fields = dict(SM90, device_memory_size=card["memory"], memory_bandwidth=card["bandwidth"])
    info = "\n".join(f"  {k}: {v}" for k, v in fields.items())
    version = ".".join(map(str, CUDA))
    major, minor, patch = CUDA
    return (f"gpu_device_info {{\n{info}\n  cuda_compute_capability {{ major: 9 minor: 0 }}\n"
            f'  driver_version: "{version}"\n  runtime_version: "{version}"\n}}\n'
            f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 minor: 10 }}\n'
            f'runtime_version {{ major: {major} minor: {minor} patch: {patch} }}\n'
            f'device_description_str: "{card["name"]}"\n')


def compile_only_device(target: str) -> jax.Device:
    """A compile-only CUDA device of one ``target`` card (needs the CUDA plugin, not a GPU)."""
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=target_config(target),
                                                topology="1x1x1")
    except Exception as error:  # noqa: BLE001 - which exception depends on what is missing
        raise SystemExit(f"deviceless: no compile-only CUDA device ({error}); install jax-cuda13-pjrt and "
                         f"jax-cuda13-plugin {jax.__version__} with --no-deps") from None
    return topology.devices[0]


def model_config(name: str) -> ModelConfig:
    """The embedded tiny config, the released V4.1-Flash (``flash``: tools/compile_time.py's 40 layers) or a
    real-dimension preset of tools/bench.py (384 experts)."""
    if name == "tiny":
        return ModelConfig.from_file(os.path.join(ASSETS, "config.json"))
    if name == "flash":
        return flash_config()
    if name not in PRESETS:
        raise SystemExit(f"--model must be one of {('tiny', 'flash', *PRESETS)}, got {name!r}")
    return flash_slice_config(384, name)


def step_bucket(lengths: list[tuple[int, int]], block_size: int) -> tuple[int, int, int, int, int]:
    """(T, S, W, pool blocks, slots) of the step tools/bench.step_runner builds for ``lengths`` ((cached, new)
    tokens per sequence): its runner's buckets (dijax.runtime.model_runner) and cache sizes."""
    max_blocks = -(-max(c + n for c, n in lengths) // block_size)
    tokens = model_runner.token_bucket(sum(n for _, n in lengths))
    rows = min(tokens, bucket(len(lengths), 1))
    width = width_bucket(max_blocks, max_blocks, min_width(block_size, max_blocks))
    return tokens, rows, width, max_blocks * len(lengths), len(lengths)


def lower_step(cfg: ModelConfig, kernels: str, lengths: list[tuple[int, int]], block_size: int,
               device: jax.Device | None = None) -> jax.stages.Lowered:
    """The engine's model step for ``lengths`` (``step_bucket``) lowered in its GPU form with the kernels
    ``kernels`` takes on a GPU: for ``device`` (a compile-only one: ``.compile()`` then runs XLA's GPU compiler), or
    without one for CUDA, its StableHLO only (no CUDA plugin needed: tests/test_deviceless.py)."""
    placed = None if device is None else SingleDeviceSharding(device)
    on_device = lambda tree: jax.tree.map(  # noqa: E731
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), tree)
    params, consts = abstract_inputs(cfg, fold=True)
    leaves, tree = jax.tree.flatten(params)
    tokens, rows, width, num_blocks, slots = step_bucket(lengths, block_size)
    cache = jax.eval_shape(lambda: init_cache(cfg, CacheSpec(num_blocks=num_blocks, num_slots=slots,
                                                             block_size=block_size)))
    batch, remap_T = bucket_inputs(tokens, rows, width)
    prev_tokens = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=placed)
    staged, logits, sampled, sampling = StepBuffers(placed, placed).abstract(batch, remap_T, prev_tokens, rows,
                                                                             cfg.vocab_size)
    step = compiled_step(cfg, tuple(sorted(kernel_options(kernels, "gpu").items())), tree)
    with lowering_for_gpu(), triton_sm90():
        traced = step.trace(on_device(leaves), on_device(cache), staged, on_device(consts), None, logits, sampled,
                            sampling)
        return traced.lower(lowering_platforms=None if device is not None else ("cuda",))


def compile_step(cfg: ModelConfig, kernels: str, lengths: list[tuple[int, int]], block_size: int,
                 device: jax.Device) -> tuple[jax.stages.Compiled, float]:
    """(the engine's model step for ``lengths`` compiled for ``device``, seconds to lower and compile)."""
    start = time.perf_counter()
    compiled = lower_step(cfg, kernels, lengths, block_size, device).compile()
    return compiled, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny",
                        help=f"tiny, flash (the released 40 layers) or a preset of tools/bench.py: "
                             f"{', '.join(PRESETS)}")
    parser.add_argument("--decode", default="1", help="comma-separated decode batch sizes ('' for none)")
    parser.add_argument("--context", type=int, default=256, help="cached tokens of each decode sequence")
    parser.add_argument("--prefill", default="", help="comma-separated prefill lengths (one sequence each)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--target", choices=sorted(TARGETS), default="h100")
    add_kernels_option(parser)  # the engine's option
    add_step_option_argument(parser)  # e.g. xla_gpu_experimental_enable_fusion_block_level_rewriter=True
    parser.add_argument("--kernel-setting", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="a kernel dispatch setting, as tools/bench.py's option; repeatable")
    parser.add_argument("--top", type=int, default=0, help="launches per source function of the first row")
    parser.add_argument("--dump", metavar="DIR", help="write each row's optimised HLO text into DIR")
    args = parser.parse_args(argv)
    apply_step_options(args.step_xla_option)
    apply_kernel_settings(args.kernel_setting)
    device = compile_only_device(args.target)
    cfg = model_config(args.model)
    rows = [(f"decode B={b} ctx={args.context}", [(args.context, 1)] * b) for b in _ints(args.decode, 1)]
    rows += [(f"prefill {n}", [(0, n)]) for n in _ints(args.prefill, 1)]
    if not rows:
        raise SystemExit("deviceless: give --decode or --prefill")
    print(f"dijax deviceless: {args.model}, kernels {args.kernels}, {device.device_kind} (compile only), jax "
          f"{jax.__version__}", flush=True)
    table = ["| step | bucket T x S x W | launches | temporaries MB | arguments MB | compile s |",
             "|---|---|---:|---:|---:|---:|"]
    census = None
    for label, lengths in rows:
        compiled, seconds = compile_step(cfg, args.kernels, lengths, args.block_size, device)
        text = compiled.as_text()
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, label.replace(" ", "_").replace("=", "_") + ".hlo.txt"), "w") as f:
                f.write(text)
        memory = compiled.memory_analysis()
        tokens, seqs, width, _, _ = step_bucket(lengths, args.block_size)
        table.append(f"| {label} | {tokens} x {seqs} x {width} | {kernel_launches(text)} | "
                     f"{memory.temp_size_in_bytes / 1e6:.2f} | {memory.argument_size_in_bytes / 1e6:.1f} | "
                     f"{seconds:.1f} |")
        print(f"-- {table[-1]}", flush=True)
        census = attribute(text) if census is None else census
    print("\n".join(table))
    if args.top:
        print(f"\nlaunches per source function, {rows[0][0]}:")
        print_counts(census, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
