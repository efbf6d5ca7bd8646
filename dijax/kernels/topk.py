"""Exact top-k over the last axis: ``jax.lax.top_k`` (the reference) and threshold selection in XLA and in Pallas.

``lax.top_k`` with k > 16 is a full sort on GPU, while the indexer needs the top 512 of up to ~260k compressed
positions per token. ``topk_select`` finds the k-th largest value instead, then takes every value above it plus the
lowest-index ties at it, and returns exactly what ``lax.top_k`` returns, ties and order included:

* **Order.** ``lax.top_k`` orders floats by their total order (-NaN < -inf < ... < -0.0 < +0.0 < ... < +inf <
  +NaN): it is a stable sort, so among equal values the lower index comes first. Flipping the float bits to an
  unsigned integer key (all bits for negatives, the sign bit for the rest) preserves exactly that order, so the
  select works on integer keys and inherits the same rule.
* **Threshold.** The k-th largest key is found by a radix descent from the top bit, ``RADIX_BITS`` bits per pass:
  each pass counts the keys at or above each candidate digit and keeps the largest digit whose count still reaches
  k. Only counts are needed, no histogram scatter. (``largest_reaching``; the sampler's top-k / top-p filter runs
  it too, top-p with probability mass in place of counts.)
* **Chunk prefilter** (long rows of a large array). The top k chunk maxima, ties to the lower chunk, hold the
  whole answer: every value above the threshold lies in a chunk whose maximum is above it, and the lowest-index
  ties at it lie in the lowest-index chunks whose maximum equals it, which precede any dropped chunk of that
  maximum. So a row of P values shrinks to k * CHUNK candidates, kept in position order so that "lowest candidate
  index" still means "lowest position".
* **Compaction.** A cumulative count of the selected keys gives each its output slot; a binary search over that
  count finds the position of every slot (no scatter). The k picks, in position order, are then stably sorted by
  descending key, which is ``lax.top_k``'s order.

``topk_pallas`` runs the same selection as two Triton-lowered kernels instead of ~40 XLA launches (the radix
passes, the prefilter, the compaction, the sort): a grid-wide chunk-maximum pass, then one program per row that
holds its chunk maxima and then its candidates in registers. Triton has no sort, so it differs in three places:
signed int32 keys (the unsigned key shifted by 2^31) with a bitwise descent of counts, compaction by a cumulative
count and a scatter to per-row scratch (read back after a CTA barrier), and the final order as ranks (a pick's
rank is the number of picks above it plus the equal ones at lower positions) instead of a sort.

How dijax uses it (``model/attention.py``): ``topk_positions`` takes the picks in position order
(``topk_ascending``: the select and the kernel stop before their last stage, so no sort) and keeps the visible
ones, which is the reference's per-row ``k = min(index_topk, end // ratio)`` rank limit (its docstring says why);
``select_candidate_blocks`` keeps the picked blocks whose maximum is above -inf. Both see identical inputs from
every implementation.

Letters: R rows (all leading axes flattened), P values per row, N = k picks, C chunk length, M chunks; in the
kernel L the lanes of a program's vector and J a tile of picks.
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

RADIX_BITS = 4
CHUNK = 32
# The prefilter's extra select stage costs a fixed ~0.15 ms of kernel launches on an H200; it pays once a row holds
# at least PREFILTER_FACTOR times the k * CHUNK candidates it keeps and the array is large (at k = 512 of 262,144:
# 0.14 ms without it and 0.36 ms with it for one row, 1.0 ms without and 0.29 ms with for 64 rows).
PREFILTER_FACTOR = 4
PREFILTER_MIN_VALUES = 1 << 22
# Below this many values per row "select" hands the row to lax.top_k (the same result): a short row's sort is one
# kernel, while the radix descent is ~80 small kernels (counted in the tiny model's GPU step, where they were 80
# of its 680 kernels: tools/hlo_kernels.py). The select measured faster at 262,144 values for 1, 4 and 64 rows.
SELECT_MIN_VALUES = 1 << 16
IMPLS = ("reference", "select", "pallas")


def topk_reference(score: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k`` over the last axis: (values [..., k] score.dtype, indices [..., k] int32).

    Values descend in the float total order; equal values come lower index first.
    """
    return jax.lax.top_k(score, k)


