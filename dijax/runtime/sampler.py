"""Sampling on device: greedy, temperature, top-k, top-p, with noise keyed only by (request seed, output position).

The noise of a row is ``gumbel(fold_in(fold_in(key(seed_lo), seed_hi), position))`` with the full 64-bit seed split
into two uint32 halves: it does not depend on the batch row, the batch size or any global RNG history, so a
recomputed (preempted) request draws the same tokens (DESIGN.md promise 3), and seeds differing in any bit draw
different noise.

A step samples in one of three modes (``MODES``), picked on the host from its rows' SamplingParams
(``sampling_mode``) and carried to the device as data (``StepSampling.packed_7R``'s last row): the engine's model
step samples its own logits (``sample_packed``), so one executable serves every mode. It computes every mode's
tokens and selects one by the mode, with no control flow: on the GPU XLA sorts a vocabulary as large as
V4.1-Flash's with a CUB radix sort, which cannot be recorded into the step's CUDA graph, so a ``lax.switch`` around
the sort ran on the host, reading its predicate back mid-step (H200, flash-slice: the step's launch blocked for the
device's whole forward, 1.2 ms a step slower back to back; docs/benchmarks.md, sixteenth session). The mode still
says what a step needs: a greedy step's tokens are the argmax, whatever else was computed.

* ``greedy``: every row has temperature 0 (a step that samples no row included): each row's argmax, with no sort,
  no softmax and no noise.
* ``temperature``: no sampled row filters (top_k 0, top_p 1): the Gumbel argmax of the scaled logits, with no
  sort. top_k 0 and top_p 1 are exact no-ops in ``sample`` (both ``FILTERS``), so a row draws the same token in
  both.
* ``sample``: top-k, then top-p, by thresholds: one descending sort per row serves both (``_filter_sort_row``),
  or, from ``SELECT_MIN_ROWS`` rows up, radix descents over the rows' order keys find them with no sort
  (``_filter_by_thresholds``: a CUB sort of 64 rows of V4.1's vocabulary took 1.0 ms on an H100,
  docs/benchmarks.md).

A temperature-0 row takes the same argmax in every mode, so a row's token never depends on the mode its step took.

Letters: R rows to sample, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dijax.kernels import interpret_mode, sample_filter

MODES = ("greedy", "temperature", "sample")


def _argmax(logits_xV: jax.Array) -> jax.Array:
    """int32 argmax over the last (vocab) axis; the lowest index wins ties."""
    return jnp.argmax(logits_xV, axis=-1).astype(jnp.int32)


def _filter_sort_row(scaled_V: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """One row's ``scaled_V`` with the entries top-k, then top-p, drop set to -inf, by one descending sort of the
    row. top_k 0 and top_p >= 1 leave it exactly as it was (the float32 cumulative sum of a large vocabulary can
    reach 1 before its tail: top_p >= 1 does not read it)."""
    # one descending sort serves both filters: masking the values below the k-th of a sorted row leaves it sorted
    ordered_V = jnp.sort(scaled_V)[::-1]
    kth = ordered_V[jnp.clip(top_k - 1, 0, scaled_V.shape[0] - 1)]
    cut_k = top_k > 0
    scaled_V = jnp.where(cut_k & (scaled_V < kth), -jnp.inf, scaled_V)
    ordered_V = jnp.where(cut_k & (ordered_V < kth), -jnp.inf, ordered_V)
    probs_V = jax.nn.softmax(ordered_V)
    # keep the smallest prefix whose mass reaches top_p; the first token always stays (a top_p that rounds to 0
    # in float32 still samples the most likely token)
    first_V = jnp.arange(ordered_V.shape[0]) == 0
    keep_V = ((jnp.cumsum(probs_V) - probs_V) < top_p) | first_V | (top_p >= 1)
    threshold = jnp.min(jnp.where(keep_V, ordered_V, jnp.inf))
    return jnp.where(scaled_V < threshold, -jnp.inf, scaled_V)


def _filter_by_thresholds(scaled_RV: jax.Array, top_k_R: jax.Array, top_p_R: jax.Array, *, impl: str
                          ) -> jax.Array:
    """``_filter_sort_row`` on every row without a sort: the thresholds by radix descents over the rows' order keys
    (``dijax.kernels.sample_filter``, in XLA or the kernel by ``impl``). The top-k threshold is the k-th largest
    value; the top-p one is the largest value whose own mass and everything above it reach top_p, which is the
    smallest value the sorted rule keeps (a value stays when the mass strictly above it is below top_p). The same
    rule, with the mass summed in another order: the two forms can differ only where a mass lands within float32
    rounding of top_p."""
    threshold_R = sample_filter.thresholds(scaled_RV, top_k_R, top_p_R, impl=impl)
    return jnp.where(sample_filter.filter_keys(scaled_RV) < threshold_R[:, None], -jnp.inf, scaled_RV)


# the ``sample`` mode's top-k / top-p filters, each (scaled_RV, top_k_R, top_p_R) -> scaled_RV with the dropped
# entries at -inf: a sort of each row, the thresholds' radix descents in XLA, or the same in one Triton-lowered
# program a row (dijax/kernels/sample_filter.py)
FILTERS = {"sort": jax.vmap(_filter_sort_row),
           "select": partial(_filter_by_thresholds, impl="reference"),
           "pallas": partial(_filter_by_thresholds, impl="pallas")}
# ``sample``'s "auto" filter by a step's rows (``auto_filter``): the sort below SELECT_MIN_ROWS rows, the XLA select
# from there, and on a GPU MANY_ROWS_FILTER from MANY_ROWS. Thirty-seventh session, H100 (docs/benchmarks.md), the
# sample mode at 1 / 16 / 64 rows: with the sort 78 / 557 / 1186 us, with the select 90 / 247 / 953 (4-bit digits
# innermost), - / 265 / 781 (2-bit digits before the keys, sample_filter.DESCENT). Fortieth session, H100, by GPU
# kernel time: sort 78 / 560 / 1191, select 144 / 266 / 1416, the thresholds kernel 542 / 615 / 682; flash-slice
# decode back to back with the kernel at B=64 18.9 ms against the select's 19.6 (two rounds), at B=16 8.6 against 8.3.
# Forty-first session, H100: the kernel with its next block loaded ahead, 305 us at 16 and at 64 rows (the select
# 266 / 1417): flash-slice B=64 18.56-18.58 ms back to back against 18.83-18.84 with the old tiling; at B=16 the kernel
# from 16 rows gave 8.04-8.08 against the select's 8.01-8.04 (two rounds each), so the select keeps 16 rows.
SELECT_MIN_ROWS = 2
MANY_ROWS = 64
MANY_ROWS_FILTER = "pallas"


def auto_filter(rows: int) -> str:
    """The ``sample`` mode's filter under "auto" for a step of ``rows`` rows (above); the kernel only where it is
    compiled for a GPU (interpreted elsewhere, it would be slow)."""
    if rows < SELECT_MIN_ROWS:
        return "sort"
    return MANY_ROWS_FILTER if rows >= MANY_ROWS and not interpret_mode() else "select"


def _draw(logits_V, scaled_V, temperature, seed_hi, seed_lo, position):
    """One row's token: the argmax of ``logits_V`` at temperature 0, else the Gumbel argmax of ``scaled_V`` (the
    row's logits over its temperature, filtered in the ``sample`` mode)."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed_lo), seed_hi), position)
    sampled = _argmax(scaled_V + jax.random.gumbel(key, scaled_V.shape, jnp.float32))
    return jnp.where(temperature == 0, _argmax(logits_V), sampled)


