"""Shared building blocks: linear layers by storage dtype, RMSNorm, and the NNX parameter conventions every module
follows (the rotary embedding is ``dijax.kernels.rope``).

Parameters are ``nnx.Param`` in the checkpoint's own dtype (fp8 codes, packed MXFP4 bytes, ue8m0 scale bytes, bf16,
fp32), never up-cast in storage; the reference's load-time promotions to fp32 happen in the computation instead.
Each carries its logical axis names as the ``out_sharding`` metadata (``LOGICAL_AXES`` below is the one list of
names; dijax.model.param_map maps checkpoint names to module paths). Parameters of stacked layers (see
dijax.model.plan) carry two leading axes, ``period`` and ``layer``.

Dimension letters (README glossary): T tokens of the step, D model dim, K head dim, R rope dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dijax.kernels import quant
from dijax.kernels.collapse import collapse_norm
from dijax.kernels.fp8_linear import fp8_linear, fp8_linears
from dijax.kernels.numerics import matmul_f32, rms_norm
from dijax.kernels.quant import FP4_BLOCK, FP8_BLOCK

LOGICAL_AXES = {
    "period": "repeat of a stage's period of layers (stacked, scanned)",
    "layer": "layer within a run of like layers (stacked, scanned)",
    "vocab": "vocabulary (embedding rows, head outputs)",
    "embed": "model dim D of one stream",
    "streams_embed": "C * D: all hyper-connection streams of a token, flattened",
    "hc_mix": "hyper-connection mix width (2 + C) * C",
    "hc_scale": "the three hyper-connection scales (pre, post, comb)",
    "stream": "hyper-connection copy C",
    "q_lora": "query low-rank width Q",
    "heads": "query heads H",
    "heads_dim": "H * K: all heads' q, flattened",
    "head_dim": "K: width of one head (and of the KV latent)",
    "o_group_in": "H * K / G: the heads of one output group, flattened",
    "o_lora": "G * O: all output groups' low-rank widths",
    "index_heads": "indexer heads I",
    "index_heads_dim": "I * J: all indexer heads' q, flattened",
    "index_dim": "J: indexer head dim",
    "expert": "routed expert E",
    "expert_out": "output features of a routed expert matrix",
    "expert_in": "input features of a routed expert matrix (packed: two MXFP4 codes per byte)",
    "mlp": "hidden width F of the shared expert",
    "engram_rows": "Engram table rows",
    "engram_dim": "Engram row width",
    "engram_in": "Engram projection input: hash columns * row width",
    "engram_out": "Engram projection output (C + 1) * D: keys of every stream and one value",
}

STORAGES = ("fp8", "mxfp4", "bf16")


def param(stack: tuple[int, ...], shape: tuple[int, ...], dtype, axes: tuple[str, ...],
          in_place: bool = False) -> nnx.Param:
    """An ``nnx.Param`` of ``stack + shape`` zeros (abstract under ``nnx.eval_shape``) with logical axis names.

    stack: leading (period, layer) sizes of stacked layers, or () for unstacked parameters. in_place: a weight its
    kernel reads in place from the stack of layers (``IN_PLACE``; the model hands it over as a ``LayerSlice``).
    """
    names = ("period", "layer")[:len(stack)] + axes
    if len(axes) != len(shape) or any(a not in LOGICAL_AXES for a in axes):
        raise ValueError(f"logical axes {axes} must name each of the {len(shape)} dims from LOGICAL_AXES")
    return nnx.Param(jnp.zeros(tuple(stack) + tuple(shape), dtype), out_sharding=names, eager_sharding=False,
                     in_place=in_place)


def IN_PLACE(path, variable) -> bool:
    """nnx filter: the parameters read in place from their stack of layers (``param(in_place=True)``): the fp8
    linears' and the routed experts' weights and scales, which a scanned layer hands to its kernels as
    ``LayerSlice``s (dijax.kernels.stacked) instead of slicing them out of the stack (a copy per layer)."""
    return bool(variable.get_metadata().get("in_place", False))


def values(module: nnx.Module) -> dict:
    """A module's parameters as the plain nested dict of arrays the functional code takes (checkpoint names)."""
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def matmul_f32_weight(x: jax.Array, w_OI: jax.Array) -> jax.Array:
    """``x.float() @ w_OI.T`` for bf16 x and an fp32 weight, without an fp32 copy of x. -> float32 [..., O].

    The weight is split into three bf16 parts whose sum is w exactly (``hi`` is w rounded to bf16, ``mid`` what
    is left rounded to bf16, ``lo`` the rest, at most 8 significant bits), so every product of x and a part is
    exact in fp32: one bf16 GEMM of x against the stacked parts with fp32 accumulation, then the three partial
    sums added. It differs from an fp32 GEMM only by fp32 rounding (that GEMM rounds each product; this rounds
    sums of exact ones). Used where x is large: the hyper-connections' fp32 projection of a prefill (an fp32 copy
    of [8192, 4 * 5120] and an fp32 GEMM per call on the H200: docs/benchmarks.md, twenty-fourth session)."""
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"matmul_f32_weight takes bf16 x, got {x.dtype}")
    hi = w_OI.astype(jnp.bfloat16)
    rest = w_OI - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
    parts = matmul_f32(x, jnp.concatenate([hi, mid, lo], axis=0))
    parts = parts.reshape(*parts.shape[:-1], 3, w_OI.shape[0])
    return (parts[..., 0, :] + parts[..., 1, :]) + parts[..., 2, :]


