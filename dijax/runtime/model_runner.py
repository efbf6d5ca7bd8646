"""The model runner: turns a ``SchedulerOutput`` into one padded, jitted step and returns a ``StepHandle`` at once.

Each step is padded to a bucket, so the number of compiled executables is bounded and known (``compiles`` counts
them, ``warmup`` compiles them all): tokens T to a power of two (at least 8); sequence rows S to min(T, the
sequence capacity), so decode steps (T = S) waste nothing and no (T, S) product is compiled; the block-table width
W to a power of four covering the longest sequence of the step (capped at ``max_model_len``'s blocks), so the
step's indexer and attention work follow the context the step's sequences really have, not ``max_model_len``.
Padding tokens are routed to no expert. The kernel choice (``kernels``: auto / on / off, dijax.kernels) is part of
the jit key. Sampling runs inside the step. Under zero-overhead
scheduling a decode whose input token is still in flight carries ``FROM_DEVICE``; the step gathers it from the
previous step's sampled-token array through ``remap_T`` (token t reads row ``remap_T[t]``) without a host round
trip. Launching runs under ``jax.transfer_guard_device_to_host("disallow")``: an accidental device read there
raises instead of silently serialising. ``StepHandle.wait()`` is the only place that reads device results.

Letters: T tokens, S sequence rows, R sampled rows (= the sequence-row bucket).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from dijax.config import ModelConfig
from dijax.driver import bucket
from dijax.kernels import kernel_options
from dijax.model.step import CacheSpec, SeqChunk, build_step, init_cache
from dijax.model.transformer import forward_step
from dijax.parallel.mesh import on_mesh, params_mesh
from dijax.runtime.sampler import sample, sampling_inputs
from dijax.runtime.scheduler import FROM_DEVICE, SchedulerOutput


class StepHandle:
    """A launched step: its plan and its device outputs (sampled tokens [R_max], not yet read)."""

    def __init__(self, output: SchedulerOutput, tokens_R: jax.Array, logits_RV: jax.Array | None = None):
        self.output = output
        self.tokens_R = tokens_R
        self.logits_RV = logits_RV
        self.logits: dict[str, np.ndarray] = {}

    def wait(self) -> dict[str, tuple[int, int]]:
        """Block until the step is done; {request_id: (epoch, token)} for every sampling chunk. With debug logits
        on, ``self.logits`` then holds each sampling chunk's float32 logits row."""
        tokens = np.asarray(self.tokens_R)  # the one host <- device read of the engine
        rows = [c for c in self.output.chunks if c.sample]
        if self.logits_RV is not None:
            logits = np.asarray(self.logits_RV)
            self.logits = {c.request_id: logits[i] for i, c in enumerate(rows)}
        return {c.request_id: (c.epoch, int(tokens[i])) for i, c in enumerate(rows)}


_COMPILES: dict[ModelConfig, int] = {}
MIN_TOKENS = 8


def width_bucket(blocks: int, max_blocks: int) -> int:
    """Block-table width for a step whose longest sequence holds ``blocks`` blocks: the smallest power of four
    >= blocks, capped at ``max_blocks`` (the capacity set by max_model_len)."""
    width = 1
    while width < blocks:
        width *= 4
    return min(width, max_blocks)


@lru_cache(maxsize=8)
def _compiled_step(cfg: ModelConfig, max_rows: int, with_logits: bool, kernels: tuple[tuple[str, str], ...]):
    """One jitted step function per (config, sampled-row capacity, debug logits, kernel choice), shared by every
    runner."""

    def step(params, cache, batch, consts, prev_tokens_R, remap_T, sampling):
        _COMPILES[cfg] = _COMPILES.get(cfg, 0) + 1  # Python side effect: runs once per trace (= per bucket)
        tokens_T = jnp.where(batch.tokens_T == FROM_DEVICE, prev_tokens_R[remap_T], batch.tokens_T)
        logits, cache, _ = forward_step(params, cache, dataclasses.replace(batch, tokens_T=tokens_T), consts, cfg,
                                        **dict(kernels))
        tokens = sample(logits, *sampling)
        tokens = jnp.zeros(max_rows, jnp.int32).at[:tokens.shape[0]].set(tokens)
        return (tokens, logits if with_logits else None), cache

    return jax.jit(step, donate_argnums=(1,))


