"""Convert a Hugging Face DeepSeek-V4.1 checkpoint into dijax's checkpoint format, one tensor at a time.

dijax's format is plain safetensors in the reference's tensor names (which the HF release already uses), sharded,
with a ``model.safetensors.index.json``, the config and tokenizer files, and a ``dijax.json`` marker. Safetensors
because it is memory-mappable (the loader reads one device's experts or Engram rows without touching the rest) and
holds no code; no Orbax, because every tensor is placed by name and sharded restore needs nothing more.

What changes on the way (the same as DeepSeek's ``convert.py`` for one model-parallel rank):
  * ``attn.wo_a`` is dequantised to bf16 (it runs as a grouped einsum, not an fp8 GEMM);
  * MXFP4 experts stay packed (int8 bytes stored as ``U8`` [out, in/2]); ``--expert-dtype fp8`` re-encodes them
    losslessly as e4m3 with one ue8m0 scale per 32x32 tile (checked exactly, tensor by tensor);
  * vision tensors, ``ffn.gate.bias_vl`` and the tied ``mtp.*.embed`` / ``mtp.*.head`` copies are dropped;
  * transformers-style aliases (``model.``, ``self_attn``, ``mlp``, ``weight_scale_inv``,
    ``e_score_correction_bias``) are renamed. Everything else is copied byte for byte (never up-cast).

Every tensor is validated against the config before anything is written (missing, unexpected, dtype, shape, the
scale block of its role, truncated shards). Output goes to a temporary directory renamed into place only on success.
Peak memory is one tensor (plus its converted copy): tensors are read with ``pread``, never mapped as a whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from tqdm import tqdm

from dijax.io.safetensors import DTYPES, SafetensorsFile
from dijax.config import ModelConfig
from dijax.io.tensor_spec import CheckpointError, backbone_spec, check_tensors, stored_shape
from dijax.kernels.quant import FP4_BLOCK, FP4_TABLE, FP8_BLOCK

MARKER = "dijax.json"
FORMAT = {"format": "dijax-safetensors", "version": 1}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
_DROP = re.compile(r"^(vision|aligner)\.|^image_(start|end|newline)$|\.bias_vl$|^mtp\.\d+\.(embed|head)\.")
_ALIASES = ((re.compile(r"^model\."), ""), (re.compile(r"\.self_attn\."), ".attn."), (re.compile(r"\.mlp\."), ".ffn."),
            (re.compile(r"\.weight_scale_inv$"), ".scale"), (re.compile(r"\.e_score_correction_bias$"), ".bias"))
_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.(weight|scale)$")


class ConversionError(CheckpointError):
    """A checkpoint that cannot be converted; the message names the tensor or file and what was expected."""


@dataclass
class Source:
    """Where one input tensor lives."""

    file: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass
class Output:
    """One output tensor: its name, safetensors dtype, shape, byte size and how to produce its bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    produce: Callable[[], bytes]


def canonical_name(name: str) -> str:
    for pattern, replacement in _ALIASES:
        if not name.startswith("vision."):
            name = pattern.sub(replacement, name)
    return name