def matmul_promoted(x: jax.Array, w_OI: jax.Array) -> jax.Array:
    """The reference's ``x.float() @ W.T`` for a bf16 weight W it promotes to fp32 at load. -> float32 [..., O].

    When x is bf16 too, every product of two bf16 values is exact in fp32, so a bf16 GEMM with fp32 accumulation
    computes the reference's products (summed in its own order) without an fp32 copy of the weight, on the tensor
    cores: on the H200 the fp32 GEMM of the 129,280 x 5120 head took 2.7 ms at 64 rows and 27 ms at 1024, 11.5 and
    6.3 % of its memory floor (docs/benchmarks.md, seventh session)."""
    if x.dtype == jnp.bfloat16 and w_OI.dtype == jnp.bfloat16:
        return matmul_f32(x, w_OI)
    return matmul_f32(x.astype(jnp.float32), w_OI.astype(jnp.float32))


def linear(x: jax.Array, p: dict, impl: str = "reference", quantised: bool = False) -> jax.Array:
    """The reference ``linear()``: the GEMM is chosen by the weight's storage dtype.

    x: [..., in] bf16; p: {'weight': [out, in], optional 'scale'}. ``quantised``: x holds ``quant.fq8``'s values
    already, which the fp8 kernel may take as they are (``fp8_linear.KernelConfig.take_quantised``).
      * fp8 (e4m3 + ue8m0 32x32 tiles): x is fake-quantised to e4m3 per 32, block-scaled GEMM -> bf16, through
        the kernel seam ``dijax.kernels.fp8_linear`` (``impl``: 'reference' or 'pallas', static);
      * MXFP4 (uint8 packed + ue8m0 1x32): x fake-quantised to e4m3 per 32 -> bf16;
      * bf16: plain bf16 GEMM (fp32 accumulation) -> bf16 (a bf16 weight the reference promotes to fp32 at load
        takes ``matmul_promoted`` instead, see QuantLinear's ``upcast``).
    """
    w = p["weight"]
    if w.dtype == jnp.float8_e4m3fn:
        return fp8_linear(x, w, p["scale"], impl=impl, quantised=quantised)
    if w.dtype == jnp.uint8:
        w_deq = quant.dequant_fp4_weight(w, p["scale"])
        return matmul_f32(quant.fq8(x), w_deq).astype(jnp.bfloat16)
    return matmul_f32(x.astype(jnp.bfloat16), w).astype(jnp.bfloat16)