def order_key(score: jax.Array) -> jax.Array:
    """uint32 keys whose unsigned order is the float total order of ``score`` (any float dtype)."""
    bits = jax.lax.bitcast_convert_type(score.astype(jnp.float32), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | np.uint32(1 << 31))


def _reach(key_RP: jax.Array, cand_RD: jax.Array, weight_RP: jax.Array | None, digits_major: bool) -> jax.Array:
    """The count (``weight_RP`` None) or weight of the keys at or above each candidate: [R, D]. The digits are the
    compare's innermost axis (the lanes comparing one key against every digit share its load) or, with
    ``digits_major``, the axis before the keys (a row reduction a digit): the same sums, laid out differently."""
    above = key_RP[:, None, :] >= cand_RD[:, :, None] if digits_major else key_RP[:, :, None] >= cand_RD[:, None, :]
    axis = 2 if digits_major else 1
    if weight_RP is None:
        return jnp.sum(above.astype(jnp.int32), axis=axis)
    return jnp.sum(jnp.where(above, jnp.expand_dims(weight_RP, 3 - axis), 0), axis=axis)


def largest_reaching(key_RP: jax.Array, target_R: jax.Array | int, weight_RP: jax.Array | None = None,
                     bits: int | None = None, digits_major: bool = False) -> jax.Array:
    """Per row, the largest key t whose keys at or above it reach ``target``: ``count(key >= t) >= target``, or
    with ``weight_RP`` (>= 0) ``sum(weight[key >= t]) >= target``. uint32 [R]; 0 when even every key together
    falls short. A radix descent from the top bit, ``bits`` (1, 2, 4 or 8; None: ``RADIX_BITS``) a pass: each
    pass measures the keys at or above every candidate digit (``_reach``, whose layout ``digits_major`` picks) and
    keeps the largest digit that still reaches. With counts the answer is the target-th largest key (with
    multiplicity); either way it is a key of the row unless the row falls short.

    key_RP uint32 [R, P]; target_R a scalar or [R] (int for counts, float for weights)."""
    bits = RADIX_BITS if bits is None else bits
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"largest_reaching: bits must be 1, 2, 4 or 8, got {bits}")
    target_R = jnp.broadcast_to(jnp.asarray(target_R), key_RP.shape[:1])
    prefix_R = jnp.zeros(key_RP.shape[:1], jnp.uint32)
    digit_D = jnp.arange(1, 1 << bits, dtype=jnp.uint32)
    for shift in range(32 - bits, -1, -bits):
        reach_RD = _reach(key_RP, prefix_R[:, None] | (digit_D << shift)[None, :], weight_RP, digits_major)
        # the largest digit that reaches; digit 0 is the prefix itself. (The reach falls as the digit grows;
        # taking the largest qualifying digit, not counting them, does not lean on float sums being monotone.)
        digit_R = jnp.max(jnp.where(reach_RD >= target_R[:, None], digit_D[None, :], 0), axis=-1)
        prefix_R = prefix_R | (digit_R << shift)
    return prefix_R


def _first_reaching(cum_RP: jax.Array, target_RN: jax.Array) -> jax.Array:
    """Per row, the first index whose non-decreasing ``cum_RP`` exceeds each target: int32 [R, N]."""
    width = cum_RP.shape[1]
    lo = jnp.zeros(target_RN.shape, jnp.int32)
    hi = jnp.full(target_RN.shape, width, jnp.int32)
    for _ in range(max(1, int(np.ceil(np.log2(width + 1))))):
        mid = (lo + hi) // 2
        above = jnp.take_along_axis(cum_RP, jnp.minimum(mid, width - 1), axis=1) > target_RN
        hi = jnp.where(above, mid, hi)
        lo = jnp.where(above, lo, mid + 1)
    return lo


