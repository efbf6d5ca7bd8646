"""Run the routed-experts layer once (after a compiling call) at the flash-slice dimensions, for a profiler.

    ncu -k regex:routed_ --launch-count 2 python3 tools/profile_routed.py 64 ragged
    python3 tools/profile_routed.py 16 gathered "{'gemm_cols': 64}"     # KernelConfig fields to change

The weights, routing and activations are tools/bench_kernels.py's (``routed_experts_inputs``), so the counters
belong to the rows that benchmark times.
"""

from __future__ import annotations

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
    if len(sys.argv) not in (3, 4) or sys.argv[2] not in rx.PATHS:
        sys.exit(f"usage: profile_routed.py TOKENS {{{'|'.join(rx.PATHS)}}} ['{{KernelConfig field: value}}']")
    tokens, path = int(sys.argv[1]), sys.argv[2]
    rx.CONFIG = dataclasses.replace(rx.CONFIG, **(ast.literal_eval(sys.argv[3]) if len(sys.argv) == 4 else {}))
    experts, limit, (x_TD, weights_TX, experts_TX) = routed_experts_inputs(tokens)
    fn = jax.jit(lambda *a: rx.routed_experts(*a, limit, impl="pallas", path=path))
    for _ in range(2):  # the first call compiles
        fn(experts, x_TD, weights_TX, experts_TX).block_until_ready()
    print(f"routed experts: T={tokens}, path {path}, {rx.CONFIG}")


if __name__ == "__main__":
    main()
