"""Model configuration: one immutable ``ModelConfig`` read from either config format, plus per-layer roles.

Two on-disk formats describe the same model (v41_spec §1):

* the Hugging Face ``config.json`` (keys under ``text_config``, e.g. ``hidden_size``), and
* the reference ``inference_config.json`` (``ModelArgs`` keys, e.g. ``dim``).

Both are read into ``ModelConfig``. ``ModelConfig.roles`` holds one ``LayerRole`` per backbone layer, built once
from the raw ratio / source lists; the model reads roles and never compares a ratio with a magic number.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from dijax.kernels.quant import FP8_BLOCK, LATENT_FP4_BLOCK


# ModelArgs key -> HF text_config key, where they differ (v41_spec §1).
_HF_NAMES = {
    "dim": "hidden_size",
    "moe_inter_dim": "moe_intermediate_size",
    "n_layers": "num_hidden_layers",
    "n_mtp_layers": "num_nextn_predict_layers",
    "n_heads": "num_attention_heads",
    "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "rope_head_dim": "qk_rope_head_dim",
    "norm_eps": "rms_norm_eps",
    "window_size": "sliding_window",
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id",
    "engram_pad_id": "engram_pad_token_id",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
    "max_seq_len": "max_position_embeddings",
}
_ROPE_SCALING = {
    "rope_factor": "factor",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "original_seq_len": "original_max_position_embeddings",
}


@dataclass(frozen=True)
class LayerRole:
    """What one backbone layer does, decided once from the config.

    Attributes:
      layer: layer index.
      ratio: compression ratio; 0 = sliding window only.
      kv_source: owns a Compressor and writes the compressed-KV cache (and index keys when ``index_source``).
      index_source: owns an Indexer and selects its own top-k compressed positions.
      owns_index_keys: kv_source and index_source: its indexer writes the index-key cache.
      candidate_source: its indexer also publishes the level-1 candidate block mask.
      uses_candidates: index source above the candidate source: its scores are masked by the candidates.
      kv_from: layer whose compressed-KV cache this layer reads (-1 when ratio == 0).
      index_keys_from: layer whose index-key cache this layer's indexer scores against (-1 if not an index source).
      topk_from: index-source layer whose selection this layer attends to (-1 when ratio == 0).
      engram: an Engram lookup is applied to the stream before this block.
      engram_index: position of this layer in ``engram_layer_ids`` (-1 when not an Engram layer).
    """

    layer: int
    ratio: int
    kv_source: bool
    index_source: bool
    owns_index_keys: bool
    candidate_source: bool
    uses_candidates: bool
    kv_from: int
    index_keys_from: int
    topk_from: int
    engram: bool
    engram_index: int

    @property
    def compressed(self) -> bool:
        """Attends to compressed positions in addition to its window."""
        return self.ratio > 0


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V4.1 text-model hyper-parameters (``ModelArgs`` naming). Immutable; validated at construction."""

    vocab_size: int
    dim: int
    moe_inter_dim: int
    n_layers: int
    n_heads: int
    n_routed_experts: int
    n_activated_experts: int
    q_lora_rank: int
    head_dim: int
    rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    compress_ratios: tuple[int, ...]
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_mtp_layers: int = 0
    n_shared_experts: int = 1
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.0
    norm_topk_prob: bool = True
    gate_temp: float = 1.0
    swiglu_limit: float = 0.0
    norm_eps: float = 1e-20
    candidate_source_layer: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 0
    rope_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 1
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 0
    dtype: str = "fp8"
    expert_dtype: str | None = "fp4"
    max_seq_len: int = 4096
    bos_token_id: int = 0
    eos_token_id: int = 1
    roles: tuple[LayerRole, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _validate(self)
        object.__setattr__(self, "roles", _build_roles(self))

    # ---- derived sizes -------------------------------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def hc_mix(self) -> int:
        """Width of one hyper-connection mix: pre (C) + post (C) + comb (C*C)."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def engram_n_cols(self) -> int:
        """Hash columns per Engram layer: (max_ngram - 1) n-gram sizes x n_heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def kv_source_roles(self) -> tuple[LayerRole, ...]:
        return tuple(r for r in self.roles if r.kv_source)

    @property
    def index_source_roles(self) -> tuple[LayerRole, ...]:
        return tuple(r for r in self.roles if r.index_source)

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed (validated again)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        fields.update(changes)
        return ModelConfig(**fields)

    # ---- readers ---------------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from an HF ``config.json`` dict (detected by ``text_config`` / ``hidden_size``) or ``ModelArgs`` keys."""
        if "text_config" in raw or "hidden_size" in raw:
            args = _hf_to_args(raw)
        else:
            args = dict(raw)
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        kwargs = {k: v for k, v in args.items() if k in names}
        for key in ("compress_ratios", "kv_source_layers", "index_source_layers", "engram_layer_ids",
                    "engram_num_embeddings"):
            if key in kwargs:
                kwargs[key] = tuple(int(v) for v in kwargs[key])
        missing = sorted(n for n in _REQUIRED if n not in kwargs)
        if missing:
            raise ValueError(f"config is missing required field(s) {missing}")
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read ``config.json`` (HF) or ``inference_config.json`` (reference); a directory means its config.json."""
        path = os.fspath(path)
        if os.path.isdir(path):
            for name in ("config.json", "inference_config.json"):
                if os.path.exists(os.path.join(path, name)):
                    path = os.path.join(path, name)
                    break
            else:
                raise FileNotFoundError(f"no config.json or inference_config.json in {path}")
        with open(path) as f:
            try:
                raw = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise ValueError(f"{path}: not a valid JSON config ({error})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a config must be a JSON object, got {type(raw).__name__}")
        try:
            return cls.from_dict(raw)
        except (ValueError, TypeError) as error:
            raise type(error)(f"{path}: {error}") from None


_REQUIRED = ("vocab_size", "dim", "moe_inter_dim", "n_layers", "n_heads", "n_routed_experts", "n_activated_experts",
             "q_lora_rank", "head_dim", "rope_head_dim", "o_groups", "o_lora_rank", "window_size", "compress_ratios",
             "kv_source_layers", "index_source_layers", "index_n_heads", "index_head_dim", "index_topk")


def _hf_to_args(raw: dict[str, Any]) -> dict[str, Any]:
    text = dict(raw.get("text_config", raw))
    args: dict[str, Any] = {}
    inverse = {hf: ref for ref, hf in _HF_NAMES.items()}
    for key, value in text.items():
        if key != "dtype":  # HF's "dtype" is the torch dtype of unquantised tensors, not ModelArgs.dtype
            args[inverse.get(key, key)] = value
    scaling = text.get("rope_scaling") or {}
    for ref, hf in _ROPE_SCALING.items():
        if hf in scaling:
            args[ref] = scaling[hf]
    quant = raw.get("quantization_config") or text.get("quantization_config") or {}
    if quant:
        args["dtype"] = quant.get("quant_method", "fp8")
        args["expert_dtype"] = quant.get("expert_dtype", "fp4")
    else:
        args.setdefault("dtype", "bf16")
        args.setdefault("expert_dtype", None)
    for key in ("bos_token_id", "eos_token_id"):
        if key in raw and key not in args:
            args[key] = raw[key]
    return args


def _fail(name: str, message: str) -> None:
    raise ValueError(f"config field {name!r}: {message}")


def _validate(c: ModelConfig) -> None:
    for name in ("vocab_size", "dim", "moe_inter_dim", "n_layers", "n_heads", "n_routed_experts",
                 "n_activated_experts", "q_lora_rank", "head_dim", "rope_head_dim", "o_groups", "o_lora_rank",
                 "window_size", "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters",
                 "max_seq_len"):
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            _fail(name, f"must be a positive integer, got {value!r}")
    if c.n_shared_experts != 1:
        _fail("n_shared_experts", f"must be 1 (the reference asserts exactly one), got {c.n_shared_experts}")
    if c.score_func != "sqrtsoftplus":
        _fail("score_func", f"only 'sqrtsoftplus' is supported (V4.1), got {c.score_func!r}")
    if c.n_activated_experts > c.n_routed_experts:
        _fail("n_activated_experts", f"{c.n_activated_experts} exceeds n_routed_experts={c.n_routed_experts}")
    if c.dtype not in ("fp8", "bf16"):
        _fail("dtype", f"must be 'fp8' or 'bf16', got {c.dtype!r}")
    if c.expert_dtype not in ("fp4", "fp8", None):
        _fail("expert_dtype", f"must be 'fp4', 'fp8' or null, got {c.expert_dtype!r}")
    if c.rope_head_dim % 2 or c.rope_head_dim > c.head_dim:
        _fail("rope_head_dim", f"must be even and <= head_dim={c.head_dim}, got {c.rope_head_dim}")
    if c.rope_head_dim > c.index_head_dim:
        _fail("rope_head_dim", f"must be <= index_head_dim={c.index_head_dim}, got {c.rope_head_dim}")
    if c.n_heads % c.o_groups:
        _fail("o_groups", f"must divide n_heads={c.n_heads}, got {c.o_groups}")
    # quantisation blocks must tile the dims they quantise (v41_spec §12)
    for name in ("dim", "head_dim", "q_lora_rank", "moe_inter_dim", "index_head_dim"):
        if getattr(c, name) % FP8_BLOCK:
            _fail(name, f"must be a multiple of the quant block {FP8_BLOCK}, got {getattr(c, name)}")
    if c.head_dim % LATENT_FP4_BLOCK:
        _fail("head_dim", f"must be a multiple of {LATENT_FP4_BLOCK} (compressed-latent fp4 block)")
    if (c.o_groups * c.o_lora_rank) % FP8_BLOCK:
        _fail("o_lora_rank", f"o_groups * o_lora_rank must be a multiple of {FP8_BLOCK}")

    n_total = c.n_layers + c.n_mtp_layers
    if len(c.compress_ratios) not in (c.n_layers, n_total):
        _fail("compress_ratios", f"needs {n_total} entries (n_layers + n_mtp_layers), got {len(c.compress_ratios)}")
    for layer, ratio in enumerate(c.compress_ratios):
        if ratio < 0:
            _fail("compress_ratios", f"layer {layer} has negative ratio {ratio}")
    for name in ("kv_source_layers", "index_source_layers", "engram_layer_ids"):
        ids = getattr(c, name)
        if len(set(ids)) != len(ids) or list(ids) != sorted(ids):
            _fail(name, f"must be strictly increasing layer ids, got {list(ids)}")
        for layer in ids:
            if not 0 <= layer < c.n_layers:
                _fail(name, f"layer {layer} is outside the backbone 0..{c.n_layers - 1}")
    ratios = c.compress_ratios
    for name in ("kv_source_layers", "index_source_layers"):
        for layer in getattr(c, name):
            if ratios[layer] == 0:
                _fail(name, f"layer {layer} has compress ratio 0 (sliding window only) and cannot be a source")
    for layer in c.index_source_layers:
        keys_from = _nearest_at_or_below(c.kv_source_layers, layer)
        if keys_from < 0:
            _fail("index_source_layers", f"layer {layer} has no KV source at or below it to read index keys from")
        if keys_from not in c.index_source_layers:
            _fail("index_source_layers", f"layer {layer} reads index keys from KV source {keys_from}, which has no "
                                         f"indexer to write them; make {keys_from} an index source too")
    for layer in range(c.n_layers):
        if ratios[layer] == 0:
            continue
        kv_from = _nearest_at_or_below(c.kv_source_layers, layer)
        if kv_from < 0:
            _fail("kv_source_layers", f"layer {layer} (ratio {ratios[layer]}) has no KV source at or below it")
        if ratios[kv_from] != ratios[layer]:
            _fail("compress_ratios", f"layer {layer} has ratio {ratios[layer]} but its KV source {kv_from} "
                                     f"has ratio {ratios[kv_from]}; a consumer must match its source")
        topk_from = _nearest_at_or_below(c.index_source_layers, layer)
        if topk_from < 0 or topk_from < kv_from:
            _fail("index_source_layers", f"layer {layer} has no index source between its KV source {kv_from} "
                                         f"and itself")
    if c.candidate_source_layer >= 0:
        if c.candidate_source_layer not in c.index_source_layers:
            _fail("candidate_source_layer", f"layer {c.candidate_source_layer} is not an index source")
        if c.candidate_block_size <= 0 or c.candidate_topk_blocks <= 0:
            _fail("candidate_block_size", "candidate_block_size and candidate_topk_blocks must be positive "
                                          "when candidate_source_layer is set")
        if c.candidate_topk_blocks * c.candidate_block_size < c.index_topk:
            _fail("candidate_topk_blocks", f"candidate_topk_blocks * candidate_block_size = "
                                           f"{c.candidate_topk_blocks * c.candidate_block_size} is below "
                                           f"index_topk={c.index_topk}")
        for layer in c.index_source_layers:
            if layer > c.candidate_source_layer and (
                    ratios[layer] != ratios[c.candidate_source_layer]
                    or _nearest_at_or_below(c.kv_source_layers, layer)
                    != _nearest_at_or_below(c.kv_source_layers, c.candidate_source_layer)):
                _fail("candidate_source_layer", f"index source {layer} masks with the candidates of layer "
                                                f"{c.candidate_source_layer}, so it must read the same KV source")
    if c.engram_layer_ids:
        if len(c.engram_num_embeddings) != len(c.engram_layer_ids):
            _fail("engram_num_embeddings", f"needs one entry per engram layer ({len(c.engram_layer_ids)})")
        if c.engram_max_ngram_size < 2:
            _fail("engram_max_ngram_size", f"must be >= 2, got {c.engram_max_ngram_size}")
        for name in ("engram_n_heads", "engram_head_dim", "engram_vocab_size", "engram_compressed_vocab_size"):
            if getattr(c, name) <= 0:
                _fail(name, f"must be positive when engram_layer_ids is set, got {getattr(c, name)}")
        if c.engram_head_dim % FP8_BLOCK:
            _fail("engram_head_dim", f"must be a multiple of {FP8_BLOCK}, got {c.engram_head_dim}")
        if c.engram_vocab_size >= (1 << 24) - (1 << 20):
            _fail("engram_vocab_size", "must be below ~2^24: the on-device hash reduces modulo primes < 2^24")


def _nearest_at_or_below(ids: tuple[int, ...], layer: int) -> int:
    below = [i for i in ids if i <= layer]
    return below[-1] if below else -1


def _build_roles(c: ModelConfig) -> tuple[LayerRole, ...]:
    roles = []
    for layer in range(c.n_layers):
        ratio = c.compress_ratios[layer]
        kv_source = layer in c.kv_source_layers
        index_source = layer in c.index_source_layers
        kv_from = _nearest_at_or_below(c.kv_source_layers, layer) if ratio else -1
        roles.append(LayerRole(
            layer=layer,
            ratio=ratio,
            kv_source=kv_source,
            index_source=index_source,
            owns_index_keys=kv_source and index_source,
            candidate_source=layer == c.candidate_source_layer,
            uses_candidates=index_source and 0 <= c.candidate_source_layer < layer,
            kv_from=kv_from,
            index_keys_from=_nearest_at_or_below(c.kv_source_layers, layer) if index_source else -1,
            topk_from=_nearest_at_or_below(c.index_source_layers, layer) if ratio else -1,
            engram=layer in c.engram_layer_ids,
            engram_index=c.engram_layer_ids.index(layer) if layer in c.engram_layer_ids else -1,
        ))
    return tuple(roles)
