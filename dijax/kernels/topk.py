"""Exact top-k over the last axis: ``jax.lax.top_k`` (the reference) and a threshold-selection version.

``lax.top_k`` with k > 16 is a full sort on GPU, while the indexer needs the top 512 of up to ~260k compressed
positions per token. ``topk_select`` finds the k-th largest value instead, then takes every value above it plus the
lowest-index ties at it, and returns exactly what ``lax.top_k`` returns, ties and order included:

* **Order.** ``lax.top_k`` orders floats by their total order (-NaN < -inf < ... < -0.0 < +0.0 < ... < +inf <
  +NaN): it is a stable sort, so among equal values the lower index comes first. Flipping the float bits to an
  unsigned integer key (all bits for negatives, the sign bit for the rest) preserves exactly that order, so the
  select works on integer keys and inherits the same rule.
* **Threshold.** The k-th largest key is found by a radix descent from the top bit, ``RADIX_BITS`` bits per pass:
  each pass counts the keys at or above each candidate digit and keeps the largest digit whose count still reaches
  k. Only counts are needed, no histogram scatter.
* **Chunk prefilter** (long rows of a large array). The top k chunk maxima, ties to the lower chunk, hold the
  whole answer: every value above the threshold lies in a chunk whose maximum is above it, and the lowest-index
  ties at it lie in the lowest-index chunks whose maximum equals it, which precede any dropped chunk of that
  maximum. So a row of P values shrinks to k * CHUNK candidates, kept in position order so that "lowest candidate
  index" still means "lowest position".
* **Compaction.** A cumulative count of the selected keys gives each its output slot; a binary search over that
  count finds the position of every slot (no scatter). The k picks, in position order, are then stably sorted by
  descending key, which is ``lax.top_k``'s order.

How dijax uses it (``model/attention.py``): ``topk_positions`` keeps the picks whose rank is below a per-row limit
(rank = place in this order, so a limit below k keeps the lowest-index ties, as the reference's per-row
``k = min(index_topk, end // ratio)``) and re-sorts them by position; ``select_candidate_blocks`` keeps the picked
blocks whose maximum is above -inf. Both see identical inputs from either implementation.

Letters: R rows (all leading axes flattened), P values per row, N = k picks, C chunk length, M chunks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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
IMPLS = ("reference", "select")


def topk_reference(score: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k`` over the last axis: (values [..., k] score.dtype, indices [..., k] int32).

    Values descend in the float total order; equal values come lower index first.
    """
    return jax.lax.top_k(score, k)


def _order_key(score: jax.Array) -> jax.Array:
    """uint32 keys whose unsigned order is the float total order of ``score`` (any float dtype)."""
    bits = jax.lax.bitcast_convert_type(score.astype(jnp.float32), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | np.uint32(1 << 31))


def _kth_largest(key_RP: jax.Array, k: int) -> jax.Array:
    """The k-th largest key of each row (with multiplicity): uint32 [R]."""
    digits = 1 << RADIX_BITS
    prefix_R = jnp.zeros(key_RP.shape[:1], jnp.uint32)
    for shift in range(32 - RADIX_BITS, -1, -RADIX_BITS):
        step = jnp.arange(1, digits, dtype=jnp.uint32) << shift
        cand_RD = prefix_R[:, None] | step[None, :]
        # digits innermost: the lanes comparing one key against every digit share its load
        count_RD = jnp.sum((key_RP[:, :, None] >= cand_RD[:, None, :]).astype(jnp.int32), axis=1)
        # counts fall as the digit grows; digit 0 always qualifies (the prefix already reaches k keys)
        digit_R = jnp.sum((count_RD >= k).astype(jnp.uint32), axis=-1)
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
    thr_R = _kth_largest(key_RP, k)[:, None]
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
    if not jnp.issubdtype(score.dtype, jnp.floating):
        raise TypeError(f"topk_select: score must be a float array, got dtype {score.dtype}")
    if not 0 <= k <= score.shape[-1]:
        raise ValueError(f"topk: k must be in [0, {score.shape[-1]}] (the last axis of score), got {k}")
    lead = score.shape[:-1]
    score_RP = score.reshape(-1, score.shape[-1])
    if k == 0 or score_RP.shape[0] == 0:
        return (jnp.zeros((*lead, k), score.dtype), jnp.zeros((*lead, k), jnp.int32))
    key_RP = _order_key(score_RP)
    pos_RN = _select_positions(key_RP, k)
    # picks arrive in position order; a stable sort on the descending key restores lax.top_k's order
    desc_RN = ~jnp.take_along_axis(key_RP, pos_RN, axis=1)
    _, pos_RN = jax.lax.sort((desc_RN, pos_RN), dimension=1, is_stable=True, num_keys=1)
    values_RN = jnp.take_along_axis(score_RP, pos_RN, axis=1)
    return values_RN.reshape(*lead, k), pos_RN.reshape(*lead, k)


def topk(score: jax.Array, k: int, *, impl: str = "reference") -> tuple[jax.Array, jax.Array]:
    """Top-k over the last axis with the chosen implementation; every one returns ``lax.top_k``'s result.

    score: float [..., P]; k: static int <= P; impl: "reference" (``lax.top_k``) or "select" (threshold
    selection for rows of at least ``SELECT_MIN_VALUES`` values, ``lax.top_k`` for shorter ones). Returns
    (values [..., k] score.dtype, indices [..., k] int32), values descending, ties lower index first.
    """
    if impl == "reference":
        return topk_reference(score, k)
    if impl == "select":
        return topk_select(score, k) if score.shape[-1] >= SELECT_MIN_VALUES else topk_reference(score, k)
    raise ValueError(f"topk: impl must be one of {IMPLS}, got {impl!r}")
