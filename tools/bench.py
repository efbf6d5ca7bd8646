"""Benchmarks of the ragged step and of the engine (DESIGN.md "Performance method").

    python tools/bench.py                                   # embedded tiny model: step + engine (CPU or GPU)
    python tools/bench.py --model flash-slice --decode-batch 1,16,64 --context 4096 --prefill 2048
    python tools/bench.py --ep 2                            # experts and Engram rows split over 2 devices
    python tools/bench.py --model flash-slice --kernel-setting topk.SELECT_MIN_VALUES=512   # an A/B run
    python tools/bench.py --model flash-slice --variant "sampler.MANY_ROWS_FILTER='select'" --rounds 2
                                                            # A/B in one process: the model loaded once

Step rows: the step the engine runs (``ModelRunner.launch``: the model step with the ZOS remap, ``forward_step`` and
the sampler, and the small launches around it; no scheduler), a decode step of B sequences at context C or one
prefill of P tokens, median wall time over ``--iters`` runs after ``--warmup`` runs (each run ends in
``jax.block_until_ready``), on a cache filled with random values. Beside it, the step's floor: the larger of bytes /
bandwidth and FLOPs / matrix rate, counted from the parameter shapes and the cache rows the step must read
(``step_cost``), and the fraction of that floor reached. Engine rows: ``LLM.generate`` end to end (scheduler,
runner, sampler) on the same model with ZOS on and off, output tokens per second, each engine's decode-step timeline
against the device-only step at its shape (``--engine-batch 1,64`` runs 1 and 64 prompts in flight).

Models: ``tiny`` (the embedded default, random weights) and ``flash-slice``: DeepSeek-V4.1-Flash's real dimensions
(dim 5120, 64 heads of 512, 384 experts of 2304, vocab 129280, indexer 32x128 top-512, candidates 2048x8, window
128) on 7 layers that cover every layer role, random fp8/MXFP4 codes drawn on the device, a synthetic Engram token
map and Engram tables cut to ~2.4M rows (the lookup reads 24 rows per token whatever the table size).
``flash-stack``: the same with 8 layers, three of them one stacked, scanned run, as the real model's layers run.

Ceilings default to those measured on a machine of the device's kind (``tools/ceilings.py``: an H200 4.3 TB/s
copy and 790 TFLOP/s bf16 matrix product, an H100 3.0 TB/s and 798; other devices get the H200's, and the header
says so); ``--bandwidth`` / ``--flops`` override them.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import functools
import importlib
import json
import os
import pkgutil
import platform
import re
import sys
import time
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

# no memory fraction of the bench's own: issue 11 asks that flash-slice decode at batch 64 run under JAX's default
# (75 % of the GPU, preallocated); XLA_PYTHON_CLIENT_MEM_FRACTION still overrides it
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dijax  # noqa: E402  (sets XLA flags before JAX starts)
import dijax.kernels  # noqa: E402
import dijax.runtime  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dijax.cli.options import add_model_options, apply_ep  # noqa: E402
from dijax.config import ModelConfig  # noqa: E402
from dijax.io.loader import ASSETS  # noqa: E402
from dijax.kernels.options import kernel_options  # noqa: E402
from dijax.parallel.mesh import make_mesh, place_params  # noqa: E402
from dijax.runtime.llm import LLM  # noqa: E402
from dijax.runtime.llm_engine import LLMEngine  # noqa: E402
from dijax.runtime.model_runner import STEP_COMPILER_OPTIONS, ModelRunner, compiled_step  # noqa: E402
from dijax.runtime.sampling_params import SamplingParams  # noqa: E402
from dijax.runtime.step_timeline import PHASES, summarize  # noqa: E402
from tools.ceilings import ceilings  # noqa: E402
from tools.hlo_kernels import LAUNCHING, computations, opcode  # noqa: E402

FLASH_SLICE = {  # v41_spec §1 values; layer roles 0-6 mirror layers 0, 1, 2, 3, 20, 24, 25 of the release
    "vocab_size": 129280, "hidden_size": 5120, "moe_intermediate_size": 2304, "num_hidden_layers": 7,
    "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_lora_rank": 1024,
    "o_groups": 8, "max_position_embeddings": 1048576, "sliding_window": 128,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "n_routed_experts": 384, "num_experts_per_tok": 6,
    "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 0], "kv_source_layer_ids": [2, 4], "index_source_layer_ids": [2, 4, 5],
    "candidate_source_layer_id": 4, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
    "engram_layer_ids": [1, 2], "engram_max_ngram_size": 4, "engram_vocab_size": 100000, "engram_n_heads": 8,
    "engram_head_dim": 256, "engram_compressed_vocab_size": 99092,
    "num_nextn_predict_layers": 1, "dspark_target_layer_ids": [4, 5, 6],
}


# flash-slice with its layers 3-5 one run of like layers (ratio-2 consumers of layer 2), so the step stacks their
# parameters and scans them as the real 40-layer model does (dijax.model.plan), and the kernels read the stacked
# weights in place (dijax.kernels.stacked): 8 layers, about 64 GB of parameters
FLASH_STACK = dict(FLASH_SLICE, num_hidden_layers=8, compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 0],
                   kv_source_layer_ids=[2, 6], index_source_layer_ids=[2, 6], candidate_source_layer_id=6,
                   dspark_target_layer_ids=[5, 6, 7])
PRESETS = {"flash-slice": FLASH_SLICE, "flash-stack": FLASH_STACK}


def flash_slice_config(n_experts: int, preset: str = "flash-slice") -> ModelConfig:
    """A real-dimension preset (``PRESETS``, module docstring) with ``n_experts`` routed experts."""
    from dijax.model.engram import engram_primes

    with open(os.path.join(ASSETS, "config.json")) as f:
        raw = json.load(f)
    raw["text_config"].update(PRESETS[preset], n_routed_experts=n_experts)
    raw["text_config"]["engram_num_embeddings"] = [1, 1]  # placeholder until the primes are known
    primes = engram_primes(ModelConfig.from_dict(raw)).reshape(2, -1)
    raw["text_config"]["engram_num_embeddings"] = [int(p.sum()) for p in primes]
    return ModelConfig.from_dict(raw)


def load_model(name: str, n_experts: int, ep: int = 1):
    """(config, params, step consts) of a benchmark model; ``ep`` > 1 splits its experts and Engram rows over that
    many devices (dijax.parallel.mesh)."""
    from dijax.model.engram import EngramTables
    from dijax.io.random_init import random_codes_params

    if name == "tiny":
        from dijax.io.loader import load

        cfg, params, consts, _ = load(None, 0, ep)
        return cfg, params, consts
    if name not in PRESETS:
        raise ValueError(f"--model must be one of {('tiny', *PRESETS)}, got {name!r}")
    cfg = flash_slice_config(n_experts, name)
    size = cfg.engram_compressed_vocab_size
    token_map = (np.arange(cfg.vocab_size) % size).astype(np.int32)  # synthetic normalisation: timing only
    consts = EngramTables.from_token_map(cfg, token_map, size).step_consts()
    mesh = make_mesh(ep, cfg.n_routed_experts) if ep > 1 else None
    return cfg, place_params(random_codes_params(cfg, seed=0), mesh), consts


@dataclass
class Cost:
    """What one step must move and compute at least."""

    weight_bytes: float
    kv_bytes: float
    flops: float

    def floor_s(self, bandwidth: float, flops_rate: float) -> tuple[float, str]:
        memory, compute = (self.weight_bytes + self.kv_bytes) / bandwidth, self.flops / flops_rate
        return (memory, "memory") if memory >= compute else (compute, "compute")


def _load_peak() -> str:
    """", peak X GB of a Y GB limit" from the first device's allocator (the load's peak: the weight draw's
    temporaries included), or "" where the backend keeps no statistics (CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" not in stats:
        return ""
    return f", peak {stats['peak_bytes_in_use'] / 1e9:.2f} GB of a {stats.get('bytes_limit', 0) / 1e9:.2f} GB limit"


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _elements(tree) -> int:
    """Weight elements of every matrix in ``tree`` (packed fp4 bytes count twice; scales and vectors not)."""
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if x.ndim >= 2 and "scale" not in jax.tree_util.keystr(path):
            total += x.size * (2 if x.dtype == jnp.uint8 else 1)
    return total


def step_cost(cfg: ModelConfig, num_tokens: int, contexts: list[int]) -> Cost:
    """Floor of one step of ``num_tokens`` query tokens over sequences that end at ``contexts``.

    Weights: every non-expert parameter once, the expected number of distinct routed experts under uniform routing
    (E (1 - (1 - X/E)^T) per layer), embedding and Engram rows of the step's tokens, the head. KV reads per
    sequence and layer: its window ring, ``index_topk`` compressed rows for ratio > 0 layers, and the index keys an
    index source scores (all of them, or the candidate blocks above the candidate source). FLOPs: 2 per weight
    element per token on the active weights, plus QK and PV over window + top-k rows and the indexer's scores.
    """
    from dijax.model.param_map import checkpoint_tree
    from dijax.model.transformer import abstract_state

    e, x, t = cfg.n_routed_experts, cfg.n_activated_experts, num_tokens
    distinct = e * (1 - (1 - x / e) ** t)
    weight_bytes = flops = 0.0
    # per-layer shapes by checkpoint name, shapes only: slicing the stacked arrays would copy them
    params = checkpoint_tree(cfg, abstract_state(cfg))
    for lp in params["layers"]:
        experts = lp["ffn"]["experts"]
        rest = {k: v for k, v in lp.items() if k not in ("ffn", "engram")}
        rest["ffn"] = {k: v for k, v in lp["ffn"].items() if k != "experts"}
        if "engram" in lp:
            rest["engram"] = {k: v for k, v in lp["engram"].items() if k != "embed"}
            weight_bytes += t * _nbytes(lp["engram"]["embed"]) / lp["engram"]["embed"]["weight"].shape[0] * (
                cfg.engram_n_heads * (cfg.engram_max_ngram_size - 1))
        weight_bytes += _nbytes(rest) + distinct * _nbytes(experts) / e
        flops += 2 * t * (_elements(rest) + x * _elements(experts) / e)
    head = params["head"]["weight"]
    weight_bytes += _nbytes(head) + t * _nbytes(params["embed"]) / params["embed"]["weight"].shape[0]
    flops += 2 * t * head.size
    kv_bytes = 0.0
    query_tokens = t / max(len(contexts), 1)
    for ctx in contexts:
        for role in cfg.roles:
            rows = min(ctx, cfg.window_size)
            if role.compressed:
                rows += min(cfg.index_topk, ctx // role.ratio)
            kv_bytes += rows * cfg.head_dim * 2
            flops += 2 * 2 * query_tokens * cfg.n_heads * rows * cfg.head_dim
            if role.index_source:
                keys = ctx // role.ratio
                if role.uses_candidates:
                    keys = min(keys, cfg.candidate_topk_blocks * cfg.candidate_block_size)
                kv_bytes += keys * cfg.index_head_dim * 2
                flops += 2 * query_tokens * cfg.index_n_heads * keys * cfg.index_head_dim
    return Cost(weight_bytes, kv_bytes, flops)


def _randomised(cache: dict, seed: int) -> dict:
    """``cache`` with random floating contents (timings on zeros can flatter), Engram history left as is ("no
    history")."""
    leaves, tree = jax.tree.flatten(cache)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating)
              else x for k, x in zip(keys, leaves)]
    return jax.tree.unflatten(tree, leaves)