@partial(jax.jit, static_argnames=("mode", "top_filter"))
def sample(logits_RV: jax.Array, temperature_R: jax.Array, top_k_R: jax.Array, top_p_R: jax.Array,
           seed_hi_R: jax.Array, seed_lo_R: jax.Array, position_R: jax.Array, *, mode: str,
           top_filter: str = "auto") -> jax.Array:
    """One token per row. temperature float32 (0 = greedy), top_k int32 (0 = off), top_p float32 in (0, 1],
    seed_hi / seed_lo uint32 (the high and low halves of the 64-bit seed), position int32 (index of the token in
    the request's output). -> int32 [R]. The arrays are what ``sampling_inputs`` builds; ``mode`` (static, one of
    ``MODES``) is what ``sampling_mode`` picks for them: in ``greedy`` the row arguments are not read.
    ``top_filter``: the ``sample`` mode's filter, a key of ``FILTERS``, or "auto" (``auto_filter``)."""
    if top_filter == "auto":
        top_filter = auto_filter(logits_RV.shape[0])
    if top_filter not in FILTERS:
        raise ValueError(f"sampler top_filter must be 'auto' or one of {tuple(FILTERS)}, got {top_filter!r}")
    if mode == "greedy":
        return _argmax(logits_RV)
    if mode not in ("temperature", "sample"):
        raise ValueError(f"sampling mode must be one of {MODES}, got {mode!r}")
    scaled_RV = logits_RV.astype(jnp.float32) / jnp.maximum(temperature_R, 1e-5)[:, None]
    if mode == "sample":
        scaled_RV = FILTERS[top_filter](scaled_RV, top_k_R, top_p_R)
    return jax.vmap(_draw)(logits_RV, scaled_RV, temperature_R, seed_hi_R, seed_lo_R, position_R)


