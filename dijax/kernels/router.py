"""The MoE router's selection (v41_spec §9): each token's top-X experts by ``scores + bias``, their ids in ascending
order, and their unbiased scores renormalised (``/ (sum + 1e-20)``) and scaled by ``route_scale``.

Two implementations behind ``route(..., impl=)``, with one signature:
  * ``"reference"``: ``lax.top_k`` (a sort kernel per MoE layer and step on the GPU: XLA's sorts took ~10 us each
    at one token on the H200, 14 a flash-slice decode step, seven of them the routers'; twenty-second session's
    trace), the ids sorted by ``ascending``'s network, the scores gathered, the sum and the division;
  * ``"pallas"``: one Triton-lowered Pallas kernel. Each program holds a few tokens' E scores in registers
    (``block_tokens``, ``RouterConfig``) and takes the maximum X times (the lowest id among equal maxima first:
    ``lax.top_k``'s order, so the same experts on ties), masking each pick; then the same network, the scores
    picked by a masked sum (one nonzero term: exact), the sum in id order and ``div.rn.f32``
    (dijax.kernels.division). It writes [T, X] (a pick of its tokens a strided column store): written [X, T], as
    before the thirty-eighth session, each MoE layer's consumers needed a transpose kernel of their own.

Both sum the X weights left to right in ascending id order (``sum_in_order``), so they agree bit for bit for equal
scores. The scores themselves (``sqrt(softplus(logits / temp))``) stay in XLA: libdevice's ``exp`` and ``log1p``
are other code than XLA's, and an ulp in a score can swap an expert at a near tie.

Letters: T tokens, E routed experts, X experts per token, P = E rounded up to a power of two (Triton's block).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dijax.kernels import interpret_mode
from dijax.kernels.division import div_rn
from dijax.kernels.numerics import divide, sum_in_order

IMPLS = ("reference", "pallas")
NORM_EPS = np.float32(1e-20)


@dataclass(frozen=True)
class RouterConfig:
    """Tiling of ``route_pallas``: ``block_tokens`` tokens at most per program (a power of two), ``warps`` Triton
    warps per program. One token and one warp (its 384 scores in 12 registers a lane, every reduction a warp
    shuffle) measured best on the H200 (``tools/bench_kernels.py --only router --sweep``, twenty-third session):
    9.8 / 19.0 us at 16 / 8192 tokens against 23.8 / 51.6 us at 16 tokens and 4 warps a program, and XLA's
    16.1 / 140.9 us; at 1-1024 tokens every one-token tiling was 10-13 us."""

    block_tokens: int = 1
    warps: int = 1

    def __post_init__(self):
        if self.block_tokens < 1 or self.block_tokens & (self.block_tokens - 1):
            raise ValueError(f"RouterConfig.block_tokens must be a power of two >= 1, got {self.block_tokens}")
        if self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"RouterConfig.warps must be one of (1, 2, 4, 8, 16), got {self.warps}")


def _ascending_columns(cols: list) -> list:
    """An odd-even transposition network over the columns (vectors): X rounds of compare-exchanges between
    neighbours; elementwise minima and maxima, no sort."""
    cols = list(cols)
    for r in range(len(cols)):
        for i in range(r % 2, len(cols) - 1, 2):
            cols[i], cols[i + 1] = jnp.minimum(cols[i], cols[i + 1]), jnp.maximum(cols[i], cols[i + 1])
    return cols


def ascending(ids_TX: jax.Array) -> jax.Array:
    """Each row of ``ids_TX`` [T, X] in ascending order, as ``jnp.sort(ids_TX, axis=-1)``, by an odd-even
    transposition network that XLA fuses with its neighbours, where a sort is a kernel launch of its own on the
    GPU (one per MoE layer and step, for the 6 ids of each token)."""
    return jnp.stack(_ascending_columns([ids_TX[:, i] for i in range(ids_TX.shape[1])]), axis=1)


def route_reference(scores_TE: jax.Array, bias_E: jax.Array, n_active: int, normalize: bool,
                    route_scale: float, valid_T: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """scores_TE float32 [T, E] (non-negative), bias_E float32 [E] -> (weights float32 [T, X], experts int32
    [T, X] ascending): the top X of scores + bias, weighted by their scores, renormalised when ``normalize`` (and
    X > 1), times ``route_scale``. valid_T: None, or bool [T], False for a step's padding tokens, whose experts are
    all -1 (routed to none; their weights are left as computed)."""
    _, experts = jax.lax.top_k(scores_TE + bias_E, n_active)
    experts = ascending(experts)  # the reference sums expert outputs in expert-id order
    weights = jnp.take_along_axis(scores_TE, experts, axis=-1)
    if normalize and n_active > 1:
        weights = divide(weights, sum_in_order(weights, -1) + NORM_EPS)
    if valid_T is not None:
        experts = jnp.where(valid_T[:, None], experts, -1)
    return weights * np.float32(route_scale), experts.astype(jnp.int32)


def block_tokens(t: int, config: RouterConfig = RouterConfig()) -> int:
    """Tokens per program for t tokens: the power of two >= t, at most ``config.block_tokens`` (so a tiling of
    several tokens still gives a one-token step one row of E scores)."""
    return int(min(config.block_tokens, pl.next_power_of_2(max(t, 1))))


def _route_kernel(scores_ref, bias_ref, valid_ref, weights_ref, experts_ref, *, block: int, n_tokens: int,
                  n_experts: int, n_active: int, normalize: bool, route_scale: float, interpret: bool):
    """Program i: tokens [i * B, (i + 1) * B), B = ``block`` (rows past ``n_tokens`` read token n_tokens - 1 and
    are not written). scores_ref [T, E], bias_ref [E] float32, valid_ref int32 [T] (0: experts -1) -> weights_ref,
    experts_ref [T, X]."""
    rows = pl.program_id(0) * block + jnp.arange(block)
    safe_R1 = jnp.minimum(rows, n_tokens - 1)[:, None]
    padded = pl.next_power_of_2(n_experts)
    ids_1P = jnp.arange(padded)[None, :]
    live_1P = ids_1P < n_experts
    safe_1P = jnp.minimum(ids_1P, n_experts - 1)
    scores_RP = pltriton.load(scores_ref.at[safe_R1, safe_1P])
    bias_1P = pltriton.load(bias_ref.at[safe_1P])
    free_RP = jnp.where(live_1P, scores_RP + bias_1P, -jnp.inf)
    picks = []
    for _ in range(n_active):
        peak_R1 = jnp.max(free_RP, axis=1, keepdims=True)
        pick_R = jnp.min(jnp.where(free_RP == peak_R1, ids_1P, padded), axis=1)
        picks.append(pick_R)
        free_RP = jnp.where(ids_1P == pick_R[:, None], -jnp.inf, free_RP)
    picks = _ascending_columns(picks)
    weights = [jnp.sum(jnp.where(ids_1P == p[:, None], scores_RP, np.float32(0)), axis=1) for p in picks]
    if normalize and n_active > 1:
        total = functools.reduce(lambda a, b: a + b, weights) + NORM_EPS
        weights = [div_rn(w, total, interpret) for w in weights]
    # rows past T keep their own indices, masked: clamped duplicates of a live row would overwrite it, interpreted
    live_R = rows < n_tokens
    valid_R = pltriton.load(valid_ref.at[safe_R1[:, 0]]) != 0
    for j, (w, p) in enumerate(zip(weights, picks)):
        column_R = jnp.full((block,), j)
        pltriton.store(weights_ref.at[rows, column_R], w * np.float32(route_scale), mask=live_R)
        pltriton.store(experts_ref.at[rows, column_R], jnp.where(valid_R, p, -1).astype(jnp.int32), mask=live_R)


@functools.partial(jax.jit, static_argnames=("n_active", "normalize", "route_scale", "interpret", "config"))
def route_pallas(scores_TE: jax.Array, bias_E: jax.Array, n_active: int, normalize: bool, route_scale: float,
                 valid_T: jax.Array | None = None, interpret: bool | None = None,
                 config: RouterConfig = RouterConfig()) -> tuple[jax.Array, jax.Array]:
    """Same contract as ``route_reference``, one kernel launch (``valid_T`` masked in the kernel: in a decode step
    XLA's select after the router was a launch of its own). ``interpret``: run the kernel interpreted (default: off
    a GPU); ``config``: the tiling."""
    interpret = interpret_mode(interpret)
    t, e = scores_TE.shape
    if t == 0:  # no program to launch
        return jnp.zeros((0, n_active), jnp.float32), jnp.zeros((0, n_active), jnp.int32)
    block = block_tokens(t, config)
    kernel = functools.partial(_route_kernel, block=block, n_tokens=t, n_experts=e, n_active=n_active,
                               normalize=normalize, route_scale=route_scale, interpret=interpret)
    weights_TX, experts_TX = pl.pallas_call(
        kernel, grid=(-(-t // block),), interpret=interpret, name="router",
        out_shape=[jax.ShapeDtypeStruct((t, n_active), jnp.float32), jax.ShapeDtypeStruct((t, n_active), jnp.int32)],
        compiler_params=pltriton.CompilerParams(num_warps=config.warps, num_stages=1))(
        scores_TE.astype(jnp.float32), bias_E.astype(jnp.float32),
        jnp.ones((t,), jnp.int32) if valid_T is None else valid_T.astype(jnp.int32))
    return weights_TX, experts_TX


_IMPLEMENTATIONS = {"reference": route_reference, "pallas": route_pallas}


def route(scores_TE: jax.Array, bias_E: jax.Array, n_active: int, normalize: bool, route_scale: float,
          valid_T: jax.Array | None = None, *, impl: str = "reference") -> tuple[jax.Array, jax.Array]:
    """The router's selection by the implementation ``impl`` (one of IMPLS): ``route_reference``'s contract."""
    if impl not in _IMPLEMENTATIONS:
        raise ValueError(f"router impl must be one of {IMPLS}, got {impl!r}")
    return _IMPLEMENTATIONS[impl](scores_TE, bias_E, n_active, normalize, route_scale, valid_T)