def _select_ascending(key_RP: jax.Array, k: int) -> jax.Array:
    """Indices of the k largest keys per row, ties to the lower index, in ascending index order: int32 [R, k]."""
    thr_R = largest_reaching(key_RP, k)[:, None]
    above = key_RP > thr_R
    at = key_RP == thr_R
    need_R = k - jnp.sum(above.astype(jnp.int32), axis=1, keepdims=True)
    take = above | (at & (jnp.cumsum(at.astype(jnp.int32), axis=1) <= need_R))
    cum_RP = jnp.cumsum(take.astype(jnp.int32), axis=1)
    return _first_reaching(cum_RP, jnp.arange(k, dtype=jnp.int32)[None, :])


def _select_positions(key_RP: jax.Array, k: int) -> jax.Array:
    """The exact top-k set in ascending position order, through the chunk prefilter on long rows: int32 [R, k]."""
    rows, width = key_RP.shape
    if width < PREFILTER_FACTOR * k * CHUNK or rows * width < PREFILTER_MIN_VALUES:
        return _select_ascending(key_RP, k)
    chunks = -(-width // CHUNK)
    # padding takes the lowest key at the highest indices, so it never wins a tie against a real value
    padded = jnp.pad(key_RP, ((0, 0), (0, chunks * CHUNK - width)))
    key_RMC = padded.reshape(rows, chunks, CHUNK)
    chunk_RN = _select_ascending(jnp.max(key_RMC, axis=-1), k)
    cand_RNC = jnp.take_along_axis(key_RMC, chunk_RN[:, :, None], axis=1)
    pick_RN = _select_ascending(cand_RNC.reshape(rows, k * CHUNK), k)
    return jnp.take_along_axis(chunk_RN, pick_RN // CHUNK, axis=1) * CHUNK + pick_RN % CHUNK


def topk_select(score: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Exact top-k by threshold selection, identical to ``topk_reference`` (values, order and ties).

    score: float array [..., P] with P >= k. Returns (values [..., k] score.dtype, indices [..., k] int32).
    """
    pos = topk_select_ascending(score, k)
    lead = score.shape[:-1]
    if k == 0 or pos.size == 0:
        return jnp.zeros((*lead, k), score.dtype), pos
    score_RP, pos_RN = score.reshape(-1, score.shape[-1]), pos.reshape(-1, k)
    # a stable sort of the position-ordered picks on the descending key restores lax.top_k's order
    desc_RN = ~order_key(jnp.take_along_axis(score_RP, pos_RN, axis=1))
    _, pos_RN = jax.lax.sort((desc_RN, pos_RN), dimension=1, is_stable=True, num_keys=1)
    values_RN = jnp.take_along_axis(score_RP, pos_RN, axis=1)
    return values_RN.reshape(*lead, k), pos_RN.reshape(*lead, k)


def topk_select_ascending(score: jax.Array, k: int) -> jax.Array:
    """The indices ``topk_select`` picks, in ascending index order (its selection without the final sort):
    int32 [..., k]."""
    if not jnp.issubdtype(score.dtype, jnp.floating):
        raise TypeError(f"topk_select: score must be a float array, got dtype {score.dtype}")
    if not 0 <= k <= score.shape[-1]:
        raise ValueError(f"topk: k must be in [0, {score.shape[-1]}] (the last axis of score), got {k}")
    lead = score.shape[:-1]
    score_RP = score.reshape(-1, score.shape[-1])
    if k == 0 or score_RP.shape[0] == 0:
        return jnp.zeros((*lead, k), jnp.int32)
    return _select_positions(order_key(score_RP), k).reshape(*lead, k)


INT32_MIN = np.int32(-(1 << 31))
_LOW_BITS = np.int32(0x7FFFFFFF)


@dataclass(frozen=True)
class TopkConfig:
    """Tiling of ``topk_pallas``.

    chunk: values per chunk of the prefilter (a power of two); None takes the one that needs the fewest lanes
    (``chunk_length``). max_lanes: the most keys the select program holds at once (the row's chunk maxima, and the
    chosen chunks' values); a shape that needs more is not supported (``topk_pallas_supports``). block_values:
    values per program of the chunk-maximum pass. rank_tile: picks compared per step of the final ordering.
    max_warps / select_warps: Triton warps of the two kernels. The defaults are reasoned, not yet measured
    (``tools/bench_kernels.py --only topk --sweep`` times the alternatives).
    """

    chunk: int | None = None
    max_lanes: int = 1 << 14
    block_values: int = 4096
    rank_tile: int = 32
    max_warps: int = 4
    select_warps: int = 8


def _power_of_two(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def chunk_length(width: int, k: int, config: TopkConfig) -> int | None:
    """The prefilter's chunk length for rows of ``width`` values and ``k`` picks, or None when no power of two
    keeps both the chunk maxima (``ceil(width / chunk)``) and the candidates (``k * chunk``), each padded to a power
    of two, within ``config.max_lanes``. Without ``config.chunk``: the one with the fewest lanes, the shorter on a
    tie."""
    slots = pl.next_power_of_2(k)

    def lanes(chunk: int) -> tuple[int, int]:
        return pl.next_power_of_2(-(-width // chunk)), slots * chunk

    if config.chunk is not None:
        return config.chunk if max(lanes(config.chunk)) <= config.max_lanes else None
    fits = [c for c in (1 << e for e in range(31)) if max(lanes(c)) <= config.max_lanes]
    return min(fits, key=lambda c: sum(lanes(c))) if fits else None


def _offsets_fit(rows: int, width: int, k: int, chunk: int) -> bool:
    """Whether every array of ``topk_pallas`` (scores, chunk maxima, scratch) has fewer than 2^31 elements (Triton's
    int32 offsets)."""
    return rows * max(width, pl.next_power_of_2(-(-width // chunk)), pl.next_power_of_2(k)) < 2 ** 31


def topk_pallas_supports(shape: tuple[int, ...], k: int, config: TopkConfig | None = None) -> bool:
    """Whether ``topk_pallas`` takes a score array of ``shape`` [..., P] with ``k`` picks, 0 < k <= P: a chunk
    length fits the lanes (``chunk_length``) and the int32 offsets fit."""
    rows, width = int(np.prod(shape[:-1])), shape[-1]
    if not 0 < k <= width:
        return False
    chunk = chunk_length(width, k, config or TopkConfig())
    return chunk is not None and _offsets_fit(rows, width, k, chunk)


def signed_key(x: jax.Array) -> jax.Array:
    """int32 keys whose signed order is the float total order of float32 ``x`` (``order_key`` shifted by 2^31:
    the low 31 bits of negatives flipped). Its own inverse on the bits (``_float_of_key``)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ _LOW_BITS, bits)


def _float_of_key(key: jax.Array) -> jax.Array:
    """The float32 whose ``signed_key`` is ``key`` (bit for bit, NaN payloads included)."""
    return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ _LOW_BITS, key), jnp.float32)


def _kth_largest_lanes(key_L: jax.Array, k: int) -> jax.Array:
    """The k-th largest of int32 keys [L] with multiplicity (INT32_MIN when fewer than k lanes), a scalar.

    Bit by bit from the top: the sign first (are k keys >= 0?), then each lower bit is kept when k keys still reach
    the prefix with it set. Only counts (compares and a sum), which every Triton reduction lowers.
    """
    def count_at_least(cand):
        return jnp.sum((key_L >= cand).astype(jnp.int32))

    def step(b, prefix):
        cand = prefix | jnp.left_shift(np.int32(1), 30 - b)
        return jnp.where(count_at_least(cand) >= k, cand, prefix)

    prefix = jnp.where(count_at_least(np.int32(0)) >= k, np.int32(0), INT32_MIN)
    return jax.lax.fori_loop(0, 31, step, prefix)


def _take_lanes(key_L: jax.Array, k: int) -> jax.Array:
    """The k largest keys [L] (all lanes when fewer), ties at the k-th to the lowest lanes: bool [L]."""
    thr = _kth_largest_lanes(key_L, k)
    above_L, at_L = key_L > thr, key_L == thr
    need = k - jnp.sum(above_L.astype(jnp.int32))
    return above_L | (at_L & (jnp.cumsum(at_L.astype(jnp.int32)) <= need))


def _store_compacted(ref, row, take_L: jax.Array, value_L: jax.Array) -> None:
    """Write the taken lanes' values to ``ref[row, 0..]`` in lane order (slot = taken lanes before it)."""
    lane_L = jnp.arange(take_L.shape[0], dtype=jnp.int32)
    slot_L = jnp.cumsum(take_L.astype(jnp.int32)) - 1
    # untaken lanes keep distinct out-of-range slots: interpret mode drops those writes, where a clamped or
    # duplicate slot could overwrite a taken one
    pltriton.store(ref.at[row, jnp.where(take_L, slot_L, ref.shape[1] + lane_L)], value_L, mask=take_L)


def _chunk_max_kernel(score_ref, max_ref, *, width: int, chunk: int, block_m: int):
    """Program (r, b): the maximum key of chunks [b * block_m, (b + 1) * block_m) of row r (INT32_MIN past the row).
    """
    r, m0 = pl.program_id(0), pl.program_id(1) * block_m
    pos_MC = (m0 + jnp.arange(block_m, dtype=jnp.int32))[:, None] * chunk + jnp.arange(chunk, dtype=jnp.int32)[None]
    live_MC = pos_MC < width
    x_MC = pltriton.load(score_ref.at[r, pos_MC], mask=live_MC, other=0.0)
    key_MC = jnp.where(live_MC, signed_key(x_MC), INT32_MIN)
    max_ref[r, pl.ds(m0, block_m)] = jnp.max(key_MC, axis=1)


def _select_kernel(score_ref, max_ref, *out_refs, k: int, width: int, chunk: int, lanes_m: int, slots: int,
                   rank_tile: int, barrier: bool, ranked: bool):
    """Program r: the top k of row r. ``out_refs``: with ``ranked``, (value_ref, index_ref [R, k], chunk_ref,
    key_ref, pos_ref [R, slots]), the picks in ``lax.top_k``'s order; without, (chunk_ref, pos_ref), the picks in
    ascending position order in ``pos_ref[r, :k]``. The [R, slots] refs are this row's scratch (written, then read
    back by other threads after a CTA barrier: ``barrier``, off in interpret mode)."""
    if ranked:
        value_ref, index_ref, chunk_ref, key_ref, pos_ref = out_refs
    else:
        chunk_ref, pos_ref = out_refs
    r = pl.program_id(0)
    # level 1: the top-k chunks by maximum, ties to the lower chunk, in chunk order
    max_M = max_ref[r, pl.ds(0, lanes_m)]
    _store_compacted(chunk_ref, r, _take_lanes(max_M, k), jnp.arange(lanes_m, dtype=jnp.int32))
    if barrier:
        pltriton.debug_barrier()
    # level 2: the top k of the chosen chunks' values; lanes in chunk order are in position order, and the padding
    # (lowest key) comes after every real value, so it never wins a tie
    lane_L = jnp.arange(slots * chunk, dtype=jnp.int32)
    slot_L = lane_L // chunk
    has_L = slot_L < min(k, lanes_m)
    pos_L = pltriton.load(chunk_ref.at[r, slot_L], mask=has_L, other=0) * chunk + lane_L % chunk
    live_L = has_L & (pos_L < width)
    key_L = jnp.where(live_L, signed_key(pltriton.load(score_ref.at[r, pos_L], mask=live_L, other=0.0)), INT32_MIN)
    take_L = _take_lanes(key_L, k)
    _store_compacted(pos_ref, r, take_L, pos_L)
    if not ranked:
        return
    _store_compacted(key_ref, r, take_L, key_L)
    if barrier:
        pltriton.debug_barrier()
    # order: a pick's rank is the picks above it plus the equal ones at lower positions (stable, descending)
    i_N = jnp.arange(slots, dtype=jnp.int32)
    live_N = i_N < k
    key_N = pltriton.load(key_ref.at[r, pl.ds(0, slots)], mask=live_N, other=INT32_MIN)
    pos_N = pltriton.load(pos_ref.at[r, pl.ds(0, slots)], mask=live_N, other=0)

    def count_before(t, rank_N):
        j0 = t * rank_tile
        j_J = j0 + jnp.arange(rank_tile, dtype=jnp.int32)
        # lanes past k read INT32_MIN: never above a pick, and a tie needs j < i < k
        key_J = pltriton.load(key_ref.at[r, pl.ds(j0, rank_tile)], mask=j_J < k, other=INT32_MIN)
        before_NJ = (key_J[None, :] > key_N[:, None]) | ((key_J[None, :] == key_N[:, None])
                                                          & (j_J[None, :] < i_N[:, None]))
        return rank_N + jnp.sum(before_NJ.astype(jnp.int32), axis=1)

    rank_N = jax.lax.fori_loop(0, slots // rank_tile, count_before, jnp.zeros((slots,), jnp.int32))
    out_N = jnp.where(live_N, rank_N, k + i_N)
    pltriton.store(index_ref.at[r, out_N], pos_N, mask=live_N)
    pltriton.store(value_ref.at[r, out_N], _float_of_key(key_N), mask=live_N)


def topk_pallas(score: jax.Array, k: int, *, config: TopkConfig | None = None,
                interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Exact top-k in two Triton-lowered kernels, identical to ``topk_reference`` (values, order and ties).

    score: float32 / bfloat16 / float16 [..., P] with 0 <= k <= P and ``topk_pallas_supports(score.shape, k)``. Returns
    (values [..., k] score.dtype, indices [..., k] int32).

    The selection of ``topk_select`` (module docstring) on int32 keys whose signed order is the float total order:
      1. ``topk_chunk_max``, grid (R, chunk blocks): the maximum key of every ``chunk`` values;
      2. ``topk_select``, one program per row: the k-th largest chunk maximum (a 32-step bitwise descent of
         counts), the top-k chunks (ties to the lower chunk) compacted in chunk order by a cumulative count and a
         scatter; their values gathered ([k * chunk] lanes, in position order), the k-th largest of those and the
         top k (ties to the lower position), compacted the same way; then each pick's rank in the descending
         stable order (picks above it plus equal ones at lower positions, [k, rank_tile] compares per step) and
         a scatter of the values and indices to their ranks.
    No sort: Triton has none. The compactions round-trip through per-row scratch outputs and a CTA barrier.
    config: tiling (default ``TopkConfig()``); interpret: run in the Pallas interpreter (default: off a GPU).
    """
    lead = score.shape[:-1]
    outs = _select_call(score, k, config, interpret, ranked=True)
    if outs is None:
        return jnp.zeros((*lead, k), score.dtype), jnp.zeros((*lead, k), jnp.int32)
    values_RN, index_RN, *_ = outs
    if score.dtype != jnp.float32:  # the values in their own dtype (and NaN payloads): gathered, not rounded
        values_RN = jnp.take_along_axis(score.reshape(-1, score.shape[-1]), index_RN, axis=1)
    return values_RN.reshape(*lead, k), index_RN.reshape(*lead, k)


def topk_pallas_ascending(score: jax.Array, k: int, *, config: TopkConfig | None = None,
                          interpret: bool | None = None) -> jax.Array:
    """The indices ``topk_pallas`` picks, in ascending index order: int32 [..., k]. Its two kernels without the
    ranking stage: the second compaction already leaves the picks in position order (module docstring)."""
    lead = score.shape[:-1]
    outs = _select_call(score, k, config, interpret, ranked=False)
    if outs is None:
        return jnp.zeros((*lead, k), jnp.int32)
    return outs[1][:, :k].reshape(*lead, k)


def _select_call(score: jax.Array, k: int, config: TopkConfig | None, interpret: bool | None,
                 ranked: bool) -> list[jax.Array] | None:
    """The two kernels on score [..., P], rows flattened -> ``_select_kernel``'s outputs: with ``ranked`` (values
    [R, k] float32, indices [R, k], scratch x 3), else (chunk scratch, the picks in position order [R, slots]).
    None when there is nothing to select (k = 0 or no row), after the same argument checks."""
    config = config or TopkConfig()
    if score.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise TypeError(f"topk_pallas: score must be float32, bfloat16 or float16, got dtype {score.dtype}")
    width = score.shape[-1]
    if not 0 <= k <= width:
        raise ValueError(f"topk: k must be in [0, {width}] (the last axis of score), got {k}")
    sizes = {"max_lanes": config.max_lanes, "block_values": config.block_values, "rank_tile": config.rank_tile}
    if config.chunk is not None:
        sizes["chunk"] = config.chunk
    for field, value in sizes.items():
        if not _power_of_two(value):
            raise ValueError(f"topk_pallas: config.{field}={value!r} must be a power of two")
    score_RP = score.reshape(-1, width)
    rows = score_RP.shape[0]
    if k == 0 or rows == 0:
        return None
    chunk = chunk_length(width, k, config)
    if chunk is None:
        raise ValueError(f"topk_pallas: no chunk length keeps P={width} values and k={k} picks within "
                         f"config.max_lanes={config.max_lanes} (config.chunk={config.chunk}); see "
                         f"topk_pallas_supports")
    lanes_m, slots = pl.next_power_of_2(-(-width // chunk)), pl.next_power_of_2(k)
    if not _offsets_fit(rows, width, k, chunk):
        raise ValueError(f"topk_pallas: {rows} rows of {width} values need int32 offsets past 2^31")
    interpret = interpret_mode(interpret)
    x_RP = score_RP.astype(jnp.float32)
    block_m = min(lanes_m, max(1, config.block_values // chunk))
    max_RM = pl.pallas_call(
        functools.partial(_chunk_max_kernel, width=width, chunk=chunk, block_m=block_m),
        grid=(rows, lanes_m // block_m),
        out_shape=jax.ShapeDtypeStruct((rows, lanes_m), jnp.int32),
        compiler_params=pltriton.CompilerParams(num_warps=config.max_warps, num_stages=1),
        interpret=interpret,
        name="topk_chunk_max",
    )(x_RP)
    scratch = jax.ShapeDtypeStruct((rows, slots), jnp.int32)
    picks = [jax.ShapeDtypeStruct((rows, k), jnp.float32), jax.ShapeDtypeStruct((rows, k), jnp.int32)]
    kernel = functools.partial(_select_kernel, k=k, width=width, chunk=chunk, lanes_m=lanes_m, slots=slots,
                               rank_tile=min(config.rank_tile, slots), barrier=not interpret, ranked=ranked)
    return pl.pallas_call(
        kernel,
        grid=(rows,),
        out_shape=picks + [scratch] * 3 if ranked else [scratch] * 2,
        compiler_params=pltriton.CompilerParams(num_warps=config.select_warps, num_stages=1),
        interpret=interpret,
        name="topk_select" if ranked else "topk_select_ascending",
    )(x_RP, max_RM)


def topk_ascending(score: jax.Array, k: int, *, impl: str = "reference") -> jax.Array:
    """The indices ``lax.top_k`` picks (the same set, ties to the lower index), in ascending index order: int32
    [..., k]. score: float [..., P]; k: static int <= P.

    impl: "reference" sorts ``lax.top_k``'s indices; "select" (``topk_select_ascending``, rows of at least
    ``SELECT_MIN_VALUES`` values: shorter rows take the reference) and "pallas" (``topk_pallas_ascending``, every
    shape the kernel takes, else the select) stop before their last stage instead, whose picks are already in
    position order: no sort. k = P takes every index, without a selection. The kernel takes short rows too: on the
    H200 it was as fast as ``lax.top_k`` and a sort at 1-64 rows of 4096 and 3.6x faster at a prefill's 8192 rows of
    2048, where the select's ~40 launches lose to the sort below ~65,536 values a row (twenty-third session).
    """
    if impl not in IMPLS:
        raise ValueError(f"topk: impl must be one of {IMPLS}, got {impl!r}")
    if k == score.shape[-1]:  # every index
        return jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), score.shape)
    if impl == "pallas" and topk_pallas_supports(score.shape, k):
        return topk_pallas_ascending(score, k)
    if impl == "reference" or score.shape[-1] < SELECT_MIN_VALUES:
        return jnp.sort(topk_reference(score, k)[1], axis=-1)
    return topk_select_ascending(score, k)
