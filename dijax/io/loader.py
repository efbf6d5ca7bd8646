"""Load a model for the engine: a checkpoint path (dijax or Hugging Face), or the embedded tiny default."""

from __future__ import annotations

import os

from jax.sharding import Mesh
from tokenizers import Tokenizer

from dijax.config import ModelConfig
from dijax.io.checkpoint import load_params, resolve_checkpoint
from dijax.io.random_init import random_params
from dijax.io.tensor_spec import check_checkpoint
from dijax.model.engram import EngramTables
from dijax.parallel.mesh import make_mesh

ASSETS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "tiny")


def _mesh(cfg: ModelConfig, ep: int) -> Mesh | None:
    return make_mesh(ep, cfg.n_routed_experts) if ep > 1 else None


def load(model: str | os.PathLike | None, seed: int = 0, ep: int = 1):
    """(config, params, Engram constants, tokenizer) for a checkpoint path, or the embedded tiny default.

    A checkpoint is checked against its config from its headers before any tensor is read
    (``tensor_spec.check_checkpoint``); a missing path, config or tokenizer is a FileNotFoundError naming it.
    ``ep`` > 1 loads the parameters straight onto an expert-parallel mesh (``make_mesh(ep, n_routed_experts)``):
    each device reads only its routed experts and Engram rows (``load_params(mesh=...)``).
    """
    if model is None:
        cfg = ModelConfig.from_file(os.path.join(ASSETS, "config.json"))
        tokenizer = Tokenizer.from_file(os.path.join(ASSETS, "tokenizer.json"))
        params = random_params(cfg, seed, _mesh(cfg, ep))
    else:
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model must be a checkpoint path or None, got {type(model).__name__} {model!r}")
        if not os.path.exists(model):
            raise FileNotFoundError(f"model path {os.fspath(model)} does not exist")
        path = resolve_checkpoint(model)
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        cfg = ModelConfig.from_file(folder)
        tokenizer_path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(tokenizer_path):
            raise FileNotFoundError(f"{folder} has no tokenizer.json (it belongs beside the config)")
        try:
            tokenizer = Tokenizer.from_file(tokenizer_path)
        except Exception as error:  # noqa: BLE001  (the tokenizers library raises a bare Exception)
            raise ValueError(f"{tokenizer_path}: unreadable tokenizer ({error})") from None
        mesh = _mesh(cfg, ep)  # its errors come before anything is read
        check_checkpoint(cfg, path)
        params = load_params(cfg, path, mesh=mesh)
    consts: dict = {}
    if cfg.engram_layer_ids:
        tables = EngramTables.build(cfg, tokenizer)
        consts = tables.step_consts()
    return cfg, params, consts, tokenizer
