"""``dijax generate``: offline generation from prompts, on a checkpoint or on the embedded tiny default.

With no ``--model`` it runs the tiny configuration and tokenizer shipped inside the package with random weights
from a fixed seed: fast on a CPU, and the text it prints is meaningless (it says so). This first version drives the
model through ``dijax.driver.Driver`` (prefill, then one decode step for all prompts at a time) and samples with
``dijax.runtime.sampler``; the engine issue replaces the loop with the scheduler and the asynchronous runner.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import dijax  # noqa: F401  (sets XLA flags before JAX starts)
from dijax.runtime.sampling_params import SamplingParams

ASSETS = os.path.join(os.path.dirname(__file__), "assets", "tiny")


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            for line in f:
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                if line.lstrip().startswith("{"):
                    record = json.loads(line)
                    if "prompt" not in record:
                        raise ValueError(f"{args.prompts_file}: JSONL records need a 'prompt' field, got {record}")
                    line = record["prompt"]
                prompts.append(line)
    if not prompts:
        prompts = ["The license", "Permission is hereby granted", "You may obtain a copy"]
    return prompts


def load(model: str | None, seed: int = 0):
    """(config, params, Engram constants, tokenizer) for a checkpoint path, or the embedded tiny default."""
    import jax.numpy as jnp
    from tokenizers import Tokenizer

    from dijax.checkpoint import load_params, resolve_checkpoint
    from dijax.config import ModelConfig
    from dijax.model.engram import EngramTables
    from dijax.random_init import random_params

    if model is None:
        cfg = ModelConfig.from_file(os.path.join(ASSETS, "config.json"))
        tokenizer = Tokenizer.from_file(os.path.join(ASSETS, "tokenizer.json"))
        params = random_params(cfg, seed)
    else:
        path = resolve_checkpoint(model)
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        cfg = ModelConfig.from_file(folder)
        tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        params = load_params(cfg, path)
    consts: dict = {}
    if cfg.engram_layer_ids:
        tables = EngramTables.build(cfg, tokenizer)
        consts = dict(tables.device_arrays(), pad_id=jnp.int32(tables.pad_id))
    return cfg, params, consts, tokenizer


def generate(cfg, params, consts, tokenizer, prompts: list[str], sp: SamplingParams, chunk: int | None = None):
    """Generate for every prompt (all in one batch); returns the generated token ids per prompt."""
    import jax.numpy as jnp

    from dijax.driver import Driver
    from dijax.model.step import CacheSpec
    from dijax.runtime.sampler import sample

    ids = [[cfg.bos_token_id] + tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
    longest = max(len(i) for i in ids) + sp.max_tokens
    if longest > cfg.max_seq_len:
        raise ValueError(f"prompt + max_tokens = {longest} tokens exceeds the model limit {cfg.max_seq_len}")
    spec = CacheSpec(num_blocks=len(ids) * -(-longest // 16), num_slots=len(ids), block_size=16)
    driver = Driver(cfg, params, consts, spec, max_seq_len=longest)
    seqs = [driver.new_sequence() for _ in ids]
    pending = [list(i) for i in ids]
    last = [None] * len(ids)
    while any(pending):
        work = []
        for i, rest in enumerate(pending):
            if rest:
                n = len(rest) if chunk is None else min(chunk, len(rest))
                work.append((i, rest[:n]))
                pending[i] = rest[n:]
        logits, _ = driver.step([(seqs[i], toks, "last") for i, toks in work])
        for (i, _), lg in zip(work, logits):
            last[i] = lg[-1]
    base_seed = sp.seed or 0
    outputs: list[list[int]] = [[] for _ in ids]
    active = list(range(len(ids)))
    stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else {cfg.eos_token_id})
    for position in range(sp.max_tokens):
        rows = np.stack([last[i] for i in active])
        n = len(active)
        seeds = np.array([(base_seed + i) & 0xFFFFFFFF for i in active], np.uint32)  # request i's own seed
        tokens = np.asarray(sample(jnp.asarray(rows), jnp.full(n, sp.temperature, jnp.float32),
                                   jnp.full(n, sp.top_k, jnp.int32), jnp.full(n, sp.top_p, jnp.float32),
                                   jnp.asarray(seeds), jnp.full(n, position, jnp.int32)))
        still = []
        for i, tok in zip(active, tokens.tolist()):
            outputs[i].append(tok)
            if tok not in stops and position + 1 < sp.max_tokens:
                still.append(i)
        active = still
        if not active:
            break
        logits, _ = driver.step([(seqs[i], [outputs[i][-1]], "last") for i in active])
        for i, lg in zip(active, logits):
            last[i] = lg[-1]
    return outputs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", help="prompts (default: three short examples)")
    parser.add_argument("--prompts-file", help="file with one prompt per line, or JSONL records with 'prompt'")
    parser.add_argument("--model", help="dijax or Hugging Face checkpoint (default: the embedded tiny model)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, help="prefill in chunks of N tokens")


def run(args: argparse.Namespace) -> int:
    sp = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        max_tokens=args.max_tokens, seed=args.seed)
    if args.chunk is not None and args.chunk <= 0:
        raise ValueError(f"--chunk must be a positive number of tokens, got {args.chunk}")
    prompts = read_prompts(args)
    if args.model is None:
        print("dijax generate: no --model given; running the embedded tiny model with random weights "
              "(seed 0): the text is meaningless, the pipeline is real.", file=sys.stderr)
    cfg, params, consts, tokenizer = load(args.model)
    outputs = generate(cfg, params, consts, tokenizer, prompts, sp, args.chunk)
    for prompt, out in zip(prompts, outputs):
        text = tokenizer.decode(out, skip_special_tokens=True)
        print(f"prompt: {prompt!r}\noutput: {text!r}\n")
    return 0
