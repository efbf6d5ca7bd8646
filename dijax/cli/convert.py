"""``dijax convert HF_DIR OUT_DIR``: convert a Hugging Face checkpoint into dijax's format (see dijax.io.convert)."""

from __future__ import annotations

import argparse

from dijax.io.convert import convert


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", help="Hugging Face checkpoint directory (config.json, shards, index json)")
    parser.add_argument("out_dir", help="output directory (must not exist)")
    parser.add_argument("--expert-dtype", choices=("fp4", "fp8"), default="fp4",
                        help="routed experts: keep MXFP4 packed (default) or re-encode losslessly as fp8")


def run(args: argparse.Namespace) -> int:
    out = convert(args.hf_dir, args.out_dir, args.expert_dtype)
    print(f"converted {args.hf_dir} -> {out}")
    return 0
