"""Unit tests for dijax.config: both on-disk config formats, per-layer roles and validation."""

import dijax  # noqa: F401  (sets XLA flags before jax initialises)

import dataclasses
import json
import os

import pytest

from dijax.config import LayerRole, ModelConfig

from tests.conftest import PARITY_DIR

TINY = os.path.join(PARITY_DIR, "tiny")
NODROP = os.path.join(PARITY_DIR, "tiny-nodrop")

COMPARED = ("vocab_size", "dim", "moe_inter_dim", "n_layers", "n_mtp_layers", "n_heads", "n_routed_experts",
            "n_activated_experts", "n_shared_experts", "q_lora_rank", "head_dim", "rope_head_dim", "o_groups",
            "o_lora_rank", "window_size", "compress_ratios", "kv_source_layers", "index_source_layers",
            "index_n_heads", "index_head_dim", "index_topk", "score_func", "route_scale", "swiglu_limit", "norm_eps",
            "candidate_source_layer", "candidate_topk_blocks", "candidate_block_size", "rope_theta",
            "compress_rope_theta", "original_seq_len", "rope_factor", "beta_fast", "beta_slow", "hc_mult",
            "hc_sinkhorn_iters", "hc_eps", "engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size",
            "engram_vocab_size", "engram_n_heads", "engram_head_dim", "engram_pad_id",
            "engram_compressed_vocab_size", "dtype", "expert_dtype", "max_seq_len")


@pytest.fixture(scope="module")
def hf():
    return ModelConfig.from_file(os.path.join(TINY, "config.json"))


@pytest.fixture(scope="module")
def ref():
    return ModelConfig.from_file(os.path.join(TINY, "inference_config.json"))


# ---------------------------------------------------------------------------------------------------------------------
# readers
# ---------------------------------------------------------------------------------------------------------------------

def test_tiny_values(hf):
    assert hf.dim == 256 and hf.n_layers == 9 and hf.n_mtp_layers == 1
    assert hf.compress_ratios == (0, 0, 2, 2, 2, 1, 1, 1, 1, 0)
    assert hf.kv_source_layers == (2, 5) and hf.index_source_layers == (2, 5, 7)
    assert hf.index_topk == 8 and hf.window_size == 16
    assert hf.candidate_source_layer == 5 and hf.candidate_topk_blocks == 3 and hf.candidate_block_size == 4
    assert hf.engram_layer_ids == (1, 4) and hf.engram_num_embeddings == (4062, 4152)
    assert hf.engram_max_ngram_size == 3 and hf.engram_vocab_size == 1000 and hf.engram_n_heads == 2
    assert hf.engram_head_dim == 32 and hf.engram_pad_id == 2 and hf.engram_compressed_vocab_size == 409
    assert hf.rope_factor == 4 and hf.original_seq_len == 64 and hf.beta_fast == 32 and hf.beta_slow == 1
    assert hf.rope_theta == 10000.0 and hf.compress_rope_theta == 160000.0
    assert hf.norm_eps == 1e-20
    assert hf.hc_mult == 4 and hf.hc_sinkhorn_iters == 20 and hf.hc_eps == 1e-6
    assert hf.n_heads == 4 and hf.head_dim == 64 and hf.rope_head_dim == 16 and hf.q_lora_rank == 64
    assert hf.o_groups == 2 and hf.o_lora_rank == 32 and hf.index_n_heads == 4 and hf.index_head_dim == 32
    assert hf.n_routed_experts == 8 and hf.n_activated_experts == 2 and hf.route_scale == 1.5
    assert hf.swiglu_limit == 10.0 and hf.max_seq_len == 512 and hf.moe_inter_dim == 128
    assert hf.dtype == "fp8" and hf.expert_dtype == "fp4"
    # derived sizes
    assert hf.nope_head_dim == 48 and hf.hc_mix == 24 and hf.engram_n_cols == 4


def test_hf_and_reference_formats_agree(hf, ref):
    for name in COMPARED:
        assert getattr(hf, name) == getattr(ref, name), name
    assert hf == ref
    assert hf.roles == ref.roles


def test_from_file_directory_reads_config_json(hf):
    assert ModelConfig.from_file(TINY) == hf


def test_sequence_fields_are_tuples(hf):
    for name in ("compress_ratios", "kv_source_layers", "index_source_layers", "engram_layer_ids",
                 "engram_num_embeddings"):
        assert isinstance(getattr(hf, name), tuple), name
    hash(hf)  # frozen and hashable


def test_nodrop_differs_only_in_candidate_sizes(hf):
    nodrop = ModelConfig.from_file(os.path.join(NODROP, "config.json"))
    assert nodrop.index_topk == 256 and nodrop.candidate_topk_blocks == 64
    diffs = [f.name for f in dataclasses.fields(ModelConfig) if f.init and getattr(nodrop, f.name) != getattr(hf, f.name)]
    assert sorted(diffs) == ["candidate_topk_blocks", "index_topk"]
    assert nodrop == hf.replace(index_topk=256, candidate_topk_blocks=64)
    if os.path.exists(os.path.join(NODROP, "inference_config.json")):
        assert ModelConfig.from_file(os.path.join(NODROP, "inference_config.json")) == nodrop


