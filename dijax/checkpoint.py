"""Read safetensors checkpoints (memory-mapped, header-based) into dijax's parameter pytree.

safetensors' numpy loader cannot read ``F8_E8M0`` (and ``F4``), so the format is read directly: an 8-byte
little-endian header length, a JSON header (dtype, shape, byte offsets per tensor), then raw bytes. Every tensor is
a zero-copy numpy view of a memory map:

  * ``F8_E4M3`` -> ml_dtypes.float8_e4m3fn, ``BF16`` -> ml_dtypes.bfloat16, ``F32`` -> float32;
  * ``F8_E8M0`` scales -> uint8 (the raw exponent byte; dijax.model.quant.ue8m0_to_f32 decodes it);
  * ``F4`` (logical shape [out, in]) and ``I8`` expert weights -> uint8 [out, in / 2], two e2m1 codes per byte.

Parameter pytree (names follow the checkpoint): {'embed': {'weight'}, 'norm': {...}, 'head': {...},
'layers': [per layer {'attn': ..., 'ffn': {'gate', 'experts', 'shared_experts'}, 'attn_norm', 'ffn_norm',
'hc_*', optional 'engram'}]}. Routed experts are stacked: ``experts['w1']['weight']`` is [E, out, in / 2].
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterator

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dijax.config import ModelConfig

_DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(np.uint8),
    "I8": np.dtype(np.uint8),
    "U8": np.dtype(np.uint8),
    "F4": np.dtype(np.uint8),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "BOOL": np.dtype(np.bool_),
}


class SafetensorsFile:
    """A memory-mapped safetensors file: ``header`` (name -> {dtype, shape, data_offsets}) and ``get(name)``."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{self.path}: truncated safetensors file (no header length)")
            (n,) = struct.unpack("<Q", raw)
            size = os.fstat(f.fileno()).st_size
            if n > size - 8:
                raise ValueError(f"{self.path}: header length {n} exceeds the file size {size}")
            header = json.loads(f.read(n))
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None
        self.metadata = header.pop("__metadata__", {})
        self.header: dict[str, dict] = header
        self._data_start = 8 + n
        self._size = size

    def names(self) -> list[str]:
        return list(self.header)

    def get(self, name: str) -> np.ndarray:
        """Zero-copy view of tensor ``name`` (see the module docstring for dtype mapping)."""
        info = self.header[name]
        dtype_name = info["dtype"]
        if dtype_name not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype_name}")
        dtype = _DTYPES[dtype_name]
        shape = list(info["shape"])
        if dtype_name == "F4":
            shape[-1] //= 2  # logical [.., in] stored as [.., in / 2] bytes
        begin, end = info["data_offsets"]
        count = int(np.prod(shape)) if shape else 1
        if end - begin != count * dtype.itemsize:
            raise ValueError(f"{self.path}: tensor {name!r} has {end - begin} bytes, expected "
                             f"{count * dtype.itemsize} for {dtype_name} {info['shape']}")
        if self._data_start + end > self._size:
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated shard?)")
        array = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._data_start + begin)
        return array.reshape(shape)


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """The safetensors files of a checkpoint: a file, a directory with an index json, or a directory of shards."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return [path]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.exists(os.path.join(path, name)):
                raise FileNotFoundError(f"{index} names shard {name!r}, which does not exist")
        return [os.path.join(path, name) for name in files]
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    return files


def iter_tensors(path: str | os.PathLike) -> Iterator[tuple[str, np.ndarray, str]]:
    """Yield (name, memory-mapped array, safetensors dtype) for every tensor of a checkpoint."""
    for file in checkpoint_files(path):
        st = SafetensorsFile(file)
        for name in st.names():
            yield name, st.get(name), st.header[name]["dtype"]


def _set(tree: dict, dotted: list[str], value) -> None:
    for part in dotted[:-1]:
        tree = tree.setdefault(part, {})
    tree[dotted[-1]] = value


def load_params(cfg: ModelConfig, path: str | os.PathLike) -> dict:
    """Load a reference-layout checkpoint into the dijax parameter pytree (device arrays).

    Applies the reference's load-time promotions: ``head`` and ratio>1 ``compressor.{wkv,wgate}`` to float32.
    DSpark (``mtp.*``) tensors are not used by the backbone and are skipped.
    """
    layers: list[dict] = [{} for _ in range(cfg.n_layers)]
    experts: list[dict[int, dict]] = [{} for _ in range(cfg.n_layers)]
    top: dict = {}
    for name, array, dtype_name in iter_tensors(path):
        parts = name.split(".")
        if parts[0] == "mtp":
            continue
        if parts[0] != "layers":
            _set(top, parts, array)
            continue
        layer = int(parts[1])
        if layer >= cfg.n_layers:
            raise ValueError(f"tensor {name!r} names layer {layer}, but the config has n_layers={cfg.n_layers}")
        rest = parts[2:]
        if rest[:2] == ["ffn", "experts"]:
            experts[layer].setdefault(int(rest[2]), {}).setdefault(rest[3], {})[rest[4]] = array
            continue
        if rest[:2] == ["attn", "compressor"] and rest[2] in ("wkv", "wgate") and cfg.compress_ratios[layer] > 1:
            array = array.astype(np.float32)
        _set(layers[layer], rest, array)
    top["head"]["weight"] = top["head"]["weight"].astype(np.float32)
    for layer in layers:
        wo_a = layer.get("attn", {}).get("wo_a", {})
        if "scale" in wo_a:  # HF layout: dequantise wo_a to bf16 exactly as convert.py does
            wo_a["weight"] = dequant_fp8_tiles(wo_a["weight"], wo_a.pop("scale"))
    for layer in range(cfg.n_layers):
        found = experts[layer]
        if sorted(found) != list(range(cfg.n_routed_experts)):
            raise ValueError(f"layer {layer}: expected routed experts 0..{cfg.n_routed_experts - 1}, "
                             f"found {len(found)}")
        stacked = {w: {k: np.stack([found[e][w][k] for e in range(cfg.n_routed_experts)])
                       for k in found[0][w]} for w in ("w1", "w2", "w3")}
        layers[layer].setdefault("ffn", {})["experts"] = stacked
    top["layers"] = layers
    return _to_device(top)


def dequant_fp8_tiles(weight: np.ndarray, scale_u8: np.ndarray) -> np.ndarray:
    """Host-side e4m3 [out, in] times ue8m0 tile scales [out/b, in/b] (b = out / scale rows) -> bf16 (exact)."""
    block = -(-weight.shape[0] // scale_u8.shape[0])
    s = np.ldexp(np.float32(1), scale_u8.astype(np.int32) - 127).astype(np.float32)
    s = np.repeat(np.repeat(s, block, axis=0)[:weight.shape[0]], block, axis=1)[:, :weight.shape[1]]
    return (weight.astype(np.float32) * s).astype(ml_dtypes.bfloat16)


def _to_device(tree):
    if isinstance(tree, dict):
        return {k: _to_device(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_device(v) for v in tree]
    return jnp.asarray(tree)