def kernel_launches(hlo_text: str) -> int:
    """Kernel launches of one run of a compiled GPU executable, counted from its optimised HLO text: every fusion,
    library call (custom-call), copy, sort, scatter and dot of the entry computation (``hlo_kernels.LAUNCHING``),
    each ``while`` body counted as often as its known trip count (1 if unknown), the largest branch of a
    ``conditional``."""
    bodies, entry = computations(hlo_text)

    @functools.lru_cache(maxsize=None)
    def count(name: str) -> int:
        total = 0
        for ins in bodies.get(name, []):
            op = opcode(ins)
            if op in LAUNCHING:
                total += 1
            elif op == "while":
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins)
                body, cond = re.search(r"body=%?([\w.\-]+)", ins), re.search(r"condition=%?([\w.\-]+)", ins)
                total += (int(trip.group(1)) if trip else 1) * (count(body.group(1)) + count(cond.group(1)))
            elif op == "conditional" and "branch_computations=" in ins:
                branches = re.findall(r"%([\w.\-]+)", ins.split("branch_computations=")[1])
                total += max((count(b) for b in branches), default=0)
        return total

    return count(entry) if entry else 0


@dataclass(frozen=True)
class StepTiming:
    """One step's timing (seconds): ``first`` = compile + first run; ``median`` = launch then wait, one step at a
    time (the benchmark's step time); ``dispatch`` = the host time of the launch call alone (XLA enqueues every
    kernel from the calling thread, so this grows with the step's launches); ``pipelined`` = steps launched back to
    back, one wait at the end (max(host, device) per step: the device's own step time when the host keeps ahead).
    ``launches`` = kernel launches in the compiled HLO, ``temp_bytes`` = XLA temporaries (both executables)."""
    first: float
    median: float
    dispatch: float
    pipelined: float
    launches: int
    temp_bytes: int


