"""``dijax generate``: offline generation from prompts, on a checkpoint or on the embedded tiny default.

With no ``--model`` it runs the tiny configuration and tokenizer shipped inside the package with random weights
from a fixed seed: fast on a CPU, and the text it prints is meaningless (it says so). It runs the
engine (``dijax.runtime.llm.LLM``: scheduler, zero-overhead asynchronous runner, sampling on device).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import dijax  # noqa: F401  (sets XLA flags before JAX starts)
from dijax.runtime.sampling_params import SamplingParams

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", help="prompts (default: three short examples)")
    parser.add_argument("--prompts-file", help="file with one prompt per line, or JSONL records with 'prompt'")
    parser.add_argument("--model", help="dijax or Hugging Face checkpoint (default: the embedded tiny model)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, help="token budget of a step (long prompts prefill in chunks of N)")


def run(args: argparse.Namespace) -> int:
    sp = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        max_tokens=args.max_tokens, seed=args.seed)
    if args.chunk is not None and args.chunk <= 0:
        raise ValueError(f"--chunk must be a positive number of tokens, got {args.chunk}")
    prompts = read_prompts(args)
    if args.model is None:
        print("dijax generate: no --model given; running the embedded tiny model with random weights "
              "(seed 0): the text is meaningless, the pipeline is real.", file=sys.stderr)
    from dijax.runtime.llm import LLM

    llm = LLM(args.model, max_num_seqs=min(len(prompts), 16),
              max_num_batched_tokens=args.chunk or 256, zos=True)
    for out in llm.generate(prompts, sp):
        print(f"prompt: {out.prompt!r}\noutput: {out.text!r}\nfinish: {out.finish_reason}\n")
    return 0
