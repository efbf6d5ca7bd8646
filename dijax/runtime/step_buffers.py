"""The engine step's per-call device buffers, kept at the same addresses from one step to the next.

Why: on the GPU, XLA records a compiled step into CUDA graphs (command buffers) once and replays them; a graph node
holds raw device pointers. When any buffer the step reads or writes sits at another address than in the step's
last run, XLA updates its graphs before the replay, and the replay of an updated graph is slower too (H200, the
tiny default's decode step: the launch on unchanged addresses takes 0.68 ms, with one moved buffer 1.36 ms, of which
``command_buffer::update`` 0.5 ms; docs/benchmarks.md, twelfth session). A step's parameters and XLA's scratch keep
their addresses, and the cache does too (donated, it comes back in place). What moved every step:

* the per-call inputs: the packed batch and the ZOS remap (host arrays, transferred into fresh buffers by each
  call) and the previous step's sampled tokens (a fresh array each step). ``StepBuffers.stage`` writes
  all three, in one small executable of their own, into one int32 buffer per bucket that is donated to that
  executable and so overwritten in place; the model step reads only that buffer (``StagedInputs``).
* the sampling arguments (``StepSampling.packed_7R``, a host array). The same executable writes them into a
  uint32 buffer per row count, in place, and the step's sampler reads that one. The host joins them to the packed
  batch and the remap, so that one transfer carries all three (each host array is a transfer of its own: a copy
  into a staging buffer, a dispatch, a completion callback). When they came as host arrays to the (then separate)
  sampler, its graph was updated before every replay and, under ZOS, the tiny default's decode step took 2.18 ms a
  step against 1.36 ms with them placed (H200, tools/dispatch_probe.py, fifteenth session).
* the step's outputs, the logits and the sampled tokens. ``StepBuffers.logits`` and ``StepBuffers.tokens`` hand
  the step the arrays the previous step of the same shape returned, donated: the step writes into them. The host
  and the next step read the tokens from a copy (``StepBuffers.copy``, one small launch, too small for a graph)
  taken right after the step, since the next step overwrites the buffer before the host reads step n's tokens.

Memory held: the staged inputs (a few KB per bucket), the sampling arguments (28 B a row per row bucket), the tokens
(4 B a row) and one float32 logits buffer per rows bucket (V4.1-Flash at 256 rows: 256 x 129,280 x 4 B = 132 MB).

On one device the staging executable is one or two small fusions, too small for XLA to put into a graph, so the
moving addresses of its own arguments cost nothing. Buffers are created on first use of a bucket by a jitted fill (no
host transfer) with the placement the step gives them, so that the first step of a bucket and every later one key
the same executable.

Letters: N packed batch elements, T tokens, M previous-token rows, R logit rows (and sampled rows), V vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Sharding

from dijax.model.step import PackedBatch
from dijax.runtime.sampler import PACKED_ROWS, StepSampling


@partial(jax.tree_util.register_dataclass, data_fields=["values_N"],
         meta_fields=["shapes", "num_packed", "num_tokens"])
@dataclass(frozen=True)
class StagedInputs:
    """An engine step's per-call inputs in one int32 array (with attention DP, one row per rank: [ranks, ...]):
    the packed batch's ``num_packed`` elements (``PackedBatch``, field shapes ``shapes``), the ZOS remap_T
    (``num_tokens``), then the previous step's sampled tokens (the rest)."""

    values_N: jax.Array
    shapes: tuple[tuple[int, ...], ...]
    num_packed: int
    num_tokens: int

    def split(self) -> tuple[PackedBatch, jax.Array, jax.Array]:
        """(the ``PackedBatch``, remap_T int32 [T], prev_tokens_R int32 [M]) of one rank's row (inside the step)."""
        a, b = self.num_packed, self.num_packed + self.num_tokens
        return PackedBatch(self.values_N[:a], self.shapes), self.values_N[a:b], self.values_N[b:]


def _host_part(packed_N, remap_T, packed_7R):
    """packed_N ++ remap_T ++ packed_7R's bits (int32, its rows one after another, on every rank's row) along the
    last axis: joined on the host when all three are host arrays, so that the staging call makes one transfer (each
    host array a call takes costs a transfer of its own, with the host's copy into a staging buffer); a
    ``jax.ShapeDtypeStruct`` of the joined array when any of them is one (``StepBuffers.compile``)."""
    lead, width = packed_N.shape[:-1], packed_N.shape[-1] + remap_T.shape[-1] + math.prod(packed_7R.shape)
    if any(isinstance(a, jax.ShapeDtypeStruct) for a in (packed_N, remap_T, packed_7R)):
        return jax.ShapeDtypeStruct(lead + (width,), jnp.int32)
    if all(isinstance(a, np.ndarray) for a in (packed_N, remap_T, packed_7R)):
        bits = np.broadcast_to(packed_7R.view(np.int32).reshape(-1), lead + (packed_7R.size,))
        return np.concatenate([packed_N, remap_T.astype(np.int32), bits], axis=-1)
    return _join(packed_N, remap_T, packed_7R)


