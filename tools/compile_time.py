"""Ahead-of-time compile time of the engine's step for the full DeepSeek-V4.1-Flash layer schedule, from abstract
shapes.

    PYTHONPATH=. python3 tools/compile_time.py                      # decode and prefill buckets, stacked layers
    PYTHONPATH=. python3 tools/compile_time.py --plain --buckets 8x8 # the model alone, unrolled layer loop
    PYTHONPATH=. python3 tools/compile_time.py --engine 8192,256,1048576 --threads 16 --limit 16
                                        # the engine warm-up's buckets (the first 16 of them), 16 at a time
    PYTHONPATH=. python3 tools/compile_time.py --compile-cache /tmp/dijax-cache   # twice: the second run loads

No weights are read or allocated: parameters, cache, batch and Engram constants are ``ShapeDtypeStruct``s (the
batch's host arrays are the warm-up's own), and each bucket is ``.lower(...).compile()`` of the program the engine
runs: ``ModelRunner``'s model step (``compiled_step``: the staged inputs (packed batch, ZOS token remap),
the stacked layers), one device. ``--plain`` instead compiles the model's forward alone with its layers unrolled
(an experiment on layer stacking; the engine never runs it). The config is v41_spec §1 (40 backbone layers; the
3 DSpark stages are not part of the step) except ``engram_vocab_size``: the released 16,000,000 is above what the
on-device hash supports (config validation), so the tables are sized from 100,000 as in tools/bench.py's
flash-slice; table size does not change the compiled program's structure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dijax  # noqa: E402,F401  (sets XLA flags before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from dijax.config import ModelConfig  # noqa: E402
from dijax.cli.options import add_kernels_option  # noqa: E402
from dijax.kernels.options import kernel_options  # noqa: E402
from dijax.model.engram import EngramTables, engram_primes  # noqa: E402
from dijax.model.plan import plan_layers  # noqa: E402
from dijax.model.step import CacheSpec, StepBatch, init_cache  # noqa: E402
from dijax.model.transformer import abstract_state, graphdef  # noqa: E402
from dijax.runtime.compile_cache import enable_compile_cache  # noqa: E402
from dijax.runtime.model_runner import (STEP_COMPILER_OPTIONS, bucket_inputs, compiled_step,  # noqa: E402
                                       engine_buckets)
from dijax.runtime.step_buffers import StepBuffers  # noqa: E402
from dijax.io.loader import ASSETS  # noqa: E402
from tools.bench import add_step_option_argument, apply_step_options  # noqa: E402

FLASH = {
    "vocab_size": 129280, "hidden_size": 5120, "moe_intermediate_size": 2304, "num_hidden_layers": 40,
    "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_lora_rank": 1024,
    "o_groups": 8, "max_position_embeddings": 1048576, "sliding_window": 128,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "n_routed_experts": 384, "num_experts_per_tok": 6, "num_nextn_predict_layers": 3,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
    "engram_layer_ids": [1, 14], "engram_max_ngram_size": 4, "engram_vocab_size": 100000, "engram_n_heads": 8,
    "engram_head_dim": 256, "engram_compressed_vocab_size": 99092, "dspark_target_layer_ids": [37, 38, 39],
}


def flash_config() -> ModelConfig:
    """The V4.1-Flash config above, with Engram table rows derived from its primes."""
    with open(os.path.join(ASSETS, "config.json")) as f:
        raw = json.load(f)
    raw["text_config"].update(FLASH, engram_num_embeddings=[1, 1])
    primes = engram_primes(ModelConfig.from_dict(raw)).reshape(2, -1)
    raw["text_config"]["engram_num_embeddings"] = [int(p.sum()) for p in primes]
    return ModelConfig.from_dict(raw)


def abstract_inputs(cfg: ModelConfig, fold: bool) -> tuple:
    """(parameters, Engram step constants) of ``cfg`` as ``ShapeDtypeStruct``s: nothing allocated."""
    size = cfg.engram_compressed_vocab_size
    token_map = (np.arange(cfg.vocab_size) % size).astype(np.int32)
    consts = EngramTables.from_token_map(cfg, token_map, size).step_consts()
    return abstract_state(cfg, fold=fold), jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), consts)


def lower_bucket(cfg: ModelConfig, params, consts, tokens: int, seqs: int, max_blocks: int, num_blocks: int,
                 block_size: int, fold: bool, options: dict[str, str],
                 platforms: tuple[str, ...] | None = None) -> tuple[jax.stages.Lowered, float]:
    """(the lowered step, lower seconds) of one (tokens x sequences x max_blocks) bucket with the step's kernel
    ``options``: the engine's model step (``compiled_step``) when ``fold``, else the unrolled model alone.
    ``platforms``: lower for these instead of the default backend (tools/kernel_report.py: 'cuda' on a CPU)."""
    spec = CacheSpec(num_blocks=num_blocks, num_slots=seqs, block_size=block_size)
    cache = jax.eval_shape(lambda: init_cache(cfg, spec, fold=fold))
    start = time.perf_counter()
    if fold:
        leaves, tree = jax.tree.flatten(params)
        batch, remap_T = bucket_inputs(tokens, seqs, max_blocks)
        prev_tokens_R = jax.ShapeDtypeStruct((seqs,), jnp.int32)
        step_args = StepBuffers().abstract(batch, remap_T, prev_tokens_R, seqs, cfg.vocab_size)
        step = compiled_step(cfg, tuple(sorted(options.items())), tree)
        traced = step.trace(leaves, cache, step_args[0], consts, None, *step_args[1:])
        return traced.lower(lowering_platforms=platforms), time.perf_counter() - start
    i32 = jnp.int32
    t, s = jax.ShapeDtypeStruct((tokens,), i32), jax.ShapeDtypeStruct((seqs,), i32)
    batch = StepBatch(tokens_T=t, positions_T=t, seq_T=t, valid_T=jax.ShapeDtypeStruct((tokens,), bool),
                      slot_S=s, start_S=s, qlen_S=s,
                      qstart_S=s, block_table_SB=jax.ShapeDtypeStruct((seqs, max_blocks), i32), logit_rows_R=s)

    def step(params, cache, batch, consts):
        return nnx.merge(graphdef(cfg, fold), params)(cache, batch, consts, None, **options)

    lowered = jax.jit(step, donate_argnums=(1,), compiler_options=STEP_COMPILER_OPTIONS).trace(
        params, cache, batch, consts).lower(lowering_platforms=platforms)
    return lowered, time.perf_counter() - start


def compile_bucket(lowered: jax.stages.Lowered) -> tuple[float, float]:
    """(seconds to compile ``lowered``, GB of XLA temporaries of the executable). XLA runs without the GIL, so
    threads compile side by side. The temporaries show what the step allocates beside its parameters and cache, for
    example a per-layer copy of a stacked weight that a scanned layer hands to a kernel."""
    start = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    return seconds, compiled.memory_analysis().temp_size_in_bytes / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buckets", default="64x64,8192x16",
                        help="comma-separated TOKENSxSEQUENCES buckets (default: a decode and a prefill bucket)")
    parser.add_argument("--max-blocks", type=int, default=64, help="block-table width (blocks per sequence)")
    parser.add_argument("--num-blocks", type=int, default=4096, help="paged pool size in blocks")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--plain", action="store_true", help="unrolled layer loop instead of stacked stages")
    parser.add_argument("--engine", metavar="MAX_TOKENS,MAX_SEQS,MAX_MODEL_LEN",
                        help="instead of --buckets and --max-blocks: the (tokens, sequences, width) buckets the "
                             "engine's warm-up compiles for these engine sizes (ModelRunner.buckets)")
    parser.add_argument("--limit", type=int, help="compile only the first LIMIT buckets")
    parser.add_argument("--threads", type=int, default=1,
                        help="compile this many buckets at once, as the engine's warm-up does (one per core; "
                             "the buckets are traced one at a time)")
    add_kernels_option(parser)  # the engine's option
    add_step_option_argument(parser)  # e.g. --step-xla-option xla_gpu_autotune_level=0
    parser.add_argument("--compile-cache", metavar="DIR",
                        help="JAX's persistent compilation cache in DIR (dijax.runtime.compile_cache): a second run "
                             "with the same DIR loads the buckets instead of compiling them")
    args = parser.parse_args()
    apply_step_options(args.step_xla_option)
    if args.compile_cache:
        enable_compile_cache(args.compile_cache)
    options = kernel_options(args.kernels, jax.default_backend())

    cfg = flash_config()
    fold = not args.plain
    stages = plan_layers(cfg, fold)
    print(f"dijax compile time: V4.1-Flash, {cfg.n_layers} layers in {len(stages)} stages "
          f"({sum(s.num_runs for s in stages)} distinct block bodies), {'stacked' if fold else 'plain'}, "
          f"kernels {args.kernels}, XLA options {STEP_COMPILER_OPTIONS}, compile cache "
          f"{args.compile_cache or 'off'}; "
          f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    params, consts = abstract_inputs(cfg, fold)
    if args.engine:
        max_tokens, max_seqs, max_model_len = (int(v) for v in args.engine.split(","))
        plan = engine_buckets(max_tokens, max_seqs, max_model_len, args.block_size)
    else:
        plan = [(*(int(v) for v in spec.split("x")), args.max_blocks) for spec in args.buckets.split(",")]
    print(f"{len(plan)} buckets{f', compiling the first {args.limit}' if args.limit else ''}, "
          f"{args.threads} at a time", flush=True)
    plan = plan[:args.limit]

    # as ModelRunner.warmup: trace here, one bucket after another (tracing holds the GIL), compile in the threads
    start = time.perf_counter()
    total = 0.0
    with ThreadPoolExecutor(args.threads) as pool:
        pending = []
        for tokens, seqs, width in plan:
            lowered, lower_s = lower_bucket(cfg, params, consts, tokens, seqs, width, args.num_blocks,
                                            args.block_size, fold, options)
            pending.append((tokens, seqs, width, lower_s, pool.submit(compile_bucket, lowered)))
            print(f"  traced {len(pending)}/{len(plan)} at {time.perf_counter() - start:6.1f} s", flush=True)
        for tokens, seqs, width, lower_s, future in pending:
            compile_s, temp_gb = future.result()
            total += lower_s + compile_s
            print(f"bucket {tokens:>5} tokens x {seqs:>3} sequences x {width:>5} blocks: lower {lower_s:6.1f} s, "
                  f"compile {compile_s:6.1f} s, temporaries {temp_gb:7.3f} GB", flush=True)
    print(f"total {total:.1f} s of lowering and compiling; wall {time.perf_counter() - start:.1f} s")

if __name__ == "__main__":
    main()
