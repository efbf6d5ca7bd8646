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


def resolve_checkpoint(path: str | os.PathLike, cache_dir: str | None = None, progress: bool = True) -> str:
    """A loadable dijax checkpoint for ``path``.

    A dijax checkpoint (``dijax.json`` marker) or a single reference-layout file is used as it is. A Hugging Face
    checkpoint directory is converted on first use into ``cache_dir`` (default ``$DIJAX_CACHE`` or
    ``~/.cache/dijax``), keyed by its path and index, and the converted copy is reused afterwards.
    """
    import hashlib

    from dijax.convert import MARKER, convert

    path = os.fspath(path)
    if os.path.isfile(path) or os.path.exists(os.path.join(path, MARKER)):
        return path
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index):
        return path
    stamp = f"{os.path.abspath(path)}:{os.path.getmtime(index)}:{os.path.getsize(index)}"
    root = cache_dir or os.environ.get("DIJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dijax")
    target = os.path.join(root, hashlib.sha1(stamp.encode()).hexdigest()[:16])
    if not os.path.exists(os.path.join(target, MARKER)):
        print(f"dijax: {path} is a Hugging Face checkpoint; converting it once into {target}", flush=True)
        convert(path, target, progress=progress)
    return target


def load_params(cfg: ModelConfig, path: str | os.PathLike, expert_range: tuple[int, int] | None = None,
                engram_rows: dict[int, tuple[int, int]] | None = None) -> dict:
    """Load a reference-layout or dijax checkpoint into the dijax parameter pytree (device arrays).

    ``expert_range=(start, end)`` keeps only those routed experts and ``engram_rows={layer: (start, end)}`` only
    those table rows (one device's share under expert parallelism); tensors are memory-mapped, so the rest is
    never read. See ``params_from_tensors`` for the rest.
    """
    items = ((name, array) for name, array, _ in iter_tensors(path))
    return params_from_tensors(cfg, items, expert_range, engram_rows, source=os.fspath(path))


def params_from_tensors(cfg: ModelConfig, items, expert_range: tuple[int, int] | None = None,
                        engram_rows: dict[int, tuple[int, int]] | None = None, source: str = "checkpoint") -> dict:
    """Assemble (checkpoint name, numpy array) pairs into the parameter pytree (device arrays).

    Routed experts come one per name (``layers.L.ffn.experts.E.w1.weight``) or already stacked over the range
    (``layers.L.ffn.experts.w1.weight`` [E, ...], as ``random_codes`` draws them).

    Applies the reference's load-time promotions: ``head`` and ratio>1 ``compressor.{wkv,wgate}`` to float32.
    DSpark (``mtp.*``) tensors are not used by the backbone and are skipped.
    """
    first, last = expert_range or (0, cfg.n_routed_experts)
    layers: list[dict] = [{} for _ in range(cfg.n_layers)]
    experts: list[dict[int, dict]] = [{} for _ in range(cfg.n_layers)]
    stacked_experts: list[dict] = [{} for _ in range(cfg.n_layers)]
    top: dict = {}
    for name, array in items:
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
            if rest[2] in ("w1", "w2", "w3"):  # already stacked over this range's experts: [E, ...]
                _set(stacked_experts[layer], rest[2:], array)
            elif first <= int(rest[2]) < last:
                experts[layer].setdefault(int(rest[2]), {}).setdefault(rest[3], {})[rest[4]] = array
            continue
        if rest[:2] == ["attn", "compressor"] and rest[2] in ("wkv", "wgate") and cfg.compress_ratios[layer] > 1:
            array = array.astype(np.float32)
        if rest[:2] == ["engram", "embed"] and engram_rows and layer in engram_rows:
            array = array[slice(*engram_rows[layer])]
        if rest[:2] == ["attn", "wo_a"] and rest[2] == "scale":
            raise ValueError(f"{source} holds an fp8 'attn.wo_a' with its scale (the Hugging Face layout): "
                             f"pass it through resolve_checkpoint() (or `dijax convert`) first")
        _set(layers[layer], rest, array)
    top["head"]["weight"] = top["head"]["weight"].astype(np.float32)
    for layer in range(cfg.n_layers):
        found = experts[layer]
        if stacked_experts[layer]:
            if found or sorted(stacked_experts[layer]) != ["w1", "w2", "w3"]:
                raise ValueError(f"layer {layer}: routed experts must be either all per expert or stacked w1, w2 "
                                 f"and w3; found stacked {sorted(stacked_experts[layer])} and {len(found)} per expert")
            for w, tensors in stacked_experts[layer].items():
                if tensors["weight"].shape[0] != last - first:
                    raise ValueError(f"layer {layer}: stacked 'ffn.experts.{w}.weight' holds "
                                     f"{tensors['weight'].shape[0]} experts, expected {last - first}")
            layers[layer].setdefault("ffn", {})["experts"] = stacked_experts[layer]
            continue
        if sorted(found) != list(range(first, last)):
            raise ValueError(f"layer {layer}: expected routed experts {first}..{last - 1}, found {len(found)}")
        stacked = {w: {k: np.stack([found[e][w][k] for e in range(first, last)])
                       for k in found[first][w]} for w in ("w1", "w2", "w3")}
        layers[layer].setdefault("ffn", {})["experts"] = stacked
    top["layers"] = layers
    return _to_device(top)


def _to_device(tree):
    import jax.numpy as jnp

    if isinstance(tree, dict):
        return {k: _to_device(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_device(v) for v in tree]
    return jnp.asarray(tree)