@jax.jit
def _join(packed_N, remap_T, packed_7R):
    """``_host_part`` of device arrays, in one dispatch."""
    bits = lax.bitcast_convert_type(packed_7R, jnp.int32).reshape(-1)
    return jnp.concatenate([packed_N, remap_T, jnp.broadcast_to(bits, packed_N.shape[:-1] + bits.shape)], axis=-1)


def _write(buffer_N, sampling_buffer_7R, head_N, prev_tokens_R):
    """(the staged values, the sampling arguments) written over ``buffer_N`` and ``sampling_buffer_7R`` (both
    donated: that is where they land), from head_N (``_host_part``): its packed batch and remap ++ prev_tokens_R
    along the last axis, the tokens repeated on every rank's row; its sampling bits as ``sampling_buffer_7R``."""
    split = buffer_N.shape[-1] - prev_tokens_R.shape[-1]
    head, bits = head_N[..., :split], head_N[(0,) * (head_N.ndim - 1)][split:]
    prev = jnp.broadcast_to(prev_tokens_R, head.shape[:-1] + prev_tokens_R.shape)
    values = jnp.concatenate([head, prev], axis=-1).astype(buffer_N.dtype)
    sampling_7R = lax.bitcast_convert_type(bits.reshape(sampling_buffer_7R.shape), sampling_buffer_7R.dtype)
    # updates of the whole buffers, not the values alone: jit drops an argument the result does not use, and a
    # dropped argument cannot give the result its memory
    return (lax.dynamic_update_slice(buffer_N, values, (0,) * values.ndim),
            lax.dynamic_update_slice(sampling_buffer_7R, sampling_7R, (0, 0)))


@lru_cache(maxsize=8)
def _writer(sharding: Sharding | None, sampling_sharding: Sharding | None):
    return jax.jit(_write, donate_argnums=(0, 1), out_shardings=(sharding, sampling_sharding))


@lru_cache(maxsize=8)
def _copier(sharding: Sharding | None):
    """A jitted copy placed as ``sharding``: a fresh array (jit forwards only an output that is its input
    unchanged; this one is a copy)."""
    return jax.jit(jnp.copy, out_shardings=sharding)


@lru_cache(maxsize=None)  # one per buffer shape: bounded by the engine's buckets
def _filler(shape: tuple[int, ...], dtype: str, sharding: Sharding | None):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def _take(kept: dict[tuple[int, ...], jax.Array], shape: tuple[int, ...], dtype: str,
          sharding: Sharding | None) -> jax.Array:
    """The buffer of ``shape`` in ``kept`` (removed from it: the caller donates it), else a new zero one."""
    buffer = kept.pop(shape, None)
    return _filler(shape, dtype, sharding)() if buffer is None else buffer


