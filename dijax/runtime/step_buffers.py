"""The engine step's per-call device buffers, kept at the same addresses from one step to the next.

Why: on the GPU, XLA records a compiled step into CUDA graphs (command buffers) once and replays them; a graph node
holds raw device pointers. When any buffer the step reads or writes sits at another address than in the step's
last run, XLA updates its graphs before the replay, and the replay of an updated graph is slower too (H200, the
tiny default's decode step: the launch on unchanged addresses takes 0.68 ms, with one moved buffer 1.36 ms, of which
``command_buffer::update`` 0.5 ms; docs/benchmarks.md, twelfth session). A step's parameters and XLA's scratch keep
their addresses, and the cache does too (donated, it comes back in place). What moved every step:

* the per-call inputs: the packed batch and the ZOS remap (host arrays, transferred into fresh buffers by each
  call) and the previous step's sampled tokens (a fresh sampler output each step). ``StepBuffers.stage`` writes
  all three, in one small executable of their own, into one int32 buffer per bucket that is donated to that
  executable and so overwritten in place; the model step reads only that buffer (``StagedInputs``).
* the logits the step returns. ``StepBuffers.logits`` hands the step the logits array the previous step of the
  same rows bucket returned, donated: the step writes its logits into it. The previous step's sampler, launched
  before on the same stream, has read it by then.

Memory held: the staged inputs (a few KB per bucket) and one float32 logits buffer per rows bucket, about twice
the largest (V4.1-Flash at 256 rows: 2 x 256 x 129,280 x 4 B = 265 MB), where the logits used to be freed after
each step's sampler.

On one device the staging executable is a single fusion, too small for XLA to put into a graph, so the moving
addresses of its own arguments cost nothing. Buffers are created on first use of a bucket by a jitted fill (no
host transfer) with the placement the step gives them, so that the first step of a bucket and every later one key
the same executable.

Letters: N packed batch elements, T tokens, M previous-token rows, R logit rows, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Sharding

from dijax.model.step import PackedBatch


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


def _host_part(packed_N, remap_T):
    """packed_N ++ remap_T along the last axis: joined on the host when both are host arrays, so that the step's
    call transfers one array."""
    if isinstance(packed_N, np.ndarray) and isinstance(remap_T, np.ndarray):
        return np.concatenate([packed_N, remap_T.astype(np.int32)], axis=-1)
    return jnp.concatenate([packed_N, remap_T], axis=-1)


def _write(buffer_N, head_N, prev_tokens_R):
    """The staged values (``buffer_N``, donated, is where they land): head_N (``_host_part``) ++ prev_tokens_R along
    the last axis, the tokens repeated on every rank's row."""
    prev = jnp.broadcast_to(prev_tokens_R, head_N.shape[:-1] + prev_tokens_R.shape)
    values = jnp.concatenate([head_N, prev], axis=-1).astype(buffer_N.dtype)
    # an update of the whole buffer, not the values alone: jit drops an argument the result does not use, and a
    # dropped argument cannot give the result its memory
    return lax.dynamic_update_slice(buffer_N, values, (0,) * values.ndim)


@lru_cache(maxsize=8)
def _writer(sharding: Sharding | None):
    return jax.jit(_write, donate_argnums=0, out_shardings=sharding)


@lru_cache(maxsize=None)  # one per buffer shape: bounded by the engine's buckets
def _filler(shape: tuple[int, ...], dtype: str, sharding: Sharding | None):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


class StepBuffers:
    """The engine step's staged inputs (one buffer per input size) and logits (one per shape), all placed as
    ``sharding`` (the step's outputs' placement; None: the default device). Inputs are host (numpy) or device arrays,
    or ``jax.ShapeDtypeStruct``s where only shapes matter (``abstract``, ``compile``)."""

    def __init__(self, sharding: Sharding | None = None):
        self.sharding = sharding
        self._inputs: dict[tuple[int, ...], jax.Array] = {}
        self._logits: dict[tuple[int, ...], jax.Array] = {}

    @staticmethod
    def staged_shape(batch: PackedBatch, remap_T, prev_tokens_R) -> tuple[int, ...]:
        """The staged array's shape for these inputs (leading rank axis, if any, kept)."""
        lead = batch.packed_N.shape[:-1]
        return lead + (batch.packed_N.shape[-1] + remap_T.shape[-1] + prev_tokens_R.shape[-1],)

    def abstract(self, batch: PackedBatch, remap_T, prev_tokens_R, num_rows: int, vocab: int
                 ) -> tuple[StagedInputs, jax.ShapeDtypeStruct]:
        """(``StagedInputs`` of abstract values, the logits buffer's abstract value) of a step with these inputs and
        ``num_rows`` logit rows: what the step is lowered for."""
        staged = jax.ShapeDtypeStruct(self.staged_shape(batch, remap_T, prev_tokens_R), jnp.int32,
                                      sharding=self.sharding)
        logits = jax.ShapeDtypeStruct((num_rows, vocab), jnp.float32, sharding=self.sharding)
        return self._staged(staged, batch, remap_T), logits

    @staticmethod
    def _staged(values, batch: PackedBatch, remap_T) -> StagedInputs:
        return StagedInputs(values, batch.shapes, batch.packed_N.shape[-1], remap_T.shape[-1])

    def compile(self, batch: PackedBatch, remap_T, prev_tokens_R, num_rows: int, vocab: int) -> None:
        """Compile ahead of time what ``stage`` and ``logits`` run for a step with these inputs (the engine's
        warm-up): the write and the two buffers' first fill."""
        staged, logits = self.abstract(batch, remap_T, prev_tokens_R, num_rows, vocab)
        _writer(self.sharding).lower(staged.values_N, _host_part(batch.packed_N, remap_T),
                                            prev_tokens_R).compile()
        _filler(staged.values_N.shape, "int32", self.sharding).lower().compile()
        _filler(logits.shape, "float32", self.sharding).lower().compile()

    def stage(self, batch: PackedBatch, remap_T, prev_tokens_R) -> StagedInputs:
        """The step's inputs written into this size's buffer (created on first use), in place: one small launch,
        one host -> device copy (``batch`` and ``remap_T`` as host arrays; device ones are joined on the device), no
        host read. ``prev_tokens_R``: the previous step's tokens."""
        shape = self.staged_shape(batch, remap_T, prev_tokens_R)
        buffer = self._inputs.pop(shape, None)
        if buffer is None:
            buffer = _filler(shape, "int32", self.sharding)()
        values = _writer(self.sharding)(buffer, _host_part(batch.packed_N, remap_T), prev_tokens_R)
        self._inputs[shape] = values
        return self._staged(values, batch, remap_T)

    def logits(self, num_rows: int, vocab: int) -> jax.Array:
        """The float32 [R, V] array the step writes its logits into (donated to it): the one the last step of this
        shape returned (``recycle``), else a new one."""
        shape = (num_rows, vocab)
        buffer = self._logits.pop(shape, None)
        return _filler(shape, "float32", self.sharding)() if buffer is None else buffer

    def recycle(self, logits_RV: jax.Array) -> None:
        """Keep the step's logits (already handed to the sampler, and referenced nowhere else) for the next step of
        their shape."""
        self._logits[tuple(logits_RV.shape)] = logits_RV