def test_from_dict_missing_required_key():
    with open(os.path.join(TINY, "inference_config.json")) as f:
        raw = json.load(f)
    for key in ("index_topk", "dim", "compress_ratios"):
        broken = {k: v for k, v in raw.items() if k != key}
        with pytest.raises(ValueError, match=key):
            ModelConfig.from_dict(broken)


def test_from_dict_missing_required_key_hf_format():
    with open(os.path.join(TINY, "config.json")) as f:
        raw = json.load(f)
    raw["text_config"] = {k: v for k, v in raw["text_config"].items() if k != "num_hidden_layers"}
    with pytest.raises(ValueError, match="n_layers|num_hidden_layers"):
        ModelConfig.from_dict(raw)


# ---------------------------------------------------------------------------------------------------------------------
# roles
# ---------------------------------------------------------------------------------------------------------------------

def _role(layer, ratio, kv_from=-1, topk_from=-1, kv_source=False, index_source=False, candidate_source=False,
          uses_candidates=False, index_keys_from=-1, engram_index=-1):
    return LayerRole(layer=layer, ratio=ratio, kv_source=kv_source, index_source=index_source,
                     owns_index_keys=kv_source and index_source, candidate_source=candidate_source,
                     uses_candidates=uses_candidates, kv_from=kv_from, index_keys_from=index_keys_from,
                     topk_from=topk_from, engram=engram_index >= 0, engram_index=engram_index)


def test_roles_tiny(hf):
    want = (
        _role(0, 0),
        _role(1, 0, engram_index=0),
        _role(2, 2, kv_from=2, topk_from=2, kv_source=True, index_source=True, index_keys_from=2),
        _role(3, 2, kv_from=2, topk_from=2),
        _role(4, 2, kv_from=2, topk_from=2, engram_index=1),
        _role(5, 1, kv_from=5, topk_from=5, kv_source=True, index_source=True, candidate_source=True,
              index_keys_from=5),
        _role(6, 1, kv_from=5, topk_from=5),
        _role(7, 1, kv_from=5, topk_from=7, index_source=True, uses_candidates=True, index_keys_from=5),
        _role(8, 1, kv_from=5, topk_from=7),
    )
    assert hf.roles == want
    assert len(hf.roles) == hf.n_layers  # the MTP layer has no backbone role
    r2, r7 = hf.roles[2], hf.roles[7]
    assert r2.owns_index_keys and not r7.owns_index_keys and not r7.kv_source
    assert [r.compressed for r in hf.roles] == [False, False] + [True] * 7
    assert [r.layer for r in hf.kv_source_roles] == [2, 5]
    assert [r.layer for r in hf.index_source_roles] == [2, 5, 7]


def test_roles_are_frozen(hf):
    with pytest.raises(dataclasses.FrozenInstanceError):
        hf.roles[0].ratio = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        hf.dim = 512


def test_replace_rebuilds_roles(hf):
    # moving the candidate source off: layer 7 no longer masks with candidates
    c = hf.replace(candidate_source_layer=-1)
    assert not any(r.candidate_source or r.uses_candidates for r in c.roles)
    assert c.roles[7].topk_from == 7 and c.roles[7].index_keys_from == 5
    # a valid change passes validation: index_topk up to candidate_topk_blocks * candidate_block_size = 12
    assert hf.replace(index_topk=12).index_topk == 12
    assert hf.replace(engram_layer_ids=(0, 8)).roles[8].engram_index == 1


# ---------------------------------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, field", [
    (dict(compress_ratios=(0, 0, 0, 2, 2, 1, 1, 1, 1, 0)), "kv_source_layers|index_source_layers"),
    (dict(compress_ratios=(0, 0, 2, 1, 2, 1, 1, 1, 1, 0)), "compress_ratios"),
    (dict(candidate_topk_blocks=1), "candidate_topk_blocks"),
    (dict(index_topk=13), "candidate_topk_blocks"),
    (dict(dim=250), "dim"),
    (dict(dim=0), "dim"),
    (dict(head_dim=48), "head_dim"),
    (dict(n_heads=0), "n_heads"),
    (dict(n_heads=-4), "n_heads"),
    (dict(window_size=0), "window_size"),
    (dict(index_topk=-1), "index_topk"),
    (dict(vocab_size=True), "vocab_size"),
    (dict(compress_ratios=(0, 0, 2, 2, 2)), "compress_ratios"),
    (dict(compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1, 1, 0, 0)), "compress_ratios"),
    (dict(n_shared_experts=2), "n_shared_experts"),
    (dict(score_func="softmax"), "score_func"),
    (dict(candidate_source_layer=6), "candidate_source_layer"),
    (dict(engram_num_embeddings=(4062,)), "engram_num_embeddings"),
    (dict(index_source_layers=(2, 7)), "index_source_layers"),  # 7 reads keys from KV source 5: no indexer there
    (dict(kv_source_layers=(5,), index_source_layers=(5, 7)), "kv_source_layers"),  # ratio-2 layers lose a source
    (dict(n_activated_experts=9), "n_activated_experts"),
    (dict(dtype="int4"), "dtype"),
    (dict(o_groups=3), "o_groups"),
    (dict(engram_head_dim=48), "engram_head_dim"),
])
def test_invalid_configs_name_the_field(hf, changes, field):
    # the message quotes the offending field ("config field 'dim': ..."), so 'dim' does not match 'head_dim'
    with pytest.raises(ValueError, match=f"'({field})'"):
        hf.replace(**changes)
