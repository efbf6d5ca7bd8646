"""Random weights in checkpoint-native form (fp8 tiles, MXFP4 experts, fp8 Engram rows) from a fixed seed.

Used by the embedded tiny default of ``dijax generate`` and by tests that need a model without a checkpoint. The
magnitudes follow the parity fixtures' recipe (parity README §5.1), which keeps the random model's residual stream
stable: Linear weights N(0, 1/in) with a few gains, an embedding of std 3, a head of std 4/sqrt(dim).
"""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dijax.config import ModelConfig
from dijax.io.checkpoint import params_from_tensors
from dijax.io.tensor_spec import backbone_spec
from dijax.kernels.quant import E2M1_GRID, FP4_BLOCK, FP8_BLOCK
from dijax.model.param_map import Deferred

_GAINS = {"attn.wo_b": 0.4, ".w2": 0.2, "engram.wkv": 0.3, "ffn.gate": 3.0}


def _gain(name: str) -> float:
    """Extra factor on a tensor's N(0, 1/fan_in) scale (the fixtures' recipe), 1 for most tensors."""
    return next((g for key, g in _GAINS.items() if key in name), 1.0)


def _pow2_exponent(amax: np.ndarray, max_value: float) -> np.ndarray:
    return np.ceil(np.log2(np.maximum(amax, 1e-30) / max_value)).astype(np.int32)