class ModelRunner:
    """Owns the cache and launches the compiled steps. Pool sizes must match the scheduler's block / state
    managers."""

    def __init__(self, cfg: ModelConfig, params: dict, consts: dict, num_blocks: int, num_slots: int,
                 block_size: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 debug_logits: bool = False, kernels: str = "auto"):
        self.cfg, self.params, self.consts = cfg, params, consts
        self.kernel_options = kernel_options(kernels, jax.default_backend())
        self.cache = init_cache(cfg, CacheSpec(num_blocks=num_blocks, num_slots=num_slots, block_size=block_size))
        self.max_blocks = -(-max_model_len // block_size)
        self.max_rows = bucket(max_num_seqs, 1)
        self.max_tokens = bucket(max_num_batched_tokens, MIN_TOKENS)
        self._step = _compiled_step(cfg, self.max_rows, debug_logits, tuple(sorted(self.kernel_options.items())))
        self._no_previous = jnp.zeros(self.max_rows, jnp.int32)  # prev_tokens_R of a step with no predecessor
        # experts split by dijax.parallel.mesh.place_params: every launch traces the MoE's shard_map on that mesh
        self._step = on_mesh(self._step, params_mesh(params))

    @property
    def compiles(self) -> int:
        """Step executables compiled so far for this model (shared by all its runners)."""
        return _COMPILES.get(self.cfg, 0)

    def buckets(self) -> list[tuple[int, int]]:
        """Every (tokens, block-table width) bucket a step can take."""
        tokens = [MIN_TOKENS * 2 ** i for i in range((self.max_tokens // MIN_TOKENS).bit_length())]
        widths = sorted({width_bucket(4 ** i, self.max_blocks) for i in range(self.max_blocks.bit_length())})
        return [(t, w) for t in tokens for w in widths]

    def warmup(self) -> None:
        """Compile every bucket (``buckets``) with empty steps (they write nothing)."""
        for num_tokens, width in self.buckets():
            num_seqs = min(num_tokens, self.max_rows)
            batch, _ = build_step([], num_tokens, num_seqs, width, num_seqs)
            _, self.cache = self._step(self.params, self.cache, batch, self.consts, self._no_previous,
                                       np.zeros(num_tokens, np.int32), sampling_inputs([], num_seqs))

    def execute(self, output: SchedulerOutput, previous: StepHandle | None) -> StepHandle:
        """Launch ``output``'s step; returns immediately (JAX dispatch is asynchronous)."""
        chunks = [SeqChunk(slot=c.slot, block_table=list(c.block_table), start=c.start, tokens=list(c.token_ids),
                           logits="last" if c.sample else "none") for c in output.chunks]
        num_tokens = bucket(output.num_tokens, MIN_TOKENS)
        num_seqs = min(num_tokens, self.max_rows)
        width = width_bucket(max(len(c.block_table) for c in chunks), self.max_blocks)
        batch, _ = build_step(chunks, num_tokens, num_seqs, width, num_seqs)
        prev_rows = {rid: i for i, rid in enumerate(previous.output.sampled_request_ids)} if previous else {}
        remap = np.zeros(num_tokens, np.int32)
        t = 0
        for c in output.chunks:
            if c.token_ids[0] == FROM_DEVICE:
                remap[t] = prev_rows[c.request_id]
            t += c.num_tokens
        # host arrays throughout: the jitted call transfers them together with the batch
        sampling = sampling_inputs([c for c in output.chunks if c.sample], num_seqs)
        prev_tokens = previous.tokens_R if previous is not None else self._no_previous
        with jax.transfer_guard_device_to_host("disallow"):
            (tokens, logits), self.cache = self._step(self.params, self.cache, batch, self.consts, prev_tokens,
                                                      remap, sampling)
        return StepHandle(output, tokens, logits)
