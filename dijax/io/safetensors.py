"""Safetensors files read directly (memory-mapped, header-based).

safetensors' numpy loader cannot read ``F8_E8M0`` (and ``F4``), so the format is read directly: an 8-byte
little-endian header length, a JSON header (dtype, shape, byte offsets per tensor), then raw bytes. Every tensor is
a zero-copy numpy view of a memory map:

  * ``F8_E4M3`` -> ml_dtypes.float8_e4m3fn, ``BF16`` -> ml_dtypes.bfloat16, ``F32`` -> float32;
  * ``F8_E8M0`` scales -> uint8 (the raw exponent byte; dijax.kernels.quant.ue8m0_to_f32 decodes it);
  * ``F4`` (logical shape [out, in]) and ``I8`` expert weights -> uint8 [out, in / 2], two e2m1 codes per byte.

``SafetensorsFile.read`` (and ``TensorRef``, the handle the sharded loader works with) copies a range of rows with
positioned reads instead: nothing is mapped, so the process's resident memory holds only the rows it asked for. A
memory map keeps every page it touched resident (and counted in the RSS) for as long as it is mapped, which for a
loader that reads each device's shard of every tensor adds up to the whole checkpoint.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterator

import ml_dtypes
import numpy as np

DTYPES = {
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
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise ValueError(f"{self.path}: unreadable safetensors header ({error})") from None
            if not isinstance(header, dict):
                raise ValueError(f"{self.path}: the safetensors header is not a JSON object")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None
        self.metadata = header.pop("__metadata__", {})
        self.header: dict[str, dict] = header
        self._data_start = 8 + n
        self._size = size

    def check_extents(self) -> None:
        """Raise ValueError naming the file and tensor unless every tensor's dtype is known and its bytes match its
        shape and lie inside the file (a truncated shard fails here, before any tensor is read)."""
        for name, info in self.header.items():
            dtype_name = info.get("dtype") if isinstance(info, dict) else None
            if dtype_name not in DTYPES:
                raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype_name}")
            shape = list(info["shape"])
            if dtype_name == "F4":
                shape[-1] //= 2
            begin, end = info["data_offsets"]
            if end - begin != int(np.prod(shape)) * DTYPES[dtype_name].itemsize:
                raise ValueError(f"{self.path}: tensor {name!r} has {end - begin} bytes, which do not match "
                                 f"{dtype_name} {info['shape']}")
            if self._data_start + end > self._size:
                raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated shard?)")

    def names(self) -> list[str]:
        return list(self.header)

    def layout(self, name: str) -> tuple[np.dtype, list[int], int]:
        """(numpy dtype, stored shape, offset of its first byte in the file) of tensor ``name``, its extent checked."""
        info = self.header[name]
        dtype_name = info["dtype"]
        if dtype_name not in DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype_name}")
        dtype = DTYPES[dtype_name]
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
        return dtype, shape, self._data_start + begin

    def get(self, name: str) -> np.ndarray:
        """Zero-copy view of tensor ``name`` (see the module docstring for dtype mapping)."""
        dtype, shape, offset = self.layout(name)
        count = int(np.prod(shape)) if shape else 1
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=offset).reshape(shape)

    def read(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of tensor ``name``'s leading axis, copied into a new array by positioned reads (no
        mapping, see the module docstring). Same dtypes and stored shapes as ``get``; 0 <= start <= stop <= rows."""
        dtype, shape, offset = self.layout(name)
        if not shape or not 0 <= start <= stop <= shape[0]:
            raise ValueError(f"{self.path}: tensor {name!r} of shape {shape} has no rows [{start}, {stop})")
        out = np.empty([stop - start, *shape[1:]], dtype)
        buffer = memoryview(out.reshape(-1).view(np.uint8))
        offset += start * int(np.prod(shape[1:])) * dtype.itemsize
        done = 0
        with open(self.path, "rb") as f:
            while done < len(buffer):  # one call reads at most ~2 GiB on Linux
                n = os.preadv(f.fileno(), [buffer[done:]], offset + done)
                if n == 0:
                    raise ValueError(f"{self.path}: tensor {name!r} ends early (the file shrank while loading?)")
                done += n
        return out


class TensorRef:
    """Tensor ``name`` of a safetensors file, read on demand: ``shape`` and ``dtype`` (as ``get`` would give
    them) and ``ref[start:stop]``, rows [start, stop) of the leading axis read by ``SafetensorsFile.read``."""

    def __init__(self, file: SafetensorsFile, name: str):
        self.file, self.name = file, name
        self.dtype, shape, _ = file.layout(name)
        self.shape = tuple(shape)

    def __getitem__(self, rows: slice) -> np.ndarray:
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"tensor {self.name!r} is read by contiguous row ranges (ref[start:stop]), got {rows!r}")
        start, stop, _ = rows.indices(self.shape[0])
        return self.file.read(self.name, start, max(start, stop))


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """The safetensors files of a checkpoint: a file, a directory with an index json, or a directory of shards."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return [path]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            try:
                weight_map = json.load(f)["weight_map"]
                files = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as error:
                raise ValueError(f"{index}: not a safetensors index with a 'weight_map' ({error!r})") from None
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


def tensor_refs(path: str | os.PathLike) -> Iterator[tuple[str, TensorRef]]:
    """Yield (name, ``TensorRef``) for every tensor of a checkpoint (nothing is read yet)."""
    for file in checkpoint_files(path):
        st = SafetensorsFile(file)
        for name in st.names():
            yield name, TensorRef(st, name)
