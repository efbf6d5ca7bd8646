"""Launch the routed-experts kernels once per T:PATH spec at the flash-slice dimensions, for a kernel profiler.

    ncu -k regex:routed_ python3 tools/profile_routed.py 16:gathered 64:ragged 1024:ragged
    python3 tools/profile_routed.py 64:ragged --config "{'gemm_cols': 64}"     # KernelConfig fields to change

One process for all specs: on the H200 machine (2026-12-02) the first ncu processes after a machine start
profiled a few kernels each before timing out or crashing, later ones crashed (exit 139) at start-up. The inputs are tools/bench_kernels.py's
(``routed_experts_inputs``), so the counters belong to the rows that benchmark times. Each spec runs once: ncu
replays every launch it profiles on its own, so there is no warm-up to skip.
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

from dijax.kernels import routed_experts as rx  # noqa: E402
from tools.bench_kernels import routed_experts_inputs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="+", help=f"TOKENS:PATH, PATH one of {rx.PATHS}")
    parser.add_argument("--config", default="{}", help="KernelConfig fields to change, as a Python dict")
    args = parser.parse_args()
    specs = []
    for spec in args.specs:
        tokens, _, path = spec.partition(":")
        if not tokens.isdigit() or int(tokens) < 1 or path not in rx.PATHS:
            parser.error(f"spec {spec!r}: expected TOKENS:PATH with TOKENS >= 1 and PATH one of {rx.PATHS}")
        specs.append((int(tokens), path))
    rx.CONFIG = dataclasses.replace(rx.CONFIG, **ast.literal_eval(args.config))
    for tokens, path in specs:
        experts, limit, (x_TD, weights_TX, experts_TX) = routed_experts_inputs(tokens)
        fn = jax.jit(lambda *a, p=path: rx.routed_experts(*a, limit, impl="pallas", path=p))
        fn(experts, x_TD, weights_TX, experts_TX).block_until_ready()
        print(f"routed experts: T={tokens}, path {path}")
    print(rx.CONFIG)


if __name__ == "__main__":
    main()
