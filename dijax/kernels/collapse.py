"""The hyper-connections' collapse and the RMS norm after it (v41_spec §8): a sublayer's input
``y = RMSNorm(sum_k pre[k] * x[k])`` from the C residual streams x [T, C, D] and the token's collapse weights
pre [T, C] (the attention's and the MoE's inputs in every layer, and the final norm's); with ``quantized``, also
``fq8(y)``, the routed experts' activations (v41_spec §9).

Two implementations behind ``collapse_norm(..., impl=)``, one signature:
  * ``"reference"``: jnp (``collapse``: float32 products summed strictly in stream order, then rounded to bf16,
    as the reference collapses; ``numerics.rms_norm``). In a decode step XLA takes two launches for the attention's
    input and six for the MoE's: the collapse, two for the norm beside the fq8 maxima, and two for the routed
    experts' fq8 (deviceless compile for the H100, tiny, fortieth session);
  * ``"pallas"``: one Triton-lowered launch (with ``quantized``, writing both).

Each program takes ``CollapseConfig.block_tokens`` tokens and holds their whole collapsed rows in registers, in
power-of-two column chunks: it reads each stream's chunk once, keeps the bf16-rounded sum, and writes the normed
row (and its fq8, ``quant.fq8_tiles``) after the sum of squares. The sum of squares runs in another order than
XLA's (float32 rounding apart, the same value); its mean is a correctly rounded division (``div.rn.f32``), as the
reference's true division.

Letters: T tokens, C streams (hc_mult), D model dim, N tokens of a program, K a column chunk of D.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dijax.kernels import interpret_mode, poison, quant, sinkhorn
from dijax.kernels.division import rms_factor_rn
from dijax.kernels.numerics import rms_norm, sum_in_order

IMPLS = ("reference", "pallas")
MAX_CHUNK = 512  # the widest column chunk a program loads at once


@dataclasses.dataclass(frozen=True)
class CollapseConfig:
    """block_tokens: tokens a program takes (a power of two; fewer when the step has fewer, or when N x D would pass
    ``max_values``: at V4.1's D = 4096 a program takes one token, so a step's tokens spread over as many SMs; built
    for sm_90, 4 tokens of 4096 a program took 252-254 registers, one token 64-69, tools/kernel_report.py); warps:
    Triton warps a program; max_tokens: steps of more tokens take the reference (there XLA fuses the norm with its
    consumers' quantisations; deviceless, tiny decode B=64: 712 launches with the kernel, 701 without); poison: the
    output starts NaN-filled (tests: an element no program writes shows)."""
    block_tokens: int = 4
    max_values: int = 1024
    warps: int = 4
    max_tokens: int = 16
    poison: bool = False


def collapse(x_TCD: jax.Array, pre_TC: jax.Array) -> jax.Array:
    """The streams collapsed: ``sum_k pre[k] * x[k]`` in float32, summed in stream order, cast to x's dtype.
    x_TCD [T, C, D], pre_TC float32 [T, C] -> [T, D]. (XLA's layout of the sum follows the split kernel's output:
    ``sinkhorn.entry_major``.)"""
    terms = pre_TC[..., None] * x_TCD.astype(jnp.float32)
    return sum_in_order(terms, 1, front=sinkhorn.entry_major(x_TCD.shape[0]))[:, 0].astype(x_TCD.dtype)


def collapse_norm_reference(x_TCD: jax.Array, pre_TC: jax.Array, weight_D: jax.Array, eps: float,
                            quantized: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """x_TCD bf16 [T, C, D], pre_TC float32 [T, C], the norm's bf16 weight_D -> y_TD bf16: the collapsed streams
    (``collapse``) RMS-normed (``numerics.rms_norm``); with ``quantized`` (static) (y_TD, fq8(y_TD))."""
    y_TD = rms_norm(collapse(x_TCD, pre_TC), weight_D, eps)
    return (y_TD, quant.fq8(y_TD)) if quantized else y_TD


def _kernel(x_ref, pre_ref, w_ref, *out_refs, n_tokens: int, block: int, chunk: int, eps: float, interpret: bool):
    """Program i: tokens [i * N, (i + 1) * N) (rows past T read token T - 1 and are not written). x_ref [T, C * D]
    bf16 (stream k's row at columns [k * D, (k + 1) * D)); pre_ref [T, C] float32; w_ref [D] bf16; out_refs: y [T, D]
    bf16, then optionally its fq8 [T, D] bf16."""
    rows_N1 = (pl.program_id(0) * block + jnp.arange(block))[:, None]
    safe_N1 = jnp.minimum(rows_N1, n_tokens - 1)  # masked rows keep their own indices: interpreted, clamped
    live_N1 = rows_N1 < n_tokens  # duplicates would overwrite
    streams, d = pre_ref.shape[1], w_ref.shape[0]
    pre = [pltriton.load(pre_ref.at[safe_N1, jnp.full((1, 1), k, jnp.int32)]) for k in range(streams)]
    columns = [c0 + jnp.arange(chunk)[None, :] for c0 in range(0, d, chunk)]
    rows = []
    for col_1K in columns:
        terms = [pre[k] * pltriton.load(x_ref.at[safe_N1, k * d + col_1K]).astype(jnp.float32)
                 for k in range(streams)]
        rows.append(functools.reduce(lambda a, b: a + b, terms).astype(jnp.bfloat16).astype(jnp.float32))
    factor_N1 = rms_factor_rn(sum(jnp.sum(x * x, axis=1, keepdims=True) for x in rows), d, eps, interpret)
    for x_NK, col_1K in zip(rows, columns):
        weight_1K = pltriton.load(w_ref.at[col_1K]).astype(jnp.float32)
        y_NK = (weight_1K * (x_NK * factor_N1)).astype(jnp.bfloat16)
        outs = [y_NK, *quant.fq8_tiles([y_NK.astype(jnp.float32)])][:len(out_refs)]
        for out_ref, out_NK in zip(out_refs, outs):
            pltriton.store(out_ref.at[rows_N1, col_1K], out_NK, mask=jnp.broadcast_to(live_N1, x_NK.shape))


def check_shapes(x_TCD: jax.Array, pre_TC: jax.Array, weight_D: jax.Array) -> None:
    """Raise ValueError unless the kernel takes these: x [T, C, D] with D a multiple of 16, pre [T, C], weight
    [D]."""
    t, c, d = x_TCD.shape
    if pre_TC.shape != (t, c) or weight_D.shape != (d,):
        raise ValueError(f"collapse_norm: x [T, C, D] = {x_TCD.shape} needs pre [T, C] and weight [D], got "
                         f"{pre_TC.shape} and {weight_D.shape}")
    if d % quant.FP8_BLOCK:
        raise ValueError(f"collapse_norm_pallas: the model dim must be a multiple of {quant.FP8_BLOCK}, got {d}")


@functools.partial(jax.jit, static_argnames=("eps", "quantized", "interpret", "config"))
def _collapse_norm_call(x_TCD, pre_TC, weight_D, eps: float, quantized: bool, interpret: bool,
                        config: CollapseConfig):
    t, c, d = x_TCD.shape
    block = min(config.block_tokens, pl.next_power_of_2(t), max(1, config.max_values // pl.next_power_of_2(d)))
    kernel = functools.partial(_kernel, n_tokens=t, block=block, chunk=min(MAX_CHUNK, d & -d), eps=eps,
                               interpret=interpret)
    outs = poison.pallas_call(kernel, x_TCD.reshape(t, c * d), pre_TC.astype(jnp.float32), weight_D,
                              out_shape=(jax.ShapeDtypeStruct((t, d), jnp.bfloat16),) * (1 + quantized),
                              poison=config.poison, grid=(pl.cdiv(t, block),),
                              compiler_params=pltriton.CompilerParams(num_warps=config.warps, num_stages=1),
                              name="collapse_norm", interpret=interpret)
    return outs if quantized else outs[0]


def collapse_norm_pallas(x_TCD: jax.Array, pre_TC: jax.Array, weight_D: jax.Array, eps: float,
                         quantized: bool = False, interpret: bool | None = None,
                         config: CollapseConfig = CollapseConfig()) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Same contract as ``collapse_norm_reference``, one kernel launch for steps of up to ``config.max_tokens``
    tokens (the reference above). ``interpret``: run the kernel interpreted (default: off a GPU)."""
    check_shapes(x_TCD, pre_TC, weight_D)
    if x_TCD.shape[0] > config.max_tokens:
        return collapse_norm_reference(x_TCD, pre_TC, weight_D, eps, quantized)
    if x_TCD.shape[0] == 0:
        y_TD = jnp.zeros((0, x_TCD.shape[2]), jnp.bfloat16)
        return (y_TD, y_TD) if quantized else y_TD
    return _collapse_norm_call(x_TCD, pre_TC, weight_D, eps=float(eps), quantized=quantized,
                               interpret=interpret_mode(interpret), config=config)


_IMPLEMENTATIONS = {"reference": collapse_norm_reference, "pallas": collapse_norm_pallas}


def collapse_norm(x_TCD: jax.Array, pre_TC: jax.Array, weight_D: jax.Array, eps: float, quantized: bool = False,
                  *, impl: str = "reference") -> jax.Array | tuple[jax.Array, jax.Array]:
    """The collapse-and-norm seam (``collapse_norm_reference``'s contract); ``impl`` in IMPLS (static)."""
    if impl not in _IMPLEMENTATIONS:
        raise ValueError(f"collapse impl must be one of {IMPLS}, got {impl!r}")
    return _IMPLEMENTATIONS[impl](x_TCD, pre_TC, weight_D, eps, quantized)
