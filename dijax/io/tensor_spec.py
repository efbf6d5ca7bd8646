"""The tensors a DeepSeek-V4.1 checkpoint must hold, derived from the config and the per-layer roles.

``backbone_spec(cfg)`` lists every backbone tensor of the Hugging Face checkpoint with its safetensors dtype and
shape (v41_spec §15, parity README §5.3). Scales are derived per role: fp8 Linears carry one ue8m0 scale per
32x32 tile ([ceil(out/32), ceil(in/32)]); MXFP4 routed experts are int8 [out, in/2] (two e2m1 codes per byte) with
one ue8m0 scale per 1x32 ([out, in/32], so the block is 32 elements, never the 16 the packed shape suggests);
Engram tables are fp8 rows with one scale per 32 values.

``backbone_spec(cfg, "dijax")`` is the loadable layout (what ``dijax convert`` writes, and the reference layout):
``attn.wo_a`` dequantised to bf16 without a scale, routed experts MXFP4-packed or re-encoded as fp8 tiles.
``check_tensors`` compares a checkpoint's headers with a spec; ``dijax convert`` and the loader both use it, so a
checkpoint that disagrees with its config is refused, naming the tensor, before any tensor is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import os

from dijax.config import ModelConfig
from dijax.kernels.quant import FP4_BLOCK, FP8_BLOCK
from dijax.io.safetensors import SafetensorsFile, checkpoint_files


LAYOUTS = ("hf", "dijax")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the tensor and what was expected."""


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


def stored_shape(dtype: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape as the bytes are laid out: an ``F4`` header gives the logical [.., in], stored as [.., in / 2]."""
    shape = tuple(shape)
    return shape[:-1] + (shape[-1] // 2,) if dtype == "F4" else shape


def backbone_spec(cfg: ModelConfig, layout: str = "hf", expert_dtype: str | None = None) -> dict[str, TensorSpec]:
    """Every backbone tensor of a checkpoint (``mtp.*`` and vision tensors are not included).

    layout        "hf": the Hugging Face release; "dijax": the loadable layout (see the module docstring).
    expert_dtype  "fp4" or "fp8": how routed experts are stored (default: the config's ``expert_dtype``).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    c = cfg
    expert_dtype = expert_dtype or c.expert_dtype
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
        if layout == "hf":
            _fp8_linear(spec, f"{p}.attn.wo_a", c.o_groups * c.o_lora_rank, hk // c.o_groups)
        else:
            _bf16(spec, f"{p}.attn.wo_a.weight", c.o_groups * c.o_lora_rank, hk // c.o_groups,
                  role="wo_a, dequantised to bf16")
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
            _expert(spec, f"{p}.ffn.experts.{e}.w1", c.moe_inter_dim, c.dim, expert_dtype)
            _expert(spec, f"{p}.ffn.experts.{e}.w3", c.moe_inter_dim, c.dim, expert_dtype)
            _expert(spec, f"{p}.ffn.experts.{e}.w2", c.dim, c.moe_inter_dim, expert_dtype)
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


def check_tensors(cfg: ModelConfig, found: dict[str, tuple[str, tuple[int, ...]]],
                  spec: dict[str, TensorSpec]) -> None:
    """Raise CheckpointError unless ``found`` holds exactly the tensors of ``spec`` with their dtypes and shapes.

    found  backbone tensor name -> (safetensors dtype, shape as in the header), without ``mtp.*`` tensors.
    """
    missing = sorted(set(spec) - set(found))
    unexpected = sorted(set(found) - set(spec))
    if missing:
        raise CheckpointError(f"{len(missing)} expected tensor(s) missing, e.g. {missing[:4]} "
                              f"(for n_layers={cfg.n_layers}, n_routed_experts={cfg.n_routed_experts}, "
                              f"compress_ratios, kv/index source layers of the config)")
    if unexpected:
        raise CheckpointError(f"{len(unexpected)} tensor(s) the config does not explain, e.g. {unexpected[:4]} "
                              f"(n_layers={cfg.n_layers}, n_routed_experts={cfg.n_routed_experts}; a compressor "
                              f"wgate exists only at ratio > 1, an indexer only at index sources)")
    for name, expected in spec.items():
        dtype, shape = found[name]
        if dtype not in expected.dtypes:
            raise CheckpointError(f"tensor {name!r} ({expected.role}) has dtype {dtype}, expected "
                                  f"{' or '.join(expected.dtypes)}")
        shape = stored_shape(dtype, shape)
        if shape != expected.shape:
            hint = ""
            if name.endswith(".scale") and ".ffn.experts." in name:
                hint = (f"; MXFP4 scales cover blocks of {FP4_BLOCK} elements of the logical [out, in] weight "
                        f"(the packed int8 shape shows in/2: a block of 16 would read MXFP4 as NVFP4)")
            raise CheckpointError(f"tensor {name!r} ({expected.role}) has shape {list(shape)}, expected "
                                  f"{list(expected.shape)}{hint} (derived from the config: vocab_size="
                                  f"{cfg.vocab_size}, dim={cfg.dim}, moe_inter_dim={cfg.moe_inter_dim}, ...)")


def check_checkpoint(cfg: ModelConfig, path: str | os.PathLike) -> None:
    """Check a loadable checkpoint (dijax or reference layout: a file or a directory of shards) against ``cfg``
    from its headers alone, before any tensor is read: every tensor lies inside its file, and the backbone tensors
    are exactly those of ``backbone_spec(cfg, "dijax")`` (routed experts as stored: fp8 tiles when the first
    expert weight is F8_E4M3, else MXFP4). ``mtp.*`` tensors are not checked. Raises CheckpointError naming
    ``path`` and the tensor."""
    path = os.fspath(path)
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in checkpoint_files(path):
        st = SafetensorsFile(file)
        st.check_extents()
        for name, info in st.header.items():
            if name.endswith(".attn.wo_a.scale"):
                raise CheckpointError(f"{path} holds an fp8 'attn.wo_a' with its scale (the Hugging Face layout): "
                                      f"convert it first (`dijax convert`, or pass its folder to --model)")
            if not name.startswith("mtp."):
                found[name] = (info["dtype"], tuple(info["shape"]))
    first_expert = found.get("layers.0.ffn.experts.0.w1.weight", ("",))[0]
    try:
        check_tensors(cfg, found, backbone_spec(cfg, "dijax", "fp8" if first_expert == "F8_E4M3" else None))
    except CheckpointError as error:
        raise CheckpointError(f"{path} does not match its config: {error}") from None
