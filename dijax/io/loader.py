"""Load a model for the engine: a checkpoint path (dijax or Hugging Face), or the embedded tiny default."""

from __future__ import annotations

import os

from tokenizers import Tokenizer

from dijax.config import ModelConfig
from dijax.io.checkpoint import load_params, resolve_checkpoint
from dijax.io.random_init import random_params
from dijax.model.engram import EngramTables

ASSETS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "tiny")


def load(model: str | None, seed: int = 0):
    """(config, params, Engram constants, tokenizer) for a checkpoint path, or the embedded tiny default."""
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
        consts = tables.step_consts()
    return cfg, params, consts, tokenizer
