"""The model runner: turns a ``SchedulerOutput`` into one padded, jitted step and returns a ``StepHandle`` at once.

Each step is padded to a bucket (tokens and sequence rows from small fixed sets of powers of two), so the number
of compiled executables is bounded; ``compiles`` counts them. Sampling runs inside the step. Under zero-overhead
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


@lru_cache(maxsize=8)
def _compiled_step(cfg: ModelConfig, max_rows: int, with_logits: bool):
    """One jitted step function per (config, sampled-row capacity, debug logits), shared by every runner."""

    def step(params, cache, batch, consts, prev_tokens_R, remap_T, sampling):
        _COMPILES[cfg] = _COMPILES.get(cfg, 0) + 1  # Python side effect: runs once per trace (= per bucket)
        tokens_T = jnp.where(batch.tokens_T == FROM_DEVICE, prev_tokens_R[remap_T], batch.tokens_T)
        logits, cache, _ = forward_step(params, cache, dataclasses.replace(batch, tokens_T=tokens_T), consts, cfg)
        tokens = sample(logits, *sampling)
        tokens = jnp.zeros(max_rows, jnp.int32).at[:tokens.shape[0]].set(tokens)
        return (tokens, logits if with_logits else None), cache

    return jax.jit(step, donate_argnums=(1,))


class ModelRunner:
    """Owns the cache and launches the compiled steps. Pool sizes must match the scheduler's block / state
    managers."""

    def __init__(self, cfg: ModelConfig, params: dict, consts: dict, num_blocks: int, num_slots: int,
                 block_size: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 debug_logits: bool = False):
        self.cfg, self.params, self.consts = cfg, params, consts
        self.cache = init_cache(cfg, CacheSpec(num_blocks=num_blocks, num_slots=num_slots, block_size=block_size))
        self.max_blocks = -(-max_model_len // block_size)
        self.max_rows = bucket(max_num_seqs, 1)
        self.max_tokens = bucket(max_num_batched_tokens)
        self._step = _compiled_step(cfg, self.max_rows, debug_logits)
        self._no_previous = jnp.zeros(self.max_rows, jnp.int32)  # prev_tokens_R of a step with no predecessor
        # experts split by dijax.parallel.mesh.place_params: every launch traces the MoE's shard_map on that mesh
        self._step = on_mesh(self._step, params_mesh(params))

    @property
    def compiles(self) -> int:
        """Step executables compiled so far for this model (shared by all its runners)."""
        return _COMPILES.get(self.cfg, 0)

    def warmup(self) -> None:
        """Compile every (token bucket, sequence bucket) pair with empty steps (they write nothing)."""
        num_tokens = 8
        while num_tokens <= self.max_tokens:
            num_seqs = 1
            while num_seqs <= min(self.max_rows, num_tokens):
                batch, _ = build_step([], num_tokens, num_seqs, self.max_blocks, num_seqs)
                sampling = sampling_inputs([], num_seqs)
                _, self.cache = self._step(self.params, self.cache, batch, self.consts,
                                           jnp.zeros(self.max_rows, jnp.int32), jnp.zeros(num_tokens, jnp.int32),
                                           sampling)
                num_seqs *= 2
            num_tokens *= 2

    def execute(self, output: SchedulerOutput, previous: StepHandle | None) -> StepHandle:
        """Launch ``output``'s step; returns immediately (JAX dispatch is asynchronous)."""
        chunks = [SeqChunk(slot=c.slot, block_table=list(c.block_table), start=c.start, tokens=list(c.token_ids),
                           logits="last" if c.sample else "none") for c in output.chunks]
        num_tokens = bucket(output.num_tokens)
        num_seqs = bucket(len(chunks), 1)
        batch, _ = build_step(chunks, num_tokens, num_seqs, self.max_blocks, num_seqs)
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
