"""The attention's two latents after its first projections (v41_spec §4): the query latent
``qr = RMSNorm(qa)`` (the input of ``wq_b`` and of the indexer's query) and the KV row
``kv = fq8(rope(RMSNorm(kva)))``, which the window ring stores and the attention reads. Both take the projections
side by side, ``qkva = [qa | kva]`` (``fp8_linears``' joined output: one launch writes it, and a kernel reads it
without a copy of either part).

Two implementations behind ``latents(..., impl=)``, one signature:
  * ``"reference"``: jnp (``numerics.rms_norm``, ``rope.rope``, ``quant.fq8``). In a decode step XLA takes six
    launches a layer for them (deviceless compile for the H100, tiny and flash-slice, thirty-ninth session): the two
    sums of squares, the query latent's scaling, the KV row's fp8 block maxima, the KV row, and the ring's scatter,
    which computes the row again;
  * ``"pallas"``: one Triton-lowered launch writing both latents (the ring's scatter then reads kv).

Each program takes ``LatentsConfig.block_tokens`` tokens. A KV row is held as its even and its odd columns (two
strided loads, [N, K / 2] each): a rope pair is (even j, odd j), and an fp8 block of 32 values is 16 columns of
each half, the layout ``quant.fq8_tiles`` takes with two tiles. The query latent is read in power-of-two column
chunks (Triton's blocks). The sums of squares run in another order than XLA's (float32 rounding apart, the same
values); the mean is a correctly rounded division (``div.rn.f32``), as the reference's true division.

Letters: T tokens, Q query latent width, K KV width (the head dim), X = Q + K, P rope pairs (R / 2), N tokens of a
program, H = K / 2, C a chunk of Q.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dijax.kernels import interpret_mode, poison, quant
from dijax.kernels.division import rms_factor_rn
from dijax.kernels.numerics import rms_norm
from dijax.kernels.rope import angles, rope

IMPLS = ("reference", "pallas")
MAX_CHUNK = 256  # the widest column chunk of the query latent a program loads at once


@dataclasses.dataclass(frozen=True)
class LatentsConfig:
    """block_tokens: tokens a program takes (a power of two; fewer when the step has fewer); warps: Triton warps a
    program; poison: outputs start NaN-filled (tests: an element no program writes shows)."""
    block_tokens: int = 16
    warps: int = 4
    poison: bool = False


def latents_reference(qkva_TX: jax.Array, q_width: int, q_weight_Q: jax.Array, kv_weight_K: jax.Array,
                      positions_T: jax.Array, freqs: np.ndarray, eps: float) -> tuple[jax.Array, jax.Array]:
    """qkva_TX bf16: the ``wq_a`` output (its first ``q_width`` = Q columns) and the ``wkv`` output side by side;
    the norms' bf16 weights, positions_T int32, freqs float32 [P] (``rope.rope_frequencies``) -> (qr_TQ, kv_TK),
    bf16: the query latent, and the KV row normed, its last 2P columns rotated, fake-quantised to e4m3 per 32
    values."""
    qr_TQ = rms_norm(qkva_TX[:, :q_width], q_weight_Q, eps)
    kv_TK = quant.fq8(rope(rms_norm(qkva_TX[:, q_width:], kv_weight_K, eps), positions_T, freqs))
    return qr_TQ, kv_TK


def _kernel(qkva_ref, qw_ref, kvw_ref, cos_ref, sin_ref, qr_ref, kv_ref, *, n_tokens: int, block: int,
            chunk: int, eps: float, interpret: bool):
    """Program i: tokens [i * N, (i + 1) * N) (rows past T read token T - 1 and are not written). qkva_ref [T, X]
    bf16 (Q = qr_ref's width, then K); qw_ref [Q], kvw_ref [K] bf16; cos_ref, sin_ref [T, P] float32; qr_ref
    [T, Q], kv_ref [T, K] bf16."""
    rows_N = pl.program_id(0) * block + jnp.arange(block)
    rows_N1 = rows_N[:, None]  # masked rows keep their own indices: interpreted, clamped duplicates would overwrite
    safe_N1 = jnp.minimum(rows_N1, n_tokens - 1)
    live_N1 = rows_N1 < n_tokens

    q, k = qr_ref.shape[1], kv_ref.shape[1]
    columns = [c0 + jnp.arange(chunk)[None, :] for c0 in range(0, q, chunk)]
    qa = [pltriton.load(qkva_ref.at[safe_N1, col_1C]).astype(jnp.float32) for col_1C in columns]
    factor_N1 = rms_factor_rn(sum(jnp.sum(x * x, axis=1, keepdims=True) for x in qa), q, eps, interpret)
    for x_NC, col_1C in zip(qa, columns):
        weight_1C = pltriton.load(qw_ref.at[col_1C]).astype(jnp.float32)
        pltriton.store(qr_ref.at[rows_N1, col_1C], (weight_1C * (x_NC * factor_N1)).astype(jnp.bfloat16),
                       mask=jnp.broadcast_to(live_N1, x_NC.shape))

    half, pairs = k // 2, cos_ref.shape[1]
    even_1H = 2 * jnp.arange(half)[None, :]
    parts = [pltriton.load(qkva_ref.at[safe_N1, q + even_1H + odd]).astype(jnp.float32) for odd in (0, 1)]
    factor_N1 = rms_factor_rn(sum(jnp.sum(x * x, axis=1, keepdims=True) for x in parts), k, eps, interpret)
    a, b = [(pltriton.load(kvw_ref.at[even_1H + odd]).astype(jnp.float32) * (x * factor_N1))
            .astype(jnp.bfloat16).astype(jnp.float32) for odd, x in enumerate(parts)]
    pair_1H = jnp.arange(half)[None, :] - (half - pairs)
    tail_1H = pair_1H >= 0  # the rotated pairs: the row's last 2P columns
    pair_1H = jnp.maximum(pair_1H, 0)
    cos_NH = pltriton.load(cos_ref.at[safe_N1, pair_1H])
    sin_NH = pltriton.load(sin_ref.at[safe_N1, pair_1H])
    a, b = (jnp.where(tail_1H, (a * cos_NH - b * sin_NH).astype(jnp.bfloat16).astype(jnp.float32), a),
            jnp.where(tail_1H, (a * sin_NH + b * cos_NH).astype(jnp.bfloat16).astype(jnp.float32), b))
    live_NH = jnp.broadcast_to(live_N1, a.shape)
    for odd, x_NH in enumerate(quant.fq8_tiles([a, b])):
        pltriton.store(kv_ref.at[rows_N1, even_1H + odd], x_NH, mask=live_NH)


def _chunk(width: int) -> int:
    """The widest power of two up to ``MAX_CHUNK`` that divides ``width``."""
    return min(MAX_CHUNK, width & -width)


def check_shapes(qkva_TX: jax.Array, q_width: int, pairs: int) -> None:
    """Raise ValueError unless the kernel takes these widths: K a multiple of ``FP8_BLOCK`` with K / 2 a power of
    two, 2P <= K, and Q a multiple of 16."""
    q = q_width
    k = qkva_TX.shape[-1] - q
    if k % quant.FP8_BLOCK or (k // 2) & (k // 2 - 1) or not 0 < 2 * pairs <= k:
        raise ValueError(f"latents_pallas: the KV width must be a multiple of {quant.FP8_BLOCK} whose half is a "
                         f"power of two, at least the rope width {2 * pairs}; got {k}")
    if q % 16:
        raise ValueError(f"latents_pallas: the query latent width must be a multiple of 16, got {q}")


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "config"))
def _latents_call(qkva_TX, q_weight_Q, kv_weight_K, cos_TP, sin_TP, eps: float, interpret: bool,
                  config: LatentsConfig):
    t, q = qkva_TX.shape[0], q_weight_Q.shape[0]
    block = min(config.block_tokens, pl.next_power_of_2(t))
    kernel = functools.partial(_kernel, n_tokens=t, block=block, chunk=_chunk(q), eps=eps, interpret=interpret)
    out_shape = (jax.ShapeDtypeStruct((t, q), jnp.bfloat16),
                 jax.ShapeDtypeStruct((t, kv_weight_K.shape[0]), jnp.bfloat16))
    return poison.pallas_call(kernel, qkva_TX, q_weight_Q, kv_weight_K, cos_TP, sin_TP, out_shape=out_shape,
                              poison=config.poison, grid=(pl.cdiv(t, block),),
                              compiler_params=pltriton.CompilerParams(num_warps=config.warps, num_stages=1),
                              name="latents", interpret=interpret)


def latents_pallas(qkva_TX: jax.Array, q_width: int, q_weight_Q: jax.Array, kv_weight_K: jax.Array,
                   positions_T: jax.Array, freqs: np.ndarray, eps: float, interpret: bool | None = None,
                   config: LatentsConfig = LatentsConfig()) -> tuple[jax.Array, jax.Array]:
    """Same contract as ``latents_reference``, one kernel launch (the angles' cos and sin are XLA's, as ``rope``
    computes them: one fusion a step for every layer of the same frequencies). ``interpret``: run the kernel
    interpreted (default: off a GPU)."""
    check_shapes(qkva_TX, q_width, len(freqs))
    t, x = qkva_TX.shape
    if t == 0:
        return jnp.zeros((0, q_width), jnp.bfloat16), jnp.zeros((0, x - q_width), jnp.bfloat16)
    cos_TP, sin_TP = angles(positions_T, freqs)
    return _latents_call(qkva_TX, q_weight_Q, kv_weight_K, cos_TP, sin_TP, eps=float(eps),
                         interpret=interpret_mode(interpret), config=config)


_IMPLEMENTATIONS = {"reference": latents_reference, "pallas": latents_pallas}


def latents(qkva_TX: jax.Array, q_width: int, q_weight_Q: jax.Array, kv_weight_K: jax.Array,
            positions_T: jax.Array, freqs: np.ndarray, eps: float, *, impl: str = "reference"
            ) -> tuple[jax.Array, jax.Array]:
    """The latents seam (``latents_reference``'s contract); ``impl`` in IMPLS (static)."""
    if impl not in _IMPLEMENTATIONS:
        raise ValueError(f"latents impl must be one of {IMPLS}, got {impl!r}")
    return _IMPLEMENTATIONS[impl](qkva_TX, q_width, q_weight_Q, kv_weight_K, positions_T, freqs, eps)
