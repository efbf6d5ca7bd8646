"""Launch decode sparse attention once per batch at V4.1-Flash's shapes, for a kernel profiler.

    ncu -k regex:^kernel_mosaic_gpu python3 tools/profile_attn.py 64 256
    python3 tools/profile_attn.py 64 --config "{'engine': 'triton'}"     # SparseAttnConfig fields to change

The inputs are tools/bench_kernels.py's (``sparse_attn_inputs``: 640 rows x 512, 64 heads), in the model's layout
(``attention.attend_lists``: the ring and new rows as one source, the pool as the second from lane ``window``), so
the counters belong to the rows that benchmark times as "window + pool". Each batch runs once (ncu replays what it
profiles).
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dijax  # noqa: E402,F401  (sets XLA flags before JAX starts)
import jax  # noqa: E402

from dijax.kernels import sparse_attn as sa  # noqa: E402
from tools.bench_kernels import sparse_attn_inputs, window_and_pool  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("batches", nargs="+", type=int, help="decode tokens, each >= 1")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--config", default="{}", help="SparseAttnConfig fields to change, as a Python dict")
    args = parser.parse_args()
    if min(args.batches) < 1:
        parser.error(f"batches must be >= 1, got {args.batches}")
    config = sa.SparseAttnConfig(**ast.literal_eval(args.config))
    for batch in args.batches:
        sources, sink, [q], [idx] = sparse_attn_inputs(batch, window=args.window)
        srcs, first = window_and_pool(sources, args.window)
        fn = jax.jit(lambda q, srcs, i, s, f: sa.sparse_attn_pallas(q, srcs, i, s, q.shape[-1] ** -0.5,
                                                                    config=config, first_T=f))
        fn(q, srcs, idx, sink, first).block_until_ready()
        print(f"sparse attention: B={batch}, {idx.shape[1]} rows x {q.shape[-1]}, {q.shape[1]} heads")
    print(config)


if __name__ == "__main__":
    main()