# SamplingParams that put a step in each sampler mode (dijax.runtime.sampler.MODES)
SAMPLING = {"greedy": SamplingParams(temperature=0.0), "temperature": SamplingParams(temperature=0.8),
            "sample": SamplingParams(temperature=0.8, top_p=0.95)}


def step_runner(cfg: ModelConfig, params: dict, consts: dict, lengths: list[tuple[int, int]], block_size: int,
                kernels: str, max_model_len: int | None = None, sampling: str = "sample",
                debug_logits: bool = False) -> tuple:
    """A ``ModelRunner`` sized for one step of ``len(lengths)`` sequences (sequence i: ``lengths[i] = (cached,
    new)`` tokens, random token ids, each sampling one token in the mode ``sampling``) on a cache of random values,
    and that step: (runner, its ``SchedulerOutput``, model-step inputs, sampler inputs, sampling rows), the last
    three as ``ModelRunner.step_inputs`` gives them (``runner.launch(output, inputs, sampling, rows)`` launches it).
    ``max_model_len`` defaults to the longest sequence's blocks."""
    from dijax.runtime.scheduler import ScheduledChunk, SchedulerOutput

    rng = np.random.default_rng(0)
    max_blocks = -(-max(c + n for c, n in lengths) // block_size)
    total = sum(n for _, n in lengths)
    runner = ModelRunner(cfg, params, consts, num_blocks=max_blocks * len(lengths), num_slots=len(lengths),
                         block_size=block_size, max_model_len=max_model_len or max_blocks * block_size,
                         max_num_seqs=len(lengths), max_num_batched_tokens=total, debug_logits=debug_logits,
                         kernels=kernels)
    runner.cache = _randomised(runner.cache, seed=1)
    sampling_params = SAMPLING[sampling]
    chunks = []
    for i, (c, n) in enumerate(lengths):
        blocks = tuple(range(i * max_blocks, (i + 1) * max_blocks))
        token_ids = tuple(rng.integers(3, cfg.vocab_size, n).tolist())
        chunks.append(ScheduledChunk(request_id=str(i), slot=i, block_table=blocks, start=c, num_tokens=n,
                                     token_ids=token_ids, sample=True, epoch=0, seed=i, output_position=0,
                                     params=sampling_params))
    output = SchedulerOutput(step=0, chunks=tuple(chunks), num_tokens=total, preempted=())
    return (runner, output) + runner.step_inputs(output, None)


def time_step(cfg: ModelConfig, params: dict, consts: dict, lengths: list[tuple[int, int]], block_size: int,
              warmup: int, iters: int, kernels: str, dump: str | None = None,
              label: str = "step", max_model_len: int | None = None, sampling: str = "sample") -> StepTiming:
    """The timing of the engine's step (``StepTiming``): ``ModelRunner.launch`` at the runner's buckets, as
    ``execute`` does: the model step (the ZOS remap, ``forward_step`` and the sampler on its logits), every sequence
    sampling one token in the sampler mode ``sampling`` (``sampler.MODES``; the step computes every mode's tokens
    and selects this one, so the mode changes the tokens, not the device's work), with the small launches around
    it. Compile time, launches and temporary
    bytes are the model step's. Sequence i has ``lengths[i] = (cached, new)``; ``kernels``: auto / on / off.
    ``max_model_len`` defaults to the longest sequence's blocks; a larger one must not change the step (the block
    table's width follows the step's sequences, not ``max_model_len``: issue 9's row). Each run is the engine's
    ``ModelRunner.launch`` (the step's inputs staged, its logits and tokens written into the last step's buffers:
    dijax.runtime.step_buffers); the first keeps a copy of its logits to check them finite. With ``dump``, the
    optimised HLO of the model step goes to ``dump/<label>.hlo.txt`` and a JAX profiler trace of the timed runs to
    ``dump/<label>/`` (open it with xprof / Perfetto, or summarise it with ``tools/trace_summary.py``)."""
    runner, output, inputs, sampler_inputs, rows = step_runner(cfg, params, consts, lengths, block_size, kernels,
                                                               max_model_len, sampling, debug_logits=True)
    start = time.perf_counter()
    step = runner.lower(inputs).compile()
    launches = kernel_launches(step.as_text())
    temp_bytes = step.memory_analysis().temp_size_in_bytes
    name = re.sub(r"[^\w]+", "_", label).strip("_")
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, f"{name}.hlo.txt"), "w") as f:
            f.write(step.as_text())

    def run():
        """One engine step (the model step, which samples, and its tokens' copy): (sampled tokens [max rows], the
        logits' copy with debug logits on, else None)."""
        handle = runner.launch(output, inputs, sampler_inputs, rows)
        return handle.tokens_R, handle.logits_RV

    tokens_R, logits_RV = run()
    jax.block_until_ready(logits_RV)
    first = time.perf_counter() - start
    if not bool(jnp.isfinite(logits_RV).all()):
        raise RuntimeError("the benchmark step produced non-finite logits")
    runner.debug_logits = False  # the timed runs launch what the engine launches
    for _ in range(warmup):
        tokens_R, _ = run()
    jax.block_until_ready((tokens_R, runner.cache))
    times, dispatches = [], []
    for _ in range(iters):
        start = time.perf_counter()
        tokens_R, _ = run()
        dispatches.append(time.perf_counter() - start)
        jax.block_until_ready((tokens_R, runner.cache))
        times.append(time.perf_counter() - start)
    start = time.perf_counter()  # back to back: the host launches step n+1 while the device runs step n
    for _ in range(iters):
        tokens_R, _ = run()
    jax.block_until_ready((tokens_R, runner.cache))
    pipelined = (time.perf_counter() - start) / iters
    if dump:  # profiled separately so the profiler's overhead stays out of the timed runs
        with jax.profiler.trace(os.path.join(dump, name), create_perfetto_trace=True):
            for _ in range(3):
                tokens_R, _ = run()
            jax.block_until_ready((tokens_R, runner.cache))
    return StepTiming(first, float(np.median(times)), float(np.median(dispatches)), pipelined, launches, temp_bytes)