def linears(x: jax.Array, ps: list[dict], impl: str = "reference", joined: bool = False,
            quantised: bool = False) -> list[jax.Array]:
    """``linear`` of one x by each of ``ps`` (their outputs, in order; with ``joined`` one array of them side by
    side). When every weight is fp8 they go through ``fp8_linears``, whose Pallas implementation runs them as one
    kernel launch (and writes them side by side). ``quantised``: as ``linear``'s."""
    if all(p["weight"].dtype == jnp.float8_e4m3fn for p in ps):
        return fp8_linears(x, [(p["weight"], p["scale"]) for p in ps], impl=impl, joined=joined, quantised=quantised)
    ys = [linear(x, p, impl, quantised) for p in ps]
    return [jnp.concatenate(ys, axis=-1)] if joined else ys


class QuantLinear(nnx.Module):
    """A Linear in its checkpoint storage (the reference's ``Linear``): ``weight`` [out, in] and, when quantised,
    ``scale`` (ue8m0 bytes). The GEMM follows the storage (see ``linear``).

    storage: 'fp8' (e4m3 codes, one scale per 32x32 tile; read in place when stacked, ``IN_PLACE``), 'mxfp4'
    (uint8 [out, in / 2], two e2m1 codes per byte, one scale per 1x32) or 'bf16'. ``upcast``: the reference promotes
    this bf16 weight to fp32 at load; dijax keeps it bf16 and computes the same fp32 products (``matmul_promoted``),
    returning float32.
    """

    def __init__(self, in_dim: int, out_dim: int, storage: str, axes: tuple[str, str], stack: tuple[int, ...] = (),
                 upcast: bool = False):
        if storage not in STORAGES:
            raise ValueError(f"QuantLinear storage must be one of {STORAGES}, got {storage!r}")
        if upcast and storage != "bf16":
            raise ValueError(f"QuantLinear upcast applies to bf16 storage only, got {storage!r}")
        self.upcast = upcast
        if storage == "fp8":
            self.weight = param(stack, (out_dim, in_dim), jnp.float8_e4m3fn, axes, in_place=True)
            self.scale = param(stack, (-(-out_dim // FP8_BLOCK), -(-in_dim // FP8_BLOCK)), jnp.uint8,
                               axes, in_place=True)
        elif storage == "mxfp4":
            self.weight = param(stack, (out_dim, in_dim // 2), jnp.uint8, axes)
            self.scale = param(stack, (out_dim, in_dim // FP4_BLOCK), jnp.uint8, axes)
        else:
            self.weight = param(stack, (out_dim, in_dim), jnp.bfloat16, axes)

    def __call__(self, x: jax.Array, impl: str = "reference") -> jax.Array:
        """x: [..., in] -> [..., out]: bf16, or float32 when ``upcast``; ``impl`` as ``linear`` takes it."""
        if self.upcast:
            return matmul_promoted(x, self.weight[...])
        return linear(x, values(self), impl)


class RMSNorm(nnx.Module):
    """RMSNorm with a bf16 ``weight`` [dim] (see ``rms_norm``)."""

    def __init__(self, dim: int, eps: float, axis: str, stack: tuple[int, ...] = ()):
        self.eps = eps
        self.weight = param(stack, (dim,), jnp.bfloat16, (axis,))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., dim] -> same shape and dtype."""
        return rms_norm(x, self.weight[...], self.eps)

    def of_streams(self, x_TCD: jax.Array, pre_TC: jax.Array, impl: str = "reference",
                   quantized: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
        """The norm of the hyper-connection streams x_TCD bf16 [T, C, dim] collapsed by pre_TC float32 [T, C]
        (``dijax.kernels.collapse``, by ``impl``) -> bf16 [T, dim]; with ``quantized`` also its fq8."""
        return collapse_norm(x_TCD, pre_TC, self.weight[...], self.eps, quantized, impl=impl)


class Embed(nnx.Module):
    """Token embedding, bf16 ``weight`` [V, D]."""

    def __init__(self, vocab: int, dim: int):
        self.weight = param((), (vocab, dim), jnp.bfloat16, ("vocab", "embed"))

    def __call__(self, tokens_T: jax.Array) -> jax.Array:
        """tokens_T int32 [T] -> bf16 [T, D]."""
        return self.weight[...][tokens_T]