def read_sources(hf_dir: str) -> dict[str, Source]:
    """Index every tensor of the checkpoint (validating the index json and each shard's header and extent)."""
    index_path = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as error:
                raise ConversionError(f"{index_path}: not a safetensors index ({error})") from None
        files = sorted(set(weight_map.values()))
    else:
        weight_map = None
        files = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    if not files:
        raise ConversionError(f"{hf_dir}: no safetensors files")
    for file in files:
        if not os.path.exists(os.path.join(hf_dir, file)):
            raise ConversionError(f"{index_path} names shard {file!r}, which does not exist in {hf_dir}")
    sources: dict[str, Source] = {}
    for file in files:
        path = os.path.join(hf_dir, file)
        try:
            st = SafetensorsFile(path)
        except (ValueError, json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ConversionError(f"shard {file}: unreadable safetensors header ({error})") from None
        for name, info in st.header.items():
            begin, end = info["data_offsets"]
            if st._data_start + end > st._size:
                raise ConversionError(f"shard {file} is truncated: tensor {name!r} needs bytes up to "
                                      f"{st._data_start + end}, the file has {st._size}")
            if weight_map is not None and weight_map.get(name) != file:
                raise ConversionError(f"tensor {name!r} is in shard {file} but the index maps it to "
                                      f"{weight_map.get(name)!r}")
            canonical = canonical_name(name)
            if canonical in sources:
                raise ConversionError(f"tensor {canonical!r} appears twice ({sources[canonical].file}, {file})")
            sources[canonical] = Source(path, name, info["dtype"], tuple(info["shape"]),
                                        st._data_start + begin, st._data_start + end)
    if weight_map is not None:
        missing_files = sorted({canonical_name(n) for n in weight_map} - set(sources))
        if missing_files:
            raise ConversionError(f"the index lists tensors no shard holds, e.g. {missing_files[:3]}")
    return sources


def _stored_shape(src: Source) -> tuple[int, ...]:
    return stored_shape(src.dtype, src.shape)


def validate(cfg: ModelConfig, sources: dict[str, Source]) -> None:
    """Compare the checkpoint with the config: every expected tensor present with its dtype, shape and scale block."""
    kept = {n: (src.dtype, src.shape) for n, src in sources.items() if not _DROP.search(n) and not n.startswith("mtp.")}
    try:
        check_tensors(cfg, kept, backbone_spec(cfg, "hf"))
    except CheckpointError as error:
        raise ConversionError(str(error)) from None
    for name in sorted(n for n in sources if n.startswith("mtp.") and not _DROP.search(n)):
        _check_generic(name, sources[name], sources)


def _check_generic(name: str, src: Source, sources: dict[str, Source]) -> None:
    """DSpark (mtp.*) tensors: fp8 weights need a tile scale of the right block, experts their 1x32 scale."""
    if not name.endswith(".weight"):
        return
    scale = sources.get(name[:-len("weight")] + "scale")
    shape = _stored_shape(src)
    if src.dtype == "F8_E4M3" and ".engram.embed." not in name:
        want = (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK))
        if scale is None or scale.shape != want:
            raise ConversionError(f"tensor {name!r} (fp8 weight) needs a scale of shape {list(want)}, found "
                                  f"{None if scale is None else list(scale.shape)}")
    if src.dtype in ("I8", "F4") and _EXPERT.search(name):
        want = (shape[0], shape[1] * 2 // FP4_BLOCK)
        if scale is None or scale.shape != want:
            raise ConversionError(f"tensor {name!r} (MXFP4 expert) needs a scale of shape {list(want)} (blocks of "
                                  f"{FP4_BLOCK} elements), found {None if scale is None else list(scale.shape)}")


def _read(src: Source) -> np.ndarray:
    """The tensor's bytes as an array of its storage dtype (one pread; no mapping of the file)."""
    with open(src.file, "rb") as f:
        raw = os.pread(f.fileno(), src.end - src.begin, src.begin)
    if len(raw) != src.end - src.begin:
        raise ConversionError(f"shard {src.file}: could not read tensor {src.name!r} (truncated?)")
    return np.frombuffer(raw, dtype=DTYPES[src.dtype]).reshape(_stored_shape(src))


def _dequant_wo_a(weight: Source, scale: Source) -> bytes:
    w = _read(weight).astype(np.float32)
    s = np.ldexp(np.float32(1), _read(scale).astype(np.int32) - 127).astype(np.float32)
    block = -(-w.shape[0] // s.shape[0])
    s = np.repeat(np.repeat(s, block, axis=0)[:w.shape[0]], block, axis=1)[:, :w.shape[1]]
    return (w * s).astype(ml_dtypes.bfloat16).tobytes()


def mxfp4_to_fp8(packed: np.ndarray, scale_u8: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Re-encode MXFP4 [out, in/2] + ue8m0 [out, in/32] as e4m3 [out, in] + ue8m0 tile scales [out/32, in/32].

    Each 32x32 tile takes scale 2^(max row exponent - 6), which keeps 6 * 2^6 = 384 <= 448; the result is checked
    to decode to exactly the MXFP4 values (a ConversionError names the tensor otherwise).
    """
    values = np.stack([FP4_TABLE[packed & 0x0F], FP4_TABLE[packed >> 4]], axis=-1).reshape(packed.shape[0], -1)
    exps = np.repeat(scale_u8.astype(np.int32) - 127, FP4_BLOCK, axis=1)
    out_dim, in_dim = values.shape
    rows, cols = -(-out_dim // FP8_BLOCK), in_dim // FP8_BLOCK
    pad = rows * FP8_BLOCK - out_dim
    tile_max = np.pad(exps, ((0, pad), (0, 0)), constant_values=-127).reshape(rows, FP8_BLOCK, cols, FP8_BLOCK)
    tile_exp = tile_max.max(axis=(1, 3)) - 6
    per_elem = np.repeat(np.repeat(tile_exp, FP8_BLOCK, axis=0)[:out_dim], FP8_BLOCK, axis=1)
    q = np.ldexp(values, exps - per_elem).astype(ml_dtypes.float8_e4m3fn)
    exact = np.ldexp(q.astype(np.float32), per_elem)
    if not np.array_equal(exact, np.ldexp(values, exps)):
        raise ConversionError(f"tensor {name!r}: MXFP4 values of one 32x32 tile span too many exponents to "
                              f"re-encode losslessly as fp8; convert with --expert-dtype fp4")
    return q, (tile_exp + 127).astype(np.uint8)


def plan(cfg: ModelConfig, sources: dict[str, Source], expert_dtype: str) -> list[Output]:
    """The output tensors, in a stable order, with producers that read their source only when called."""
    outputs: list[Output] = []
    for name in sorted(sources):
        src = sources[name]
        if _DROP.search(name):
            continue
        if name.endswith(".attn.wo_a.scale"):
            continue
        if name.endswith(".attn.wo_a.weight") and src.dtype == "F8_E4M3":
            scale = sources[name[:-len("weight")] + "scale"]
            outputs.append(Output(name, "BF16", src.shape, int(np.prod(src.shape)) * 2,
                                  lambda w=src, s=scale: _dequant_wo_a(w, s)))
            continue
        if _EXPERT.search(name) and src.dtype in ("I8", "F4", "U8") and name.endswith(".weight"):
            scale = sources[name[:-len("weight")] + "scale"]
            shape = _stored_shape(src)
            if expert_dtype == "fp8":
                logical = (shape[0], shape[1] * 2)
                srows, scols = -(-logical[0] // FP8_BLOCK), logical[1] // FP8_BLOCK
                cache: dict = {}

                def encode(w=src, s=scale, n=name, c=cache) -> dict:
                    if "s" not in c:  # weight and tile scale come from one re-encode
                        c["q"], c["s"] = mxfp4_to_fp8(_read(w), _read(s), n)
                    return c

                outputs.append(Output(name, "F8_E4M3", logical, logical[0] * logical[1],
                                      lambda e=encode: e().pop("q").tobytes()))
                outputs.append(Output(name[:-len("weight")] + "scale", "F8_E8M0", (srows, scols), srows * scols,
                                      lambda e=encode: e().pop("s").tobytes()))
            else:
                outputs.append(Output(name, "U8", shape, src.end - src.begin, lambda w=src: _read(w).tobytes()))
            continue
        if _EXPERT.search(name) and name.endswith(".scale") and expert_dtype == "fp8":
            continue  # replaced by the tile scale written with its weight
        outputs.append(Output(name, src.dtype, src.shape, src.end - src.begin, lambda w=src: _read(w).tobytes()))
    return outputs


def write_shard(path: str, outputs: list[Output], bar=None, done: list[int] | None = None, total: int = 0) -> None:
    """Write ``outputs`` as one safetensors file at ``path``, each tensor's bytes produced as it is written (so a
    shard never sits in memory whole). ``bar``: a tqdm bar advanced by the bytes written (None: no progress);
    ``done`` / ``total``: the tensors written so far (a one-element list, updated) and in all, for its postfix.
    ConversionError when a tensor produces another number of bytes than planned."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for out in outputs:
        header[out.name] = {"dtype": out.dtype, "shape": list(out.shape), "data_offsets": [offset, offset + out.nbytes]}
        offset += out.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for out in outputs:
            data = out.produce()
            if len(data) != out.nbytes:
                raise ConversionError(f"tensor {out.name!r}: produced {len(data)} bytes, planned {out.nbytes}")
            f.write(data)
            if bar is None:
                continue
            bar.update(len(data))
            if done is not None:
                done[0] += 1
                bar.set_postfix_str(f"{done[0]}/{total} tensors", refresh=False)


def _find(hf_dir: str, name: str) -> str | None:
    """``name`` beside the shards, or one level up (the layout of the parity fixtures: tiny/config.json, tiny/hf/)."""
    for folder in (hf_dir, os.path.dirname(os.path.abspath(hf_dir))):
        if os.path.exists(os.path.join(folder, name)):
            return os.path.join(folder, name)
    return None


def source_fingerprint(hf_dir: str, expert_dtype: str = "fp4") -> str:
    """A key (hex) of what converting ``hf_dir`` reads, cheap to compute: the converter's format and expert dtype,
    the index json, every shard's name, size and safetensors header, and the config and tokenizer files.

    A changed, truncated, added or removed shard changes it. Tensor bytes are not hashed, so an edit that keeps
    every size and header is not noticed. Unreadable inputs are keyed as such (converting them then fails).
    """
    digest = hashlib.sha256(json.dumps({**FORMAT, "expert_dtype": expert_dtype}, sort_keys=True).encode())
    try:
        shards = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    except OSError as error:
        shards = []
        digest.update(f"unlistable:{error.errno}".encode())
    for name in shards:
        digest.update(f"\0shard:{name}".encode())
        try:
            with open(os.path.join(hf_dir, name), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                raw = f.read(8)
                length = int.from_bytes(raw, "little") if len(raw) == 8 else 0
                digest.update(f"{size}:".encode() + raw + f.read(min(length, size, 1 << 28)))
        except OSError as error:
            digest.update(f"unreadable:{error.errno}".encode())
    for name in ("model.safetensors.index.json", "config.json", *TOKENIZER_FILES):
        found = _find(hf_dir, name)
        digest.update(f"\0file:{name}:".encode())
        if found is not None:
            with open(found, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def _terminate_by_exception() -> Callable[[], None]:
    """Turn SIGTERM into SystemExit while converting (so the temporary output is removed, as on Ctrl-C); returns
    the function that restores the previous handler. Only the main thread can, and only a default handler is
    replaced."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return lambda: None

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _make_temp_dir(out_dir: str) -> str:
    """A hidden temporary directory beside ``out_dir``, with the permissions a plain mkdir would give (mkdtemp
    makes it 0700, which the renamed output would keep)."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    except OSError as error:
        raise ConversionError(f"cannot create the output directory {out_dir}: {error.strerror}") from None
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


def _write_checkpoint(folder: str, hf_dir: str, shards: list[list[Output]], outputs: list[Output],
                      progress: bool) -> None:
    """Write the shards, the index json and copies of the config and tokenizer files into ``folder``."""
    weight_map, done = {}, [0]
    total = sum(o.nbytes for o in outputs)
    with tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=not progress) as bar:
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_shard(os.path.join(folder, file), shard, bar, done, len(outputs))
            weight_map.update({o.name: file for o in shard})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    for name in ("config.json", *TOKENIZER_FILES):
        found = _find(hf_dir, name)
        if found is not None:
            shutil.copyfile(found, os.path.join(folder, name))  # contents only: new files get the umask's mode


def convert(hf_dir: str, out_dir: str, expert_dtype: str = "fp4", max_shard_bytes: int = 4 << 30,
            progress: bool = True) -> str:
    """Convert ``hf_dir`` into ``out_dir`` (which must not exist). Returns ``out_dir``.

    ``dijax.json`` records the ``source_fingerprint`` of ``hf_dir``. SIGTERM and Ctrl-C leave nothing behind."""
    if expert_dtype not in ("fp4", "fp8"):
        raise ConversionError(f"--expert-dtype must be 'fp4' or 'fp8', got {expert_dtype!r}")
    if os.path.exists(out_dir):
        raise ConversionError(f"output directory {out_dir} already exists; remove it or choose another")
    if not os.path.isdir(hf_dir):
        raise ConversionError(f"{hf_dir} is not a directory (expected a Hugging Face checkpoint folder)")
    config_path = _find(hf_dir, "config.json")
    if config_path is None:
        raise ConversionError(f"no config.json in {hf_dir} or its parent directory")
    cfg = ModelConfig.from_file(config_path)
    sources = read_sources(hf_dir)
    validate(cfg, sources)
    outputs = plan(cfg, sources, expert_dtype)
    shards: list[list[Output]] = [[]]
    size = 0
    for out in outputs:
        if shards[-1] and size + out.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(out)
        size += out.nbytes
    fingerprint = source_fingerprint(hf_dir, expert_dtype)
    restore_sigterm = _terminate_by_exception()
    try:
        tmp = _make_temp_dir(out_dir)
        try:
            _write_checkpoint(tmp, hf_dir, shards, outputs, progress)
            with open(os.path.join(tmp, MARKER), "w") as f:
                json.dump({**FORMAT, "expert_dtype": expert_dtype, "source": os.path.abspath(hf_dir),
                           "source_fingerprint": fingerprint}, f, indent=1)
            os.rename(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        restore_sigterm()
    return out_dir