def engine_max_len(prompt_len: int, max_tokens: int, block_size: int) -> int:
    """The engine rows' max_model_len: a prompt and its outputs, rounded up to whole blocks."""
    return -(-(prompt_len + max_tokens) // block_size) * block_size


def time_engine(zos: bool, model: tuple, num_prompts: int, prompt_len: int, max_tokens: int, kernels: str,
                block_size: int, ep: int = 1, dump: str | None = None) -> tuple[float, int, LLMEngine]:
    """(seconds, output tokens, the engine) of ``LLM.generate`` on ``model`` (``load_model``'s config, parameters
    and step consts) at ``ep``: ``num_prompts`` random prompts of ``prompt_len`` tokens, ``max_tokens`` output
    tokens each, all in flight together (max_num_seqs = ``num_prompts``, every prompt prefilled in one step); the
    KV pool and max_model_len just cover them. A first identical run warms up (it compiles every bucket the run
    takes). The engine's step timeline (``trace_steps``: a few clock reads per step) holds the timed run. With
    ``dump``, a third run goes under the JAX profiler into ``dump`` (host and device events:
    ``tools/trace_summary.py --host``)."""
    cfg, params, consts = model
    tokenizer = Tokenizer.from_file(os.path.join(ASSETS, "tokenizer.json"))  # the embedded one: output text only
    max_model_len = engine_max_len(prompt_len, max_tokens, block_size)
    llm = LLM(loaded=(cfg, params, consts, tokenizer), max_num_seqs=num_prompts, block_size=block_size,
              max_num_batched_tokens=max(64, num_prompts * prompt_len), max_model_len=max_model_len,
              num_blocks=num_prompts * (max_model_len // block_size), zos=zos, kernels=kernels, ep=ep,
              trace_steps=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, prompt_len).tolist() for _ in range(num_prompts)]
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, ignore_eos=True, seed=i)
              for i in range(num_prompts)]
    llm.generate(prompts, params, use_tqdm=False)  # warm (compiles, host paths, transfers)
    llm.engine.timeline.clear()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    if dump:
        with jax.profiler.trace(dump, create_perfetto_trace=True):
            llm.generate(prompts, params, use_tqdm=False)
    return seconds, sum(len(o.token_ids) for o in outputs), llm.engine