def _fp8_tiles(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    out_dim, in_dim = w.shape
    rows, cols = -(-out_dim // FP8_BLOCK), -(-in_dim // FP8_BLOCK)
    padded = np.zeros((rows * FP8_BLOCK, cols * FP8_BLOCK), np.float32)
    padded[:out_dim, :in_dim] = w
    amax = np.abs(padded.reshape(rows, FP8_BLOCK, cols, FP8_BLOCK)).max(axis=(1, 3))
    exp = _pow2_exponent(amax, 448.0)
    scale = np.repeat(np.repeat(np.ldexp(np.float32(1), exp), FP8_BLOCK, 0), FP8_BLOCK, 1)[:out_dim, :in_dim]
    q = np.clip(w / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q, (exp + 127).astype(np.uint8)


def _mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    out_dim, in_dim = w.shape
    blocks = w.reshape(out_dim, in_dim // FP4_BLOCK, FP4_BLOCK)
    exp = _pow2_exponent(np.abs(blocks).max(-1), 6.0)
    v = np.clip(blocks / np.ldexp(np.float32(1), exp)[..., None], -6, 6).reshape(out_dim, in_dim)
    code = np.abs(np.abs(v)[..., None] - E2M1_GRID).argmin(-1).astype(np.uint8) | (np.signbit(v).astype(np.uint8) << 3)
    return (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8), (exp + 127).astype(np.uint8)


def random_tensors(cfg: ModelConfig, seed: int = 0):
    """Yield (reference name, numpy array) for every backbone tensor of ``cfg``."""
    rng = np.random.default_rng(seed)
    spec = backbone_spec(cfg)
    for name in sorted(spec):
        s = spec[name]
        if name.endswith(".scale"):
            continue  # produced with its weight
        gain = _gain(name)
        if s.dtypes[0] in ("I8", "F4", "U8") or (s.dtypes[0] == "F8_E4M3" and ".experts." in name):
            logical = (s.shape[0], s.shape[1] * 2) if s.dtypes[0] != "F8_E4M3" else s.shape
            packed, scale = _mxfp4(rng.normal(0, gain / np.sqrt(logical[1]), logical).astype(np.float32))
            yield name, packed
            yield name[:-len("weight")] + "scale", scale
        elif name.endswith("engram.embed.weight"):
            rows = rng.normal(0, 1, s.shape).astype(np.float32)
            blocks = rows.reshape(s.shape[0], -1, FP8_BLOCK)
            exp = _pow2_exponent(np.abs(blocks).max(-1), 448.0)
            q = (blocks / np.ldexp(np.float32(1), exp)[..., None]).reshape(s.shape).astype(ml_dtypes.float8_e4m3fn)
            yield name, q
            yield name[:-len("weight")] + "scale", (exp + 127).astype(np.uint8)
        elif s.dtypes[0] == "F8_E4M3":
            w = rng.normal(0, gain / np.sqrt(s.shape[1]), s.shape).astype(np.float32)
            if name.endswith("attn.wo_a.weight"):  # held dequantised, as the converter writes it
                q, scale = _fp8_tiles(w)
                rows = np.repeat(np.repeat(np.ldexp(np.float32(1), scale.astype(np.int32) - 127), FP8_BLOCK, 0),
                                 FP8_BLOCK, 1)[:s.shape[0], :s.shape[1]]
                yield name, (q.astype(np.float32) * rows).astype(ml_dtypes.bfloat16)
                continue
            q, scale = _fp8_tiles(w)
            yield name, q
            yield name[:-len("weight")] + "scale", scale
        else:
            yield name, _dense(name, s.shape, rng, cfg, gain).astype(
                np.float32 if s.dtypes[0] == "F32" else ml_dtypes.bfloat16)


def _dense(name: str, shape: tuple[int, ...], rng: np.random.Generator, cfg: ModelConfig, gain: float) -> np.ndarray:
    if "norm" in name or name.endswith(("q_weight", "k_weight")):
        return 1 + rng.normal(0, 0.1, shape)
    if name == "embed.weight":
        return rng.normal(0, 3.0, shape)
    if name == "head.weight":
        return rng.normal(0, 4.0 / np.sqrt(cfg.dim), shape)
    if name.endswith("attn_sink"):
        return rng.normal(0, 1, shape)
    if name.endswith("gate.bias"):
        return rng.normal(0, 0.3, shape)
    if name.endswith("_fn"):
        return rng.normal(0, 1 / np.sqrt(shape[1]), shape)
    if name.endswith("_base"):
        base = rng.normal(0, 0.5, shape)
        c = cfg.hc_mult
        comb = np.zeros(shape, np.float32)
        comb[2 * c:] = 2 * np.eye(c).ravel()  # a comb close to the identity
        return base + comb
    if name.endswith("_scale"):
        return rng.uniform(0.2, 1.0, shape)
    return rng.normal(0, gain / np.sqrt(shape[-1]), shape)


def random_params(cfg: ModelConfig, seed: int = 0, mesh: Mesh | None = None) -> nnx.State:
    """The model's parameters (``Transformer`` state, see dijax.model.param_map) for ``cfg`` with random weights
    from ``seed`` (deterministic), each tensor placed on the device as it is drawn (on ``mesh``: split over it as
    ``load_params(mesh=...)`` splits a checkpoint; the same values for every mesh)."""
    return params_from_tensors(cfg, random_tensors(cfg, seed), source=f"random weights (seed {seed})", mesh=mesh)


class _KeyDraws:
    """The slice of numpy's Generator API that ``_dense`` uses, drawn on the default device by ``jax.random`` from
    one tensor's key: a tensor takes exactly one draw (a second from the same key would repeat the first's bits, so
    it raises)."""

    def __init__(self, key: jax.Array):
        self._key = key

    def _take(self) -> jax.Array:
        key, self._key = self._key, None
        if key is None:
            raise RuntimeError("one tensor's random codes take one draw")
        return key

    def normal(self, loc: float, scale: float, size: tuple[int, ...]) -> jax.Array:
        return loc + scale * jax.random.normal(self._take(), size, jnp.float32)

    def uniform(self, low: float, high: float, size: tuple[int, ...]) -> jax.Array:
        return jax.random.uniform(self._take(), size, jnp.float32, low, high)


_BYTES_AT_ONCE = 1 << 28  # random_bytes draws a larger tensor in slices along its first axis


@partial(jax.jit, static_argnums=1)
def random_bytes(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniformly random uint8 ``shape``, drawn as 32-bit words and viewed as bytes when the last dimension allows
    (``jax.random.bits`` of uint8 goes through a uint32 temporary 4x the result: 8.4 GiB for one real-size expert
    stack, which ran an H100 out of memory beside the rest, thirty-second session). A tensor over 256 MB is drawn
    slice by slice along its first axis (one key each, ``lax.map``), so that the generator's temporaries are one
    slice's: drawn whole, a real-size expert stack took ~3x its size in temporaries and flash-slice's weights
    peaked 9.3 GB above their 56.2 GB, past an 80 GB card's default memory fraction (thirty-fourth session)."""
    if len(shape) > 1 and np.prod(shape) > _BYTES_AT_ONCE:
        return jax.lax.map(lambda k: _bytes(k, shape[1:]), jax.random.split(key, shape[0]))
    return _bytes(key, shape)


def _bytes(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    if shape and shape[-1] % 4 == 0:
        words = jax.random.bits(key, (*shape[:-1], shape[-1] // 4), jnp.uint32)
        return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(shape)
    return jax.random.bits(key, shape, jnp.uint8)


def _unit_exponent(fan_in: int) -> int:
    """ue8m0 byte of the power of two closest below 1/sqrt(fan_in): scales codes of magnitude ~1 to N(0, 1/in)."""
    return 127 - int(np.ceil(np.log2(np.sqrt(fan_in))))


def random_codes(cfg: ModelConfig, seed: int = 0):
    """Yield (reference name, ``Deferred`` device array) for every backbone tensor, drawn on the device in seconds
    when it is placed (dijax.model.param_map.Deferred: the device never holds the drawn tensors and the parameters
    at once; ``np.asarray`` draws one on its own).

    For benchmarks at the real model's dimensions, where quantising random floats on the host (``random_tensors``)
    would take minutes: fp8 and MXFP4 tensors are uniformly random codes (fp8 limited to exponent fields 0..7, so
    magnitudes stay below 2 and no NaN code appears) under one power-of-two scale per tensor that brings them to
    about N(0, 1/fan_in); dense tensors follow the same recipe as ``random_tensors``. Same shapes and dtypes; the
    routed experts come stacked per layer (``layers.L.ffn.experts.w1.weight`` [E, ...]), drawn in one piece so that
    the device memory holds no per-expert fragments. Tensor i in name order draws from ``fold_in(key(seed), i)``,
    whenever it is made.
    """
    root = jax.random.key(seed)
    spec = backbone_spec(cfg)
    drawn = 0
    for name in sorted(spec):
        if name.endswith(".scale"):
            continue
        s = spec[name]
        shape, scale_shape = s.shape, spec.get(name[:-len("weight")] + "scale", s).shape
        parts = name.split(".")
        if parts[2:4] == ["ffn", "experts"]:  # drawn stacked over the experts, once, under the stacked name
            if parts[4] != "0":
                continue
            name = ".".join(parts[:4] + parts[5:])
            shape, scale_shape = (cfg.n_routed_experts, *shape), (cfg.n_routed_experts, *scale_shape)
        drawn += 1
        key = jax.random.fold_in(root, drawn)
        scale_name = name[:-len("weight")] + "scale"
        packed = s.dtypes[0] in ("I8", "F4", "U8")
        if packed or s.dtypes[0] == "F8_E4M3" and not name.endswith("attn.wo_a.weight"):
            fan_in = shape[-1] * (2 if packed else 1)
            if packed:
                exponent, dtype = _unit_exponent(fan_in) - 1, jnp.uint8  # e2m1 codes reach 6
                make = partial(random_bytes, key, shape)
            else:
                exponent = 127 if name.endswith("engram.embed.weight") else _unit_exponent(fan_in)
                dtype, make = jnp.float8_e4m3fn, partial(_fp8_codes, key, shape)
            yield name, Deferred(shape, np.dtype(dtype), make)
            yield scale_name, Deferred(scale_shape, np.dtype(jnp.uint8),
                                       partial(jnp.full, scale_shape, exponent, jnp.uint8))
        elif name.endswith("attn.wo_a.weight"):  # held dequantised, as the converter writes it
            yield name, Deferred(shape, np.dtype(jnp.bfloat16), partial(_wo_a, key, shape))
        else:
            dtype = jnp.float32 if s.dtypes[0] == "F32" else jnp.bfloat16
            kind = re.sub(r"^layers\.\d+\.", "layers.L.", name)  # what _dense reads of the name: one program a shape
            yield name, Deferred(shape, np.dtype(dtype), partial(_dense_codes, kind, shape, key, cfg, dtype))


# Each maker below is one jitted program, compiled once for each shape (and kind) it draws: eagerly, every operation
# of a draw compiled on its own for every shape, and on a fresh H100 flash-slice's draw took 151 s (92-97 s with
# those compilations in a persistent cache; thirty-sixth session).
@partial(jax.jit, static_argnums=1)
def _wo_a(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return _KeyDraws(key).normal(0.0, 1 / np.sqrt(shape[1]), shape).astype(jnp.bfloat16)


@partial(jax.jit, static_argnums=(0, 1, 3, 4))
def _dense_codes(kind: str, shape: tuple[int, ...], key: jax.Array, cfg: ModelConfig, dtype) -> jax.Array:
    """``_dense``'s tensor of the name ``kind`` (a layer's name with its index as ``L``), in ``dtype``."""
    return _dense(kind, shape, _KeyDraws(key), cfg, _gain(kind)).astype(dtype)


@partial(jax.jit, static_argnums=1)
def _fp8_codes(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniformly random e4m3 codes with exponent fields 0..7 (magnitudes below 2, no NaN)."""
    return jax.lax.bitcast_convert_type(random_bytes(key, shape) & 0xBF, jnp.float8_e4m3fn)


def random_codes_params(cfg: ModelConfig, seed: int = 0) -> nnx.State:
    """The model's parameters (``Transformer`` state) for ``cfg`` from ``random_codes`` (benchmarks; deterministic
    per seed and device)."""
    return params_from_tensors(cfg, random_codes(cfg, seed), source=f"random codes (seed {seed})")
