"""The tensors a DeepSeek-V4.1 checkpoint must hold, derived from the config and the per-layer roles.

``backbone_spec(cfg)`` lists every backbone tensor of the Hugging Face checkpoint with its safetensors dtype and
shape (v41_spec §15, parity README §5.3). Scales are derived per role: fp8 Linears carry one ue8m0 scale per
32x32 tile ([ceil(out/32), ceil(in/32)]); MXFP4 routed experts are int8 [out, in/2] (two e2m1 codes per byte) with
one ue8m0 scale per 1x32 ([out, in/32], so the block is 32 elements, never the 16 the packed shape suggests);
Engram tables are fp8 rows with one scale per 32 values.
"""

from __future__ import annotations

from dataclasses import dataclass

from dijax.config import FP4_BLOCK, FP8_BLOCK, ModelConfig


@dataclass(frozen=True)
class TensorSpec:
    """Expected safetensors dtype(s) and shape of one tensor, and its role (for messages)."""

    dtypes: tuple[str, ...]
    shape: tuple[int, ...]
    role: str


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fp8_linear(spec: dict, name: str, out_dim: int, in_dim: int) -> None:
    spec[f"{name}.weight"] = TensorSpec(("F8_E4M3",), (out_dim, in_dim), "fp8 linear weight")
    spec[f"{name}.scale"] = TensorSpec(("F8_E8M0",), (_cdiv(out_dim, FP8_BLOCK), _cdiv(in_dim, FP8_BLOCK)),
                                       "fp8 linear scale: one ue8m0 per 32x32 tile")


def _bf16(spec: dict, name: str, *shape: int, role: str = "bf16 tensor") -> None:
    spec[name] = TensorSpec(("BF16",), tuple(shape), role)


def _expert(spec: dict, name: str, out_dim: int, in_dim: int, expert_dtype: str | None) -> None:
    if expert_dtype == "fp4":
        spec[f"{name}.weight"] = TensorSpec(("I8", "F4", "U8"), (out_dim, in_dim // 2),
                                            "MXFP4 expert weight: two e2m1 codes per byte")
        spec[f"{name}.scale"] = TensorSpec(("F8_E8M0",), (out_dim, in_dim // FP4_BLOCK),
                                           "MXFP4 expert scale: one ue8m0 per 1x32 block")
    else:
        _fp8_linear(spec, name, out_dim, in_dim)


def backbone_spec(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every backbone tensor of the HF checkpoint (``mtp.*`` and vision tensors are not included)."""
    c = cfg
    spec: dict[str, TensorSpec] = {}
    _bf16(spec, "embed.weight", c.vocab_size, c.dim)
    _bf16(spec, "norm.weight", c.dim)
    _bf16(spec, "head.weight", c.vocab_size, c.dim)
    hk = c.n_heads * c.head_dim
    for role in c.roles:
        p = f"layers.{role.layer}"
        spec[f"{p}.attn.attn_sink"] = TensorSpec(("F32",), (c.n_heads,), "attention sink")
        _bf16(spec, f"{p}.attn.q_norm.weight", c.q_lora_rank)
        _bf16(spec, f"{p}.attn.kv_norm.weight", c.head_dim)
        _fp8_linear(spec, f"{p}.attn.wq_a", c.q_lora_rank, c.dim)
        _fp8_linear(spec, f"{p}.attn.wq_b", hk, c.q_lora_rank)
        _fp8_linear(spec, f"{p}.attn.wkv", c.head_dim, c.dim)
        _fp8_linear(spec, f"{p}.attn.wo_a", c.o_groups * c.o_lora_rank, hk // c.o_groups)
        _fp8_linear(spec, f"{p}.attn.wo_b", c.dim, c.o_groups * c.o_lora_rank)
        _bf16(spec, f"{p}.attn_norm.weight", c.dim)
        _bf16(spec, f"{p}.ffn_norm.weight", c.dim)
        for sub in ("attn", "ffn"):
            spec[f"{p}.hc_{sub}_fn"] = TensorSpec(("F32",), (c.hc_mix, c.hc_mult * c.dim), "hyper-connection fn")
            spec[f"{p}.hc_{sub}_base"] = TensorSpec(("F32",), (c.hc_mix,), "hyper-connection base")
            spec[f"{p}.hc_{sub}_scale"] = TensorSpec(("F32",), (3,), "hyper-connection scale")
        _bf16(spec, f"{p}.ffn.gate.weight", c.n_routed_experts, c.dim)
        spec[f"{p}.ffn.gate.bias"] = TensorSpec(("F32",), (c.n_routed_experts,), "gate selection bias")
        for e in range(c.n_routed_experts):
            _expert(spec, f"{p}.ffn.experts.{e}.w1", c.moe_inter_dim, c.dim, c.expert_dtype)
            _expert(spec, f"{p}.ffn.experts.{e}.w3", c.moe_inter_dim, c.dim, c.expert_dtype)
            _expert(spec, f"{p}.ffn.experts.{e}.w2", c.dim, c.moe_inter_dim, c.expert_dtype)
        _fp8_linear(spec, f"{p}.ffn.shared_experts.w1", c.moe_inter_dim, c.dim)
        _fp8_linear(spec, f"{p}.ffn.shared_experts.w3", c.moe_inter_dim, c.dim)
        _fp8_linear(spec, f"{p}.ffn.shared_experts.w2", c.dim, c.moe_inter_dim)
        if role.kv_source:
            _bf16(spec, f"{p}.attn.compressor.wkv.weight", c.head_dim, c.dim, role="compressor wkv")
            _bf16(spec, f"{p}.attn.compressor.norm.weight", c.head_dim)
            if role.ratio > 1:
                _bf16(spec, f"{p}.attn.compressor.wgate.weight", c.head_dim, c.dim, role="compressor gate")
        if role.index_source:
            _fp8_linear(spec, f"{p}.attn.indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank)
            _bf16(spec, f"{p}.attn.indexer.weights_proj.weight", c.index_n_heads, c.dim)
            if role.owns_index_keys:
                _bf16(spec, f"{p}.attn.indexer.wk.weight", c.index_head_dim, c.head_dim)
                _bf16(spec, f"{p}.attn.indexer.k_norm.weight", c.index_head_dim)
        if role.engram:
            rows = c.engram_num_embeddings[role.engram_index]
            spec[f"{p}.engram.embed.weight"] = TensorSpec(("F8_E4M3",), (rows, c.engram_head_dim), "Engram table")
            spec[f"{p}.engram.embed.scale"] = TensorSpec(("F8_E8M0",), (rows, c.engram_head_dim // FP8_BLOCK),
                                                         "Engram table scale: one ue8m0 per 32 values")
            _fp8_linear(spec, f"{p}.engram.wkv", (c.hc_mult + 1) * c.dim, c.engram_n_cols * c.engram_head_dim)
            _bf16(spec, f"{p}.engram.q_weight", c.hc_mult, c.dim)
            _bf16(spec, f"{p}.engram.k_weight", c.hc_mult, c.dim)
    return spec