def timeline_table(rows: list[dict]) -> list[str]:
    """Markdown lines of the engine rows' step timelines (``time_engine``'s summary under ``"timeline"``, the
    device-only decode step under ``"device_step_ms"``, launch then wait, and ``"back_to_back_ms"``, steps launched
    without waiting: max(host, device) per step): per-phase median ms of a decode step, the end-to-end decode step
    against both, and the share of the run the host spent blocked in ``wait``."""
    lines = ["| engine | " + " | ".join(PHASES) + " | e2e decode step | device-only step | back to back "
             "| e2e / device | host blocked in wait |", "|---" * (len(PHASES) + 6) + "|"]
    for r in rows:
        t = r["timeline"]
        phases = " | ".join(f"{t[f'{name}_ms']:.3f}" for name in PHASES)
        lines.append(f"| {r['case']} | {phases} | {t['step_ms']:.3f} | {r['device_step_ms']:.3f} | "
                     f"{r['back_to_back_ms']:.3f} | {t['step_ms'] / r['device_step_ms']:.2f} | "
                     f"{t['wait_share']:.0%} |")
    return lines


def _ints(text: str, minimum: int = 0) -> list[int]:
    """A comma list of integers >= ``minimum`` ('' is the empty list): the argparse type of the list options."""
    values = [int(v) for v in text.split(",") if v]
    if any(v < minimum for v in values):
        raise argparse.ArgumentTypeError(f"every value must be >= {minimum} (an empty string for none), got {text!r}")
    return values


def add_step_option_argument(parser: argparse.ArgumentParser) -> None:
    """``--step-xla-option NAME=VALUE`` (repeatable): A/B runs of the model step's own XLA options."""
    parser.add_argument("--step-xla-option", action="append", default=[], metavar="NAME=VALUE",
                        help="replace or add one of the model step's XLA options (model_runner.STEP_COMPILER_OPTIONS)"
                             " for this run, e.g. xla_gpu_enable_command_buffer= (command buffers off); booleans as"
                             " True / False (XLA refuses 'true'); repeatable")


def apply_step_options(options: list[str]) -> None:
    """Apply ``--step-xla-option`` values to ``STEP_COMPILER_OPTIONS`` before any step compiles; an empty value is
    kept (it empties a list option). SystemExit names the malformed value."""
    for option in options:
        name, sep, value = option.partition("=")
        if not sep or not name:
            raise SystemExit(f"--step-xla-option must be NAME=VALUE, got {option!r}")
        STEP_COMPILER_OPTIONS[name] = value


# the packages whose modules ``--kernel-setting`` reaches: the kernels, and the runtime (the sampler's filter choice)
SETTING_PACKAGES = (dijax.kernels, dijax.runtime)


