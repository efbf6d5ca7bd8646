"""The step contract (DESIGN.md "The step"): what one ragged step reads, and the cache it updates.

A step packs the query tokens of several sequences into one flat token axis T. Each token carries its sequence
row and absolute position; each sequence row carries its state slot, its block table, how many of its tokens were
cached before the step (``start``), how many query tokens it has in the step (``qlen``) and where they begin in
T (``qstart``). A sequence's query tokens are contiguous and in position order. Padding tokens have
``valid = False``; padding sequence rows have ``qlen = 0``.

Cache (one pytree, donated to the jitted step), laid out by the stages of dijax.model.plan:
``cache["stages"][s][r]`` holds run ``r`` of stage ``s``, every array stacked [repeats, run length, ...] like the
run's parameters (the layer of repeat i, member j is ``plan.layers[i][r][j]``):

  ==================  ==================================  =============================================
  key                 per-layer shape                     held by
  ==================  ==================================  =============================================
  window              [num_slots, W, K] bf16              every layer (ring: position p at p mod W)
  ckv                 [num_blocks, block_size/r, K] bf16  KV-source layers (paged, block table)
  ik                  [num_blocks, block_size/r, J] bf16  KV sources that own index keys (paged)
  tail_kv/score       [num_slots, r, K] f32               ratio > 1 KV sources (compressor partial group)
  ==================  ==================================  =============================================

``cache["engram_hist"]`` [num_slots, G - 1] int32: the Engram hash's ring of compressed ids (with Engram only).

Letters: T tokens, S sequence rows, B blocks per sequence, R logit rows; in ``build_step`` C chunks and F their
block tables' entries end to end.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from dijax.config import ModelConfig
from dijax.model.plan import plan_layers


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepBatch:
    """Inputs of one step (all int32 unless noted; host numpy arrays until the jitted step takes them).

    tokens_T, positions_T, seq_T [T]; valid_T bool [T];
    slot_S, start_S, qlen_S, qstart_S [S]; block_table_SB [S, B]; logit_rows_R [R] (indices into T).
    """

    tokens_T: jax.Array
    positions_T: jax.Array
    seq_T: jax.Array
    valid_T: jax.Array
    slot_S: jax.Array
    start_S: jax.Array
    qlen_S: jax.Array
    qstart_S: jax.Array
    block_table_SB: jax.Array
    logit_rows_R: jax.Array


@partial(jax.tree_util.register_dataclass, data_fields=["packed_N"], meta_fields=["shapes"])
@dataclass(frozen=True)
class PackedBatch:
    """A ``StepBatch`` as one int32 array, for the trip to the device: one host -> device copy per step instead of
    one per field (on a GPU each copy costs host time on the launch path). ``packed_N``: the fields flattened and
    concatenated in ``StepBatch`` order (``valid_T`` as 0 / 1); ``shapes`` (static, part of the jit key like the
    fields' shapes were): each field's shape. ``pack_batch`` / ``unpack_batch`` convert."""

    packed_N: np.ndarray
    shapes: tuple[tuple[int, ...], ...]


def pack_batch(batch: StepBatch) -> PackedBatch:
    """``batch`` (host numpy arrays) as a ``PackedBatch``."""
    fields = [getattr(batch, f.name) for f in dataclasses.fields(StepBatch)]
    packed_N = np.concatenate([np.asarray(a, np.int32).ravel() for a in fields])
    return PackedBatch(packed_N, tuple(np.shape(a) for a in fields))


def unpack_batch(packed: PackedBatch) -> StepBatch:
    """The ``StepBatch`` of ``packed`` (inside the jitted step: slices of the one device array)."""
    fields, offset = {}, 0
    for field, shape in zip(dataclasses.fields(StepBatch), packed.shapes):
        size = math.prod(shape)
        value = packed.packed_N[offset:offset + size].reshape(shape)
        fields[field.name] = value != 0 if field.name == "valid_T" else value
        offset += size
    return StepBatch(**fields)


@dataclass
class SeqChunk:
    """One sequence's part of a step (host side): its slot, block table, cached length and new tokens."""

    slot: int
    block_table: Sequence[int]  # the scheduler's tuple as it is: no per-step copy
    start: int
    tokens: Sequence[int]
    logits: str = "last"  # "last", "all" or "none": which of its tokens get logits


def build_step(chunks: list[SeqChunk], num_tokens: int, num_seqs: int, max_blocks: int,
               num_logit_rows: int | None = None) -> tuple[StepBatch, list[list[int]]]:
    """Pack chunks into a StepBatch padded to ``num_tokens`` tokens and ``num_seqs`` sequence rows.

    Returns the batch (numpy arrays: the jitted step moves them to the device as part of its call, which costs far
    less host time than one eager transfer per field) and, per chunk, the indices into ``logits_RV`` of its
    requested logit rows.
    """
    # built column by column from Python lists, a few numpy calls per step whatever the number of chunks (the
    # engine's host work per step: at 64 decodes a loop of per-chunk slice writes took ~0.3 ms of it)
    k = len(chunks)
    qlen_C = np.array([len(c.tokens) for c in chunks], np.int32)
    widths_C = np.array([len(c.block_table) for c in chunks], np.int64)
    total = int(qlen_C.sum())
    if total > num_tokens or k > num_seqs:
        raise ValueError(f"step of {total} tokens / {k} sequences exceeds the bucket "
                         f"({num_tokens} tokens, {num_seqs} sequences)")
    if k and widths_C.max() > max_blocks:
        raise ValueError(f"block table of {widths_C.max()} blocks exceeds max_blocks={max_blocks}")
    start_C = np.array([c.start for c in chunks], np.int32)
    qstart_C = (np.cumsum(qlen_C) - qlen_C).astype(np.int32)
    tokens = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    seq = np.zeros(num_tokens, np.int32)
    valid = np.zeros(num_tokens, bool)
    tokens[:total] = list(itertools.chain.from_iterable(c.tokens for c in chunks))
    seq[:total] = np.repeat(np.arange(k, dtype=np.int32), qlen_C)
    positions[:total] = np.arange(total, dtype=np.int32) + np.repeat(start_C - qstart_C, qlen_C)
    valid[:total] = True
    slot = np.zeros(num_seqs, np.int32)
    start = np.zeros(num_seqs, np.int32)
    qlen = np.zeros(num_seqs, np.int32)
    qstart = np.zeros(num_seqs, np.int32)
    slot[:k] = [c.slot for c in chunks]
    start[:k], qlen[:k], qstart[:k] = start_C, qlen_C, qstart_C
    table = np.zeros((num_seqs, max_blocks), np.int32)
    flat_F = list(itertools.chain.from_iterable(c.block_table for c in chunks))  # every table's blocks
    first_C = np.cumsum(widths_C) - widths_C
    row_F = np.repeat(np.arange(k), widths_C)
    table[row_F, np.arange(len(flat_F)) - np.repeat(first_C, widths_C)] = flat_F
    rows: list[int] = []
    rows_per_chunk: list[list[int]] = []
    for c, t, n in zip(chunks, qstart_C.tolist(), qlen_C.tolist()):
        wanted = {"last": [t + n - 1], "all": list(range(t, t + n)), "none": []}[c.logits]
        rows_per_chunk.append(list(range(len(rows), len(rows) + len(wanted))))
        rows.extend(wanted)
    r = num_logit_rows if num_logit_rows is not None else max(len(rows), 1)
    if len(rows) > r:
        raise ValueError(f"{len(rows)} logit rows requested, bucket holds {r}")
    logit_rows = np.zeros(r, np.int32)
    logit_rows[:len(rows)] = rows
    batch = StepBatch(tokens_T=tokens, positions_T=positions, seq_T=seq, valid_T=valid,
                      slot_S=slot, start_S=start, qlen_S=qlen, qstart_S=qstart,
                      block_table_SB=table, logit_rows_R=logit_rows)
    return batch, rows_per_chunk


@dataclass(frozen=True)
class CacheSpec:
    """Sizes of the paged pool and the slot pool. ``block_size`` tokens per block (a multiple of every ratio)."""

    num_blocks: int
    num_slots: int
    block_size: int = 128

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def init_cache(cfg: ModelConfig, spec: CacheSpec, fold: bool = True) -> dict:
    """Zeroed cache pytree for ``cfg`` (layout in the module docstring; ``fold`` as in ``plan_layers``)."""
    for role in cfg.kv_source_roles:
        if spec.block_size % role.ratio:
            raise ValueError(f"block_size={spec.block_size} must be a multiple of every compress ratio "
                             f"(layer {role.layer} has {role.ratio})")
    k, j, w = cfg.head_dim, cfg.index_head_dim, cfg.window_size
    stages = []
    for stage in plan_layers(cfg, fold):
        runs = []
        for r in range(stage.num_runs):
            role = cfg.roles[stage.layers[0][r][0]]
            lead = stage.stack(r)
            run = {"window": jnp.zeros(lead + (spec.num_slots, w, k), jnp.bfloat16)}
            if role.kv_source:
                rows = spec.block_size // role.ratio
                run["ckv"] = jnp.zeros(lead + (spec.num_blocks, rows, k), jnp.bfloat16)
                if role.owns_index_keys:
                    run["ik"] = jnp.zeros(lead + (spec.num_blocks, rows, j), jnp.bfloat16)
                if role.ratio > 1:
                    run["tail_kv"] = jnp.zeros(lead + (spec.num_slots, role.ratio, k), jnp.float32)
                    run["tail_score"] = jnp.zeros(lead + (spec.num_slots, role.ratio, k), jnp.float32)
            runs.append(run)
        stages.append(runs)
    cache: dict = {"stages": stages}
    if cfg.engram_layer_ids:
        cache["engram_hist"] = jnp.full((spec.num_slots, cfg.engram_max_ngram_size - 1), -1, jnp.int32)
    return cache
