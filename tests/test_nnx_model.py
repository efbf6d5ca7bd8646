"""The Flax NNX model: module tree by role, checkpoint dtypes and logical axes, loading tensor for tensor, the
cached graph definition, and the stacked / scanned layer plan computing what the plain layer loop computes."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dijax.config import ModelConfig
from dijax.io.checkpoint import load_params
from dijax.io.loader import ASSETS
from dijax.io.random_init import random_params
from dijax.io.safetensors import SafetensorsFile
from dijax.model import param_map
from dijax.model.layers import LOGICAL_AXES
from dijax.model.plan import plan_layers
from dijax.model.step import CacheSpec, SeqChunk, build_step, init_cache
from dijax.model.transformer import Block, Transformer, abstract_state, graphdef
from dijax.runtime.model_runner import ModelRunner
from tests.conftest import parity_path

pytestmark = pytest.mark.cost(50)  # CI seconds, a scheduling hint (tests/conftest.py)


def _tiny_with(**text_config) -> ModelConfig:
    with open(os.path.join(ASSETS, "config.json")) as f:
        raw = json.load(f)
    raw["text_config"].update(text_config)
    return ModelConfig.from_dict(raw)


def _flagship_pattern() -> ModelConfig:
    """The released V4.1-Flash layer schedule (v41_spec §2) at the tiny model's widths."""
    return _tiny_with(num_hidden_layers=40, num_nextn_predict_layers=3,
                      compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
                      kv_source_layer_ids=[2, 8, 14, 20], index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
                      candidate_source_layer_id=20, engram_layer_ids=[1, 14])


def _repeating() -> ModelConfig:
    """Ten layers with two repeated periods (source + consumer), no Engram: small enough to compile twice."""
    return _tiny_with(num_hidden_layers=10, num_nextn_predict_layers=0,
                      compress_ratios=[0, 2, 2, 2, 2, 1, 1, 1, 1, 1], kv_source_layer_ids=[1, 3, 5],
                      index_source_layer_ids=[1, 3, 5, 6, 8], candidate_source_layer_id=5, engram_layer_ids=[],
                      engram_num_embeddings=[])


def test_modules_follow_the_roles_and_keep_checkpoint_dtypes():
    cfg = ModelConfig.from_file(parity_path("tiny", "config.json"))
    model = nnx.eval_shape(lambda: Transformer(cfg))
    blocks = {layer: (stage.blocks[r], (i, j)) for stage in model.stages
              for i, period in enumerate(stage.plan.layers) for r, run in enumerate(period)
              for j, layer in enumerate(run)}
    assert sorted(blocks) == list(range(cfg.n_layers))
    for role in cfg.roles:
        block = blocks[role.layer][0]
        assert isinstance(block, Block) and block.role == cfg.roles[block.role.layer]
        assert hasattr(block, "engram") == role.engram
        assert hasattr(block.attn, "compressor") == role.kv_source
        assert hasattr(block.attn, "indexer") == role.index_source
        if role.index_source:
            assert hasattr(block.attn.indexer, "wk") == role.owns_index_keys
        if role.kv_source:
            assert hasattr(block.attn.compressor, "wgate") == (role.ratio > 1)
    block = blocks[2][0]
    assert block.attn.wq_a.weight.get_value().dtype == jnp.float8_e4m3fn
    assert block.attn.wq_a.scale.get_value().dtype == jnp.uint8
    assert block.attn.compressor.wkv.weight.get_value().dtype == jnp.bfloat16  # fp32 only in the computation
    assert block.ffn.experts.w1.weight.get_value().shape[2:] == (cfg.n_routed_experts, cfg.moe_inter_dim,
                                                                 cfg.dim // 2)
    assert model.head.weight.get_value().dtype == jnp.bfloat16
    assert all(isinstance(v, nnx.Param) for _, v in nnx.to_flat_state(nnx.state(model)))


def test_every_parameter_has_logical_axes_from_the_glossary():
    cfg = ModelConfig.from_file(parity_path("tiny", "config.json"))
    state = abstract_state(cfg)
    axes = param_map.logical_axes(state)
    for path, var in nnx.to_flat_state(state):
        names = axes[path]
        assert len(names) == var.get_value().ndim, path
        assert all(n in LOGICAL_AXES for n in names), (path, names)
        assert (names[:2] == ("period", "layer")) == (path[0] == "stages"), path
    path, _ = param_map.module_path(cfg, "layers.3.ffn.experts.w1.weight")
    assert axes[path] == ("period", "layer", "expert", "expert_out", "expert_in")
    assert axes[("embed", "weight")] == ("vocab", "embed")
    assert axes[param_map.module_path(cfg, "layers.4.hc_ffn_fn")[0]] == ("period", "layer", "hc_mix",
                                                                          "streams_embed")
    with pytest.raises(ValueError, match="n_layers=9"):
        param_map.module_path(cfg, "layers.9.attn_norm.weight")


def test_loading_places_every_checkpoint_tensor_at_its_module_path():
    cfg = ModelConfig.from_file(parity_path("tiny", "config.json"))
    path = parity_path("tiny", "reference", "model.safetensors")
    state = load_params(cfg, path)
    flat = dict(nnx.to_flat_state(state))
    file = SafetensorsFile(path)
    seen = set()
    for name in file.names():
        parts = name.split(".")
        if parts[0] == "mtp":
            continue
        expert = None
        if parts[2:4] == ["ffn", "experts"]:
            expert = int(parts[4])
            parts = parts[:4] + parts[5:]
        module, index = param_map.module_path(cfg, ".".join(parts))
        got = np.asarray(flat[module].get_value()[index])
        if expert is not None:
            got = got[expert]
        want = np.asarray(file.get(name))
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), name
        seen.add(module)
    assert seen == set(flat)  # nothing in the model is left unfilled