def _setting_module(name: str):
    """The module ``name`` of the first of ``SETTING_PACKAGES`` that has one; SystemExit names the allowed ones."""
    for package in SETTING_PACKAGES:
        if name in {m.name for m in pkgutil.iter_modules(package.__path__)}:
            return importlib.import_module(f"{package.__name__}.{name}")
    allowed = sorted(m.name for p in SETTING_PACKAGES for m in pkgutil.iter_modules(p.__path__))
    raise SystemExit(f"--kernel-setting: no module {name} in {', '.join(p.__name__ for p in SETTING_PACKAGES)} "
                     f"(allowed: {allowed})")


def _setting(setting: str):
    """(module, holder, name, target, text) of one ``MODULE.NAME=VALUE`` / ``MODULE.CONFIG.FIELD=VALUE``: the
    module, the module or its ``CONFIG``, the name set there, and the setting's two sides. SystemExit names a
    malformed or unknown one and the allowed names."""
    target, sep, text = setting.partition("=")
    parts = target.split(".")
    if not sep or len(parts) not in (2, 3) or (len(parts) == 3 and parts[1] != "CONFIG"):
        raise SystemExit(f"--kernel-setting must be MODULE.NAME=VALUE or MODULE.CONFIG.FIELD=VALUE, got {setting!r}")
    module = _setting_module(parts[0])
    holder = module.CONFIG if len(parts) == 3 else module
    names = ([f.name for f in dataclasses.fields(holder)] if len(parts) == 3
             else [n for n in vars(module) if n.isupper() and not n.startswith("_")])
    if parts[-1] not in names:
        raise SystemExit(f"--kernel-setting: {target} is not a setting of {module.__name__} (allowed: "
                         f"{sorted(names)})")
    return module, holder, parts[-1], target, text


def apply_kernel_settings(settings: list[str]) -> list[str]:
    """Apply ``--kernel-setting`` values before any step is traced: ``MODULE.NAME=VALUE`` sets a module constant of
    ``dijax.kernels.MODULE`` or ``dijax.runtime.MODULE`` (a dispatcher threshold such as ``topk.SELECT_MIN_VALUES``
    or ``sampler.SELECT_MIN_ROWS``), ``MODULE.CONFIG.FIELD=VALUE`` replaces one field of that module's ``CONFIG`` (a
    tiling such as ``routed_experts.CONFIG.gathered_max``). VALUE is a Python literal of the current value's type.
    Returns the settings as applied; SystemExit names a malformed or unknown one and the allowed names."""
    applied = []
    for setting in settings:
        module, holder, name, target, text = _setting(setting)
        current = getattr(holder, name)
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise SystemExit(f"--kernel-setting: {target} needs a Python literal, got {text!r}") from None
        if type(value) is not type(current):
            raise SystemExit(f"--kernel-setting: {target} must be of type {type(current).__name__} (now {current!r}), "
                             f"got {text!r}")
        if holder is module:
            setattr(module, name, value)
        else:
            module.CONFIG = dataclasses.replace(holder, **{name: value})
        applied.append(f"{target}={value!r}")
    return applied


def current_settings(settings: list[str]) -> list[str]:
    """The values the targets of ``settings`` hold now, as settings (``_setting``'s errors for a bad one): what
    ``apply_kernel_settings`` takes to restore them after a ``--variant``."""
    now = []
    for setting in settings:
        _, holder, name, target, _ = _setting(setting)
        now.append(f"{target}={getattr(holder, name)!r}")
    return now


def use_settings(settings: list[str]) -> None:
    """Apply ``settings`` and drop every traced and compiled step, so the next step is traced under them."""
    apply_kernel_settings(settings)
    compiled_step.cache_clear()
    jax.clear_caches()