def sampling_mode(chunks: Sequence) -> str:
    """The mode of a step sampling ``chunks`` (each with ``params``, a SamplingParams, or None for a padding row):
    "greedy" when every row has temperature 0 (or there is none), else "temperature" when no sampled row filters
    (top_k 0, top_p 1), else "sample"."""
    sampled = [c.params for c in chunks if c is not None and not c.params.greedy]
    if not sampled:
        return "greedy"
    return "temperature" if all(p.top_k == 0 and p.top_p >= 1 for p in sampled) else "sample"


def sampling_inputs(chunks: Sequence, num_rows: int) -> tuple[np.ndarray, ...]:
    """Host arrays of ``sample``'s per-row arguments (after the logits) for the sampling ``chunks``, padded with
    greedy rows to ``num_rows``. Each chunk has ``params`` (a SamplingParams), ``seed`` (int in [0, 2**63)) and
    ``output_position`` (int), like a ``ScheduledChunk``; a None chunk is a padding row (the attention-DP runner
    lays each rank's rows at its own offset). SamplingParams' limits guarantee every value fits."""
    rows = list(chunks) + [None] * (num_rows - len(chunks))
    return (np.array([0.0 if c is None else c.params.temperature for c in rows], np.float32),
            np.array([0 if c is None else c.params.top_k for c in rows], np.int32),
            np.array([1.0 if c is None else c.params.top_p for c in rows], np.float32),
            np.array([0 if c is None else c.seed >> 32 for c in rows], np.uint32),
            np.array([0 if c is None else c.seed & 0xFFFFFFFF for c in rows], np.uint32),
            np.array([0 if c is None else c.output_position for c in rows], np.int32))


# ``sampling_inputs``' column dtypes, all 4 bytes wide: packed as uint32 bits into one array per step, with a last
# row for the mode (``StepSampling``)
COLUMN_DTYPES = (np.float32, np.int32, np.float32, np.uint32, np.uint32, np.int32)
PACKED_ROWS = len(COLUMN_DTYPES) + 1  # ``StepSampling.packed_7R``: the columns, then the mode


@partial(jax.tree_util.register_dataclass, data_fields=["packed_7R"], meta_fields=["mode"])
@dataclass(frozen=True)
class StepSampling:
    """An engine step's sampling arguments, as one pytree: ``packed_7R`` (``sampling_inputs``' six columns as
    uint32 bits, then a row holding the index of ``mode`` in ``MODES``, [7, R]: one host -> device copy per step; a
    host array as built, the engine's fixed device buffer once ``StepBuffers.stage`` has written it) is its leaf;
    ``mode`` (one of ``MODES``) is kept on the host for reading only: the device reads the mode from ``packed_7R``
    (``sample_packed``), so no executable is keyed on it."""

    packed_7R: np.ndarray | jax.Array
    mode: str

    @classmethod
    def of(cls, columns: tuple[np.ndarray, ...], mode: str) -> StepSampling:
        """``columns`` (``sampling_inputs``' host arrays, each [R], of ``COLUMN_DTYPES``) packed, with ``mode``."""
        if mode not in MODES:
            raise ValueError(f"sampling mode must be one of {MODES}, got {mode!r}")
        rows = [np.asarray(c, d).view(np.uint32) for c, d in zip(columns, COLUMN_DTYPES)]
        return cls(np.stack(rows + [np.full(len(rows[0]), MODES.index(mode), np.uint32)]), mode)

    @property
    def columns(self) -> tuple[jax.Array, ...]:
        """The six columns back in their dtypes (bitcasts; inside a trace, or eagerly): ``sample``'s row
        arguments."""
        return unpack_columns(self.packed_7R)


def unpack_columns(packed_7R: jax.Array) -> tuple[jax.Array, ...]:
    """``StepSampling.packed_7R``'s six sampling columns in their dtypes (bitcasts): ``sample``'s row arguments."""
    return tuple(lax.bitcast_convert_type(row, d) for row, d in zip(packed_7R[:len(COLUMN_DTYPES)], COLUMN_DTYPES))


def sample_packed(logits_RV: jax.Array, packed_7R: jax.Array) -> jax.Array:
    """One token per row, int32 [R], in the mode ``packed_7R`` names (``StepSampling``): exactly what ``sample``
    gives in that mode. Every mode's tokens are computed and the named one is selected (no control flow: module
    docstring)."""
    columns = unpack_columns(packed_7R)
    mode = packed_7R[PACKED_ROWS - 1, 0]
    tokens_R = sample(logits_RV, *columns, mode=MODES[-1])
    for index in range(len(MODES) - 2, -1, -1):
        tokens_R = jnp.where(mode == index, sample(logits_RV, *columns, mode=MODES[index]), tokens_R)
    return tokens_R


def step_sampling(chunks: Sequence, num_rows: int) -> StepSampling:
    """``sampling_inputs(chunks, num_rows)`` with the mode ``sampling_mode`` picks for ``chunks`` (padding rows are
    greedy and do not change it)."""
    return StepSampling.of(sampling_inputs(chunks, num_rows), sampling_mode(chunks))