def test_a_missing_or_misshapen_tensor_is_named():
    cfg = ModelConfig.from_file(parity_path("tiny", "config.json"))
    tree = param_map.checkpoint_tree(cfg, random_params(cfg, seed=1))
    good = tree["layers"][3]["attn"]["wq_a"]["weight"]
    tree["layers"][3]["attn"]["wq_a"]["weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError, match="layers.3.attn.wq_a.weight"):
        param_map.state_from_tree(cfg, tree)
    tree["layers"][3]["attn"]["wq_a"]["weight"] = good
    del tree["layers"][4]["attn_norm"]
    with pytest.raises(ValueError, match="layers.4.attn_norm.weight"):
        param_map.state_from_tree(cfg, tree)


def test_graphdef_is_computed_once_per_config():
    cfg = ModelConfig.from_file(parity_path("tiny", "config.json"))
    assert graphdef(cfg) is graphdef(ModelConfig.from_file(parity_path("tiny", "config.json")))
    assert graphdef(cfg) is not graphdef(_repeating())


def test_the_flagship_schedule_folds_into_few_distinct_bodies():
    cfg = _flagship_pattern()
    stages = plan_layers(cfg)
    assert [s.layers for s in stages] == [
        (((0,),),), (((1,),),),
        (((2,), (3, 4, 5, 6, 7)), ((8,), (9, 10, 11, 12, 13))),
        (((14,),),), (((15, 16, 17, 18, 19),),), (((20,),),), (((21, 22, 23),),),
        tuple(((s,), (s + 1, s + 2, s + 3)) for s in (24, 28, 32, 36)),
    ]
    assert sum(s.num_runs for s in stages) == 10  # distinct block bodies for 40 layers
    assert [layer for s in stages for period in s.layers for run in period for layer in run] == list(range(40))
    assert [s.layers for s in plan_layers(cfg, fold=False)] == [(((layer,),),) for layer in range(40)]


def test_scanned_stages_compute_what_the_plain_layer_loop_computes():
    cfg = _repeating()
    assert max(s.repeats for s in plan_layers(cfg)) == 2
    folded = random_params(cfg, seed=7)
    plain = param_map.state_from_tree(cfg, param_map.checkpoint_tree(cfg, folded), fold=False)
    step_plain = jax.jit(lambda p, c, b: nnx.merge(graphdef(cfg, fold=False), p)(c, b, {}))
    cache_plain = init_cache(cfg, CacheSpec(num_blocks=8, num_slots=2, block_size=16), fold=False)
    runner = ModelRunner(cfg, folded, {}, num_blocks=8, num_slots=2, block_size=16, max_model_len=32,
                         max_num_seqs=2, max_num_batched_tokens=32)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (21, 6)]
    # a prefill of every row and a decode step; the plain loop takes both with one shape (32 tokens, 32 logit rows:
    # one compile of its unrolled ten layers), the runner each with its own buckets
    steps = [[SeqChunk(slot=0, block_table=[0, 1], start=0, tokens=prompts[0], logits="all"),
              SeqChunk(slot=1, block_table=[2], start=0, tokens=prompts[1], logits="all")],
             [SeqChunk(slot=0, block_table=[0, 1], start=21, tokens=[5]),
              SeqChunk(slot=1, block_table=[2], start=6, tokens=[9])]]
    for chunks in steps:
        batch, rows_per_chunk = build_step(chunks, 32, 2, 2, 32)
        a, cache_plain, topk_a = step_plain(plain, cache_plain, batch)
        b, topk_b = runner.forward(chunks)
        for rows, got in zip(rows_per_chunk, b):
            assert np.array_equal(np.asarray(a)[rows], got)
        assert sorted(topk_a) == sorted(topk_b) == list(cfg.index_source_layers)
        num_tokens = sum(len(c.tokens) for c in chunks)
        for layer in topk_a:
            assert np.array_equal(np.asarray(topk_a[layer])[:num_tokens], np.concatenate(topk_b[layer]))
    with pytest.raises(ValueError, match="all or none"):
        runner.forward(steps[1], {1: np.zeros((2, cfg.index_topk), np.int32)})


def test_accelerator_placement_writes_each_tensor_into_its_stacked_slot(monkeypatch):
    """Off the CPU, stacked parameters are filled in place one layer (and one expert) at a time."""
    cfg = _repeating()
    tree = param_map.checkpoint_tree(cfg, random_params(cfg, seed=2))
    for layer in tree["layers"]:  # routed experts as the checkpoint loader hands them over: one array per expert
        for w in layer["ffn"]["experts"].values():
            for k in ("weight", "scale"):
                w[k] = list(np.asarray(w[k]))
    host = param_map.state_from_tree(cfg, tree)
    monkeypatch.setattr(param_map.jax, "default_backend", lambda: "gpu")
    placed = param_map.state_from_tree(cfg, tree)
    for (path, a), (_, b) in zip(nnx.to_flat_state(host), nnx.to_flat_state(placed)):
        assert np.array_equal(np.asarray(a.get_value()).view(np.uint8), np.asarray(b.get_value()).view(np.uint8)), path