def _counts(text: str) -> list[int]:
    """``_ints`` of values >= 1 (batch sizes, prefill lengths, max_model_len)."""
    return _ints(text, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny | flash-slice | flash-stack (module docstring)")
    parser.add_argument("--experts", type=int, default=384, help="flash-slice: routed experts per layer")
    parser.add_argument("--decode-batch", type=_counts, default=[1, 8], help="comma list of decode batch sizes")
    parser.add_argument("--context", type=_ints, default=[256], help="comma list of cached tokens per sequence")
    parser.add_argument("--prefill", type=_counts, default=[128], help="comma list of prefill lengths (one sequence)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--max-model-len", type=_counts, default=[],
                        help="comma list: time each case at each of these runner max_model_len values (default: the "
                             "case's longest sequence); the step must not depend on it")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--engine-batch", type=_counts, default=[8],
                        help="engine rows: comma list of prompt counts (all in flight together)")
    parser.add_argument("--engine-prompt", type=int, default=32, help="engine rows: tokens per prompt")
    parser.add_argument("--engine-tokens", type=int, default=64, help="engine rows: output tokens per request")
    parser.add_argument("--engine", choices=("on", "off"), default="on",
                        help="also time LLM.generate on --model with ZOS on and off (--engine-batch prompts)")
    parser.add_argument("--bandwidth", type=float, help="bytes/s ceiling (default: the device's measured copy, "
                                                          "tools/ceilings.py; H200 4.3e12, H100 3.0e12)")
    parser.add_argument("--flops", type=float, help="FLOP/s ceiling (default: the device's measured bf16 GEMM; "
                                                      "H200 7.9e14, H100 7.98e14)")
    parser.add_argument("--moe-path", choices=("auto", "ragged", "gathered"), default="auto",
                        help="routed-experts path: auto (gathered when T*X < E) or forced, for A/B comparisons")
    add_model_options(parser)  # --kernels (run once with each to compare) and --ep
    parser.add_argument("--sampling", choices=tuple(SAMPLING), default="sample",
                        help="step rows: the sampler mode every sequence samples in (default: sample; the step "
                             "computes every mode and selects this one)")
    add_step_option_argument(parser)
    parser.add_argument("--kernel-setting", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="A/B runs of a kernel module's constant or CONFIG field (apply_kernel_settings), e.g. "
                             "topk.SELECT_MIN_VALUES=512 or routed_experts.CONFIG.gathered_max=64; repeatable")
    parser.add_argument("--variant", action="append", default=[], metavar="SETTING[;SETTING...]",
                        help="after the step rows, run them again with these --kernel-setting values (';'-separated)"
                             " on the model already loaded, every jit retraced; repeatable, each a variant of its "
                             "own, rows labelled [variant]")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --variant: run the base and every variant this many times, alternating")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--dump", help="write each step's optimised HLO and a profiler trace of 3 steps here")
    args = parser.parse_args(argv)
    apply_ep(args)  # before JAX starts its backends: a CPU-only host gets --ep devices
    kernel_options(args.kernels, jax.default_backend())  # a bad choice fails before the model is built
    apply_step_options(args.step_xla_option)
    settings = apply_kernel_settings(args.kernel_setting)
    variants = [[v for v in variant.split(";") if v] for variant in args.variant]
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    base = current_settings([setting for variant in variants for setting in variant])  # what the variants change
    for variant in variants:  # a bad setting fails before the model is built
        apply_kernel_settings(variant)
    apply_kernel_settings(base)

    if args.moe_path != "auto":  # A/B seam: every step traced from here on takes the forced path
        from dijax.kernels import routed_experts

        routed_experts.routed_path = lambda n_assignments, n_experts: args.moe_path
    device = jax.devices()[0]
    measured = ceilings(device.device_kind)
    args.bandwidth = args.bandwidth or measured.bandwidth
    args.flops = args.flops or measured.flops
    source = measured.source if (args.bandwidth, args.flops) == measured[:2] else "given"
    longest = max([c + 1 for c in args.context] + args.prefill)
    if args.max_model_len and min(args.max_model_len) < longest:
        raise SystemExit(f"--max-model-len {min(args.max_model_len)} is below the longest sequence of the cases "
                         f"({longest} tokens: context + 1 for decode, the prompt for prefill); allowed: >= {longest}")
    header = (f"dijax bench {datetime.date.today()} | {device.device_kind} ({device.platform}) | jax {jax.__version__}"
              f" | {platform.machine()} | model {args.model} | moe path {args.moe_path} | kernels {args.kernels}"
              f" | ep {args.ep} | step XLA options {STEP_COMPILER_OPTIONS} | kernel settings {settings or 'default'}"
              f" | sampling {args.sampling}"
              f" | warm-up {args.warmup}, median of {args.iters}"
              f" | ceilings {args.bandwidth / 1e12:.2g} TB/s, {args.flops / 1e12:.0f} TFLOP/s ({source})")
    print(header, flush=True)
    start = time.perf_counter()
    cfg, params, consts = load_model(args.model, args.experts, args.ep)
    jax.block_until_ready(params)
    print(f"model ready in {time.perf_counter() - start:.1f} s: {_nbytes(params) / 1e9:.2f} GB of parameters, "
          f"{cfg.n_layers} layers, {cfg.n_routed_experts} experts{_load_peak()}", flush=True)
    rows = []
    cases = [(f"decode B={b} ctx={c}", [(c, 1)] * b) for b in args.decode_batch for c in args.context]
    cases += [(f"prefill P={p}", [(0, p)]) for p in args.prefill]
    if args.max_model_len:
        cases = [(f"{label} max_model_len={n}", lengths, n) for label, lengths in cases for n in args.max_model_len]
    else:
        cases = [(label, lengths, None) for label, lengths in cases]
    runs = [(label, lengths, max_model_len, None) for label, lengths, max_model_len in cases]
    if variants:
        runs = [(label if variant is None else f"{label} [{'; '.join(variant)}]", lengths, max_model_len, variant)
                for _ in range(args.rounds) for variant in [None, *variants]
                for label, lengths, max_model_len in cases]
    applied = None
    for label, lengths, max_model_len, variant in runs:
        if variant != applied:  # every step retraced with the base settings, then the variant's on top
            use_settings(base + (variant or []))
            applied = variant
        timing = time_step(cfg, params, consts, lengths, args.block_size, args.warmup, args.iters, args.kernels,
                           args.dump, label, max_model_len, args.sampling)
        median = timing.median
        tokens = sum(n for _, n in lengths)
        cost = step_cost(cfg, tokens, [c + n for c, n in lengths])
        floor, bound = cost.floor_s(args.bandwidth, args.flops)
        rows.append({"case": label, "tokens": tokens, "first_s": timing.first, "median_ms": median * 1e3,
                     "dispatch_ms": timing.dispatch * 1e3, "pipelined_ms": timing.pipelined * 1e3,
                     "tokens_per_s": tokens / median, "floor_ms": floor * 1e3, "bound": bound,
                     "of_floor": floor / median, "bytes_GB": (cost.weight_bytes + cost.kv_bytes) / 1e9,
                     "GFLOP": cost.flops / 1e9, "launches": timing.launches, "temp_GB": timing.temp_bytes / 1e9})
        print(f"  {label}: {median * 1e3:.2f} ms (host dispatch {timing.dispatch * 1e3:.2f} ms, back to back "
              f"{timing.pipelined * 1e3:.2f} ms; first run {timing.first:.1f} s, {timing.launches} kernel launches, "
              f"{timing.temp_bytes / 1e9:.3f} GB temporaries)", flush=True)
    if applied is not None:  # the engine rows and the caller see the base settings again
        use_settings(base)
    engine_rows = []
    if args.engine == "on":
        prompt_len, max_tokens = args.engine_prompt, args.engine_tokens
        for num_prompts in args.engine_batch:
            rows_b = []
            for zos in (True, False):
                dump = (os.path.join(args.dump, f"engine_b{num_prompts}_zos_{'on' if zos else 'off'}")
                        if args.dump else None)
                seconds, tokens, engine = time_engine(zos, (cfg, params, consts), num_prompts, prompt_len,
                                                      max_tokens, args.kernels, args.block_size, args.ep, dump)
                timeline = summarize(list(engine.timeline.records))
                row = {"case": f"engine {args.model} {num_prompts}x({prompt_len}+{max_tokens}) zos "
                               f"{'on' if zos else 'off'}",
                       "tokens": tokens, "median_ms": seconds * 1e3, "tokens_per_s": tokens / seconds,
                       "timeline": timeline}
                rows_b.append(row)
                print(f"  {row['case']}: {tokens / seconds:.0f} output tok/s, decode step {timeline['step_ms']:.2f}"
                      f" ms (" + ", ".join(f"{name} {timeline[f'{name}_ms']:.3f}" for name in PHASES) + ")",
                      flush=True)
                del engine  # its KV pool, before the next engine allocates one
            # the engine's decode step alone (same buckets: B sequences at the run's mid-point context)
            context = prompt_len + max_tokens // 2
            device_step = time_step(cfg, params, consts, [(context, 1)] * num_prompts, args.block_size,
                                    args.warmup, args.iters, args.kernels,
                                    label=f"engine decode B={num_prompts} ctx={context}",
                                    max_model_len=engine_max_len(prompt_len, max_tokens, args.block_size))
            print(f"  device-only decode B={num_prompts} ctx={context} (block size {args.block_size}): "
                  f"{device_step.median * 1e3:.2f} ms, back to back {device_step.pipelined * 1e3:.2f} ms",
                  flush=True)
            for row in rows_b:
                row["device_step_ms"] = device_step.median * 1e3
                row["back_to_back_ms"] = device_step.pipelined * 1e3
            rows += rows_b
            engine_rows += rows_b
    print()
    print(header)
    print("| case | ms (median) | host dispatch ms | back-to-back ms | tokens/s | floor ms (bound) | of floor "
          "| GB moved | GFLOP | launches | temp GB |")
    print("|---" * 11 + "|")
    for r in rows:
        if "floor_ms" in r:
            print(f"| {r['case']} | {r['median_ms']:.3f} | {r['dispatch_ms']:.3f} | {r['pipelined_ms']:.3f} "
                  f"| {r['tokens_per_s']:.0f} | {r['floor_ms']:.3f} "
                  f"({r['bound']}) | {r['of_floor']:.1%} | {r['bytes_GB']:.3f} | {r['GFLOP']:.1f} | "
                  f"{r['launches']} | {r['temp_GB']:.3f} |")
        else:
            print(f"| {r['case']} | {r['median_ms']:.0f} (whole run) | | | {r['tokens_per_s']:.0f} |" + " |" * 6)
    if engine_rows:
        print()
        print("Engine step timeline (median ms per decode step; the device-only step is ``time_step``'s, same "
              "kernels):")
        print("\n".join(timeline_table(engine_rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
