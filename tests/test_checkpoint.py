"""Checkpoint reading: header-based safetensors views, both fixture layouts load to identical parameters."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dijax.io.checkpoint import load_params, params_from_tensors, resolve_checkpoint
from dijax.io.safetensors import SafetensorsFile, checkpoint_files
from dijax.config import ModelConfig
from dijax.model.param_map import checkpoint_tree
from tests.conftest import parity_path


def test_hf_and_reference_layouts_load_identically(tmp_path, capsys):
    cfg = ModelConfig.from_file(parity_path("tiny", "config.json"))
    ref = load_params(cfg, parity_path("tiny", "reference", "model.safetensors"))
    converted = resolve_checkpoint(parity_path("tiny", "hf"), cache_dir=str(tmp_path), progress=False)
    assert "converting it once" in capsys.readouterr().out
    assert resolve_checkpoint(parity_path("tiny", "hf"), cache_dir=str(tmp_path)) == converted  # reused
    assert "converting" not in capsys.readouterr().out
    hf = load_params(cfg, converted)
    leaves_ref, tree_ref = jax.tree.flatten(ref)
    leaves_hf, tree_hf = jax.tree.flatten(hf)
    assert tree_ref == tree_hf
    for a, b in zip(leaves_ref, leaves_hf):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_dtypes_and_shapes_follow_the_roles():
    cfg = ModelConfig.from_file(parity_path("tiny", "config.json"))
    p = checkpoint_tree(cfg, load_params(cfg, parity_path("tiny", "reference", "model.safetensors")))
    # the checkpoint's own dtypes: the reference's fp32 promotions happen in the computation, not in memory
    assert p["head"]["weight"].dtype == jax.numpy.bfloat16
    assert p["layers"][2]["attn"]["compressor"]["wkv"]["weight"].dtype == jax.numpy.bfloat16
    assert p["layers"][5]["attn"]["compressor"]["wkv"]["weight"].dtype == jax.numpy.bfloat16
    w1 = p["layers"][0]["ffn"]["experts"]["w1"]
    assert w1["weight"].shape == (cfg.n_routed_experts, cfg.moe_inter_dim, cfg.dim // 2)  # packed MXFP4
    assert w1["scale"].shape == (cfg.n_routed_experts, cfg.moe_inter_dim, cfg.dim // 32)
    assert p["layers"][0]["attn"]["wo_a"]["weight"].dtype == jax.numpy.bfloat16


def test_stacked_experts_load_like_per_expert_tensors():
    cfg = ModelConfig.from_file(parity_path("tiny", "config.json"))
    file = SafetensorsFile(parity_path("tiny", "reference", "model.safetensors"))
    tensors = {n: np.array(file.get(n)) for n in file.names()}
    per_expert = params_from_tensors(cfg, tensors.items())

    def stacked(drop: str | None = None, keep_expert0: bool = False):
        for name, array in tensors.items():
            parts = name.split(".")
            if parts[2:4] != ["ffn", "experts"]:
                yield name, array
            elif keep_expert0 and parts[4] == "0":
                yield name, array
        for layer in range(cfg.n_layers):
            for w in ("w1", "w2", "w3"):
                for k in ("weight", "scale"):
                    if w != drop:
                        yield f"layers.{layer}.ffn.experts.{w}.{k}", np.stack(
                            [tensors[f"layers.{layer}.ffn.experts.{e}.{w}.{k}"] for e in range(cfg.n_routed_experts)])

    got = params_from_tensors(cfg, stacked())
    assert jax.tree.structure(got) == jax.tree.structure(per_expert)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(per_expert)):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    with pytest.raises(ValueError, match="either all per expert or stacked"):
        params_from_tensors(cfg, stacked(drop="w2"))
    with pytest.raises(ValueError, match="either all per expert or stacked"):
        params_from_tensors(cfg, stacked(keep_expert0=True))


def test_truncated_file_and_missing_shard_are_reported(tmp_path):
    src = parity_path("tiny", "reference", "model.safetensors")
    data = open(src, "rb").read()
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(data[: len(data) // 2])
    st = SafetensorsFile(bad)
    last = max(st.header, key=lambda n: st.header[n]["data_offsets"][1])
    with pytest.raises(ValueError, match="truncated"):
        st.get(last)
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "model.safetensors.index.json").write_text(
        '{"weight_map": {"embed.weight": "model-00001-of-00001.safetensors"}}')
    with pytest.raises(FileNotFoundError, match="model-00001-of-00001"):
        checkpoint_files(tmp_path / "shards")