class StepBuffers:
    """The engine step's staged inputs (one buffer per input size), its sampling arguments (one per row count), its
    logits and its tokens (one per shape), placed as ``sharding`` (the step's outputs' placement; None: the default
    device), the sampling arguments as ``sampling_sharding`` (replicated on a mesh). Inputs are host (numpy) or device
    arrays, or ``jax.ShapeDtypeStruct``s where only shapes matter (``abstract``, ``compile``)."""

    def __init__(self, sharding: Sharding | None = None, sampling_sharding: Sharding | None = None):
        self.sharding = sharding
        self.sampling_sharding = sampling_sharding
        self._inputs: dict[tuple[int, ...], jax.Array] = {}
        self._sampling: dict[tuple[int, ...], jax.Array] = {}
        self._logits: dict[tuple[int, ...], jax.Array] = {}
        self._tokens: dict[tuple[int, ...], jax.Array] = {}

    @staticmethod
    def staged_shape(batch: PackedBatch, remap_T, prev_tokens_R) -> tuple[int, ...]:
        """The staged array's shape for these inputs (leading rank axis, if any, kept)."""
        lead = batch.packed_N.shape[:-1]
        return lead + (batch.packed_N.shape[-1] + remap_T.shape[-1] + prev_tokens_R.shape[-1],)

    def abstract(self, batch: PackedBatch, remap_T, prev_tokens_R, num_rows: int, vocab: int
                 ) -> tuple[StagedInputs, jax.ShapeDtypeStruct, jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        """The abstract values of a step with these inputs and ``num_rows`` logit (and sampled) rows, what the step
        is lowered for: (``StagedInputs``, the logits buffer, the tokens buffer (the shape of ``prev_tokens_R``),
        the sampling arguments' ``packed_7R``)."""
        staged = jax.ShapeDtypeStruct(self.staged_shape(batch, remap_T, prev_tokens_R), jnp.int32,
                                      sharding=self.sharding)
        logits = jax.ShapeDtypeStruct((num_rows, vocab), jnp.float32, sharding=self.sharding)
        tokens = jax.ShapeDtypeStruct(prev_tokens_R.shape, jnp.int32, sharding=self.sharding)
        return self._staged(staged, batch, remap_T), logits, tokens, self._sampling_struct(num_rows)

    def _sampling_struct(self, num_rows: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((PACKED_ROWS, num_rows), jnp.uint32, sharding=self.sampling_sharding)

    @staticmethod
    def _staged(values, batch: PackedBatch, remap_T) -> StagedInputs:
        return StagedInputs(values, batch.shapes, batch.packed_N.shape[-1], remap_T.shape[-1])

    def compile(self, batch: PackedBatch, remap_T, prev_tokens_R, num_rows: int, vocab: int) -> None:
        """Compile ahead of time what ``stage``, ``logits``, ``tokens`` and ``copy`` run for a step with these
        inputs and ``num_rows`` logit (and sampled) rows (the engine's warm-up): the write, the four buffers' first
        fill and the tokens' copy."""
        staged, logits, tokens, sampling = self.abstract(batch, remap_T, prev_tokens_R, num_rows, vocab)
        _writer(self.sharding, self.sampling_sharding).lower(
            staged.values_N, sampling, _host_part(batch.packed_N, remap_T, sampling), prev_tokens_R).compile()
        _filler(staged.values_N.shape, "int32", self.sharding).lower().compile()
        _filler(sampling.shape, "uint32", self.sampling_sharding).lower().compile()
        _filler(logits.shape, "float32", self.sharding).lower().compile()
        _filler(tokens.shape, "int32", self.sharding).lower().compile()
        _copier(self.sampling_sharding).lower(tokens).compile()

    def stage(self, batch: PackedBatch, remap_T, prev_tokens_R, sampling: StepSampling
              ) -> tuple[StagedInputs, StepSampling]:
        """(the step's inputs, ``sampling`` with its ``packed_7R``) written into this size's buffers (created on
        first use), in place: one small launch, one host -> device copy (``batch``, ``remap_T`` and the sampling
        arguments joined on the host), no host read. ``prev_tokens_R``: the previous step's tokens (``copy``)."""
        shape = self.staged_shape(batch, remap_T, prev_tokens_R)
        sampling_shape = tuple(sampling.packed_7R.shape)
        buffer = _take(self._inputs, shape, "int32", self.sharding)
        sampling_buffer = _take(self._sampling, sampling_shape, "uint32", self.sampling_sharding)
        values, packed_7R = _writer(self.sharding, self.sampling_sharding)(
            buffer, sampling_buffer, _host_part(batch.packed_N, remap_T, sampling.packed_7R), prev_tokens_R)
        self._inputs[shape] = values
        self._sampling[sampling_shape] = packed_7R
        return self._staged(values, batch, remap_T), StepSampling(packed_7R, sampling.mode)

    def logits(self, num_rows: int, vocab: int) -> jax.Array:
        """The float32 [R, V] array the step writes its logits into (donated to it): the one the last step of this
        shape returned (``recycle``), else a new one."""
        return _take(self._logits, (num_rows, vocab), "float32", self.sharding)

    def tokens(self, num_rows: int) -> jax.Array:
        """The int32 [num_rows] array the step writes its sampled tokens into (donated to it): the one the last
        step returned (``recycle``), else a new one."""
        return _take(self._tokens, (num_rows,), "int32", self.sharding)

    def copy(self, tokens_M: jax.Array) -> jax.Array:
        """A new array of the step's tokens, for the host and the next step's inputs, placed as the sampling
        arguments (replicated on a mesh): the step's own buffer is overwritten by the next step, which is launched
        before the host reads this one's (ZOS)."""
        return _copier(self.sampling_sharding)(tokens_M)

    def recycle(self, logits_RV: jax.Array, tokens_M: jax.Array) -> None:
        """Keep the step's logits and tokens buffers (referenced nowhere else) for the next step of their shapes."""
        self._logits[tuple(logits_RV.shape)] = logits_RV
        self._tokens[tuple(tokens_M.shape)] = tokens_M
