"""``dijax generate``: offline generation from prompts, on a checkpoint or on the embedded tiny default.

With no ``--model`` it runs the tiny configuration and tokenizer shipped inside the package with random weights
from a fixed seed: fast on a CPU, and the text it prints is meaningless (it says so). It runs the
engine (``dijax.runtime.llm.LLM``: scheduler, zero-overhead asynchronous runner, sampling on device).
"""

from __future__ import annotations

import argparse
import json
import sys

import dijax  # noqa: F401  (sets XLA flags before JAX starts)
from dijax.cli.options import add_model_options, apply_ep
from dijax.runtime.compile_cache import default_compile_cache_dir
from dijax.runtime.sampling_params import SamplingParams

DEMO_PROMPTS = ["The license", "Permission is hereby granted", "You may obtain a copy"]


def _jsonl_prompt(path: str, number: int, line: str) -> str | list[int]:
    """The prompt of one JSONL record: a non-empty string, or a list of int token ids."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{number}: not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict) or "prompt" not in record:
        raise ValueError(f"{path}:{number}: each JSONL record must be an object with a 'prompt' field, "
                         f"got {line.strip()[:60]!r}")
    prompt = record["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{path}:{number}: 'prompt' must be a non-empty string or a list of int token ids, got "
                         f"{type(prompt).__name__} {prompt!r:.40}")
    return prompt


def read_prompts_file(path: str) -> list[str | list[int]]:
    """Prompts from a UTF-8 file. ``*.jsonl``: one JSON object per non-empty line, its 'prompt' a string or a
    list of int token ids. Any other file: one prompt per non-empty line, taken as written."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason})") from None
    jsonl = path.endswith(".jsonl")
    prompts = [_jsonl_prompt(path, i + 1, line) if jsonl else line
               for i, line in enumerate(lines) if line.strip()]
    if not prompts:
        raise ValueError(f"{path}: the file holds no prompts")
    return prompts


def read_prompts(args: argparse.Namespace) -> list[str | list[int]]:
    """The positional prompts, then those of --prompts-file; the demo prompts when neither gives any."""
    prompts = list(args.prompts)
    if args.prompts_file is not None:
        prompts += read_prompts_file(args.prompts_file)
    return prompts or DEMO_PROMPTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", help="prompts (default: three short examples)")
    parser.add_argument("--prompts-file", help="UTF-8 file with one prompt per line; a *.jsonl file holds one JSON "
                                               "object per line whose 'prompt' is a string or a list of token ids")
    parser.add_argument("--model", help="dijax or Hugging Face checkpoint (default: the embedded tiny model)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, help="token budget of a step (long prompts prefill in chunks of N)")
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--compile-cache", metavar="DIR", default=default_compile_cache_dir(),
                       help="keep the compiled steps in DIR and load them from there next time (default: "
                            "$DIJAX_CACHE/compile or ~/.cache/dijax/compile; JAX_COMPILATION_CACHE_DIR when set)")
    cache.add_argument("--no-compile-cache", dest="compile_cache", action="store_const", const=None,
                       help="compile every step afresh and keep nothing on disk")
    add_model_options(parser)


def run(args: argparse.Namespace) -> int:
    apply_ep(args)  # before JAX initialises its backends
    sp = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        max_tokens=args.max_tokens, seed=args.seed)
    if args.chunk is not None and args.chunk <= 0:
        raise ValueError(f"--chunk must be a positive number of tokens, got {args.chunk}")
    prompts = read_prompts(args)
    if args.model is None:
        print("dijax generate: no --model given; running the embedded tiny model with random weights "
              "(seed 0): the text is meaningless, the pipeline is real.", file=sys.stderr)
    from dijax.runtime.llm import LLM

    budget = args.chunk or 256
    llm = LLM(args.model, max_num_seqs=min(len(prompts), 16, budget), max_num_batched_tokens=budget, zos=True,
              kernels=args.kernels, ep=args.ep, compile_cache_dir=args.compile_cache)
    for out in llm.generate(prompts, sp):
        error = f" ({out.error})" if out.error else ""
        print(f"prompt: {out.prompt!r}\noutput: {out.text!r}\nfinish: {out.finish_reason}{error}\n")
    return 0
