"""The model runner: turns a ``SchedulerOutput`` into one padded, jitted model step that samples its own logits, and
returns a ``StepHandle`` at once.

Each step is padded to a bucket, so the number of compiled executables is bounded and known (``compiles`` counts
them, ``warmup`` compiles them all): tokens T to a power of two (at least 8); sequence rows S to min(T, the sequence
capacity), so decode steps (T = S) waste nothing and no (T, S) product is compiled; the block-table width W to a
power of four times ``min_width`` (MIN_CONTEXT positions) covering the longest sequence of the step (capped at
``max_model_len``'s blocks), so the step's indexer and attention work follow the context the step's sequences
really have, not ``max_model_len``. Padding tokens are routed to no expert.

An engine step is three launches with no host read between them (dijax.runtime.step_buffers): a one-kernel launch
that writes the step's inputs into their fixed buffers; the model step, one executable per (T, W) bucket, the
kernel choice (``kernels``: auto / on / off, dijax.kernels) static, which runs the forward of the step's tokens and
samples the float32 logits of its S sampling rows (dijax.runtime.sampler.sample_packed: the sampler mode, picked on
the host from the step's SamplingParams, is data read on the device, so one executable serves every mode); and a
copy of its tokens int32 [max rows] (padded to the runner's row capacity, so that every bucket's step takes the
same token array) for the host and the next step.

Under zero-overhead scheduling a decode whose input token is still in flight carries ``FROM_DEVICE``; the model
step gathers it from the previous step's sampled-token array through ``remap_T`` (token t reads row
``remap_T[t]``) without a host round trip. The step's per-call inputs (the packed batch, ``remap_T``, the previous
tokens) are first written into one buffer of the runner's and the sampling arguments into another, in place, and
the step writes its logits and tokens into the last step's buffers: every buffer the step reads or writes keeps
its address, so the step's CUDA graphs replay without an update. Launching runs under
``jax.transfer_guard_device_to_host("disallow")``: an accidental device read there raises instead of silently
serialising. ``execute`` then queues the sampled tokens' copy to the host right behind the step;
``StepHandle.wait()`` is the only place that reads device results.

Attention data parallelism (``attention_dp``, with parameters on a mesh; dijax.parallel.ranks): every device is an
attention rank with its own cache (the pool sizes given to the runner are per rank: each rank has ``num_blocks``
blocks and ``num_slots`` slots) and each scheduled chunk names its rank. Every rank takes the same (T, W) bucket,
T the max over ranks of their query tokens, each rank's part padded to it, so one executable serves all ranks; the
step's inputs and the cache carry a leading rank axis [R, ...] split over the devices, and the forward runs under
one ``shard_map``. The sampler then sees the ranks' sampling rows end to end (rank r's S rows at [r S, (r + 1) S))
and samples them as on one device; the sampled-token array (the step's split by rank like its other outputs, the
copy the host and the next step read replicated) holds R times the row capacity. Without a mesh there is no rank
axis: the one-device path is the same as without attention DP.

``forward`` is the model step, teacher-forced, for the parity checker, tests and diagnostics: the caller's chunks
(slots and blocks are the caller's), every logit row a chunk asks for, the index sets every index source selected,
optionally injected ones; no sampling. It blocks until the step is done.

Letters: T tokens, S sequence rows, R logit rows (sampled rows: the sequence-row bucket), V vocab; in
attention-DP mode the batch fields and the cache have a leading rank axis (dijax.parallel.ranks).
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor, as_completed
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding
from tqdm import tqdm

from dijax.config import ModelConfig
from dijax.kernels.options import kernel_options
from dijax.kernels.scale_range import exact_kernels
from dijax.model.step import CacheSpec, PackedBatch, SeqChunk, build_step, init_cache, pack_batch, unpack_batch
from dijax.model.transformer import forward_step
from dijax.parallel.mesh import mesh_context, on_mesh, param_specs, params_mesh
from dijax.parallel.ranks import RANKS, num_ranks, over_ranks, stack_ranks
from dijax.runtime.sampler import StepSampling, sample_packed, step_sampling
from dijax.runtime.scheduler import FROM_DEVICE, SchedulerOutput
from dijax.runtime.step_buffers import StepBuffers
from dijax.runtime.step_timeline import StepRecord


class StepHandle:
    """A launched step: its plan, the row of each sampling chunk in the step's outputs (``rows``: request id ->
    row) and its device outputs (the sampled tokens [max rows] and, with debug logits on, the model step's
    logits_RV; not yet read)."""

    def __init__(self, output: SchedulerOutput, rows: dict[str, int], tokens_R: jax.Array,
                 logits_RV: jax.Array | None = None):
        self.output = output
        self.rows = rows
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
            self.logits = {c.request_id: logits[self.rows[c.request_id]] for c in rows}
        return {c.request_id: (c.epoch, int(tokens[self.rows[c.request_id]])) for c in rows}


_COMPILES: dict[ModelConfig, int] = {}  # model-step traces per model
MIN_TOKENS = 8  # the smallest power-of-two token bucket; steps of fewer tokens pad to it unless a small bucket fits
# Token buckets below MIN_TOKENS (powers of two), each one executable more per block-table width; the engine's
# ``small_token_buckets`` (None: this default). One sequence's decode step has its own bucket, T = 1, rather than
# 7 padding tokens beside it: every token-level kernel then does an eighth of the rows. On an H100 (forty-third
# session, one process, two rounds) flash-slice's decode B=1 ran 2.716 / 2.696 ms back to back against 3.457 /
# 3.231 in the 8-token bucket, the tiny model's 2.108 / 1.419 against 2.810 / 1.797; GPU parity of the engine's
# decode steps unchanged. (1, 2, 4) also gives steps of 2-4 sequences their own: flash-slice decode B=2 3.20-3.21
# against 3.51-3.52 ms, B=4 3.97-3.99 against 4.08-4.09 (forty-fourth session), for two executables more a width.
# The price of each small bucket: a token's bits can depend on its step's size. A small executable's products may
# round otherwise than the 8-token one's (on the CPU, XLA's one-row products: the tiny model's logits for one
# request moved by up to 0.08 after its first compressed group and 0.5 once the indexer selects, greedy tokens
# equal; on a GPU the kernels' sums already depend on the token count), so a request decoded alone and later
# recomputed, or run at ep 1 and on an attention-DP rank, may differ past rounding near ties. () keeps every step
# in the MIN_TOKENS buckets: the EP bit-exactness tests run so (docs/scaling.md).
SMALL_TOKEN_BUCKETS: tuple[int, ...] = (1,)


def bucket(n: int, minimum: int) -> int:
    """Smallest power of two >= max(n, minimum) (``minimum`` a power of two)."""
    size = minimum
    while size < n:
        size *= 2
    return size


def small_buckets(value: tuple[int, ...] | list[int] | None) -> tuple[int, ...]:
    """``value`` checked as small token buckets (distinct powers of two below MIN_TOKENS), sorted; None gives
    SMALL_TOKEN_BUCKETS. Raises ValueError naming ``small_token_buckets`` and the allowed values."""
    allowed = [2 ** i for i in range(MIN_TOKENS.bit_length() - 1)]
    value = SMALL_TOKEN_BUCKETS if value is None else value
    if (not isinstance(value, (tuple, list)) or len(set(value)) != len(value)
            or any(type(t) is not int or t not in allowed for t in value)):
        raise ValueError(f"small_token_buckets must be distinct values from {allowed} (token buckets below "
                         f"MIN_TOKENS = {MIN_TOKENS}), e.g. (1,), (1, 2, 4) or (), got {value!r}")
    return tuple(sorted(value))


def token_bucket(n: int, small: tuple[int, ...] | None = None) -> int:
    """The token bucket T of a step of ``n`` tokens (on its busiest rank): the smallest of the ``small`` buckets
    (checked ones, ``small_buckets``; None: SMALL_TOKEN_BUCKETS) that holds n, else the smallest power of two
    >= max(n, MIN_TOKENS). Every step calls it: nothing is checked again here."""
    small = SMALL_TOKEN_BUCKETS if small is None else small
    return min((t for t in small if 0 < n <= t), default=None) or bucket(n, MIN_TOKENS)


MIN_CONTEXT = 8192  # positions every step's block tables cover at least (``min_width``)


def min_width(block_size: int, max_blocks: int) -> int:
    """The narrowest block-table width a step takes: MIN_CONTEXT positions (at block size 128, 64 blocks), capped
    at ``max_blocks``. Narrower tables would save index work that costs little next to the step (at 64 blocks,
    V4.1-Flash's indexer scores ~4k positions per token: ~1 % of a token's FLOPs), and each width is one more
    executable per token bucket to compile."""
    return min(-(-MIN_CONTEXT // block_size), max_blocks)


def width_bucket(blocks: int, max_blocks: int, minimum: int = 1) -> int:
    """Block-table width for a step whose longest sequence holds ``blocks`` blocks: the smallest power of four
    times ``minimum`` >= blocks, capped at ``max_blocks`` (the capacity set by max_model_len)."""
    width = minimum
    while width < blocks:
        width *= 4
    return min(width, max_blocks)


def step_buckets(max_tokens: int, max_blocks: int, minimum: int = 1,
                 small: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """Every (tokens, block-table width) bucket of a runner whose token bucket is at most ``max_tokens`` (a power of
    two >= MIN_TOKENS) and whose block tables hold at most ``max_blocks`` blocks: tokens the ``small`` buckets
    (``small_buckets``) and the powers of two from MIN_TOKENS, widths ``minimum`` times the powers of four below
    ``max_blocks``, and ``max_blocks`` itself."""
    tokens = [*small_buckets(small), *(MIN_TOKENS * 2 ** i for i in range((max_tokens // MIN_TOKENS).bit_length()))]
    widths = sorted({width_bucket(minimum * 4 ** i, max_blocks, minimum) for i in range(max_blocks.bit_length())})
    return [(t, w) for t in tokens for w in widths]


def engine_buckets(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
                   small: tuple[int, ...] | None = None) -> list[tuple[int, int, int]]:
    """Every (tokens T, sequence rows S, block-table width W) bucket of the model step of an engine of these sizes
    (per rank): ``step_buckets`` of its token and block capacities with ``min_width``, S = min(T, its row
    capacity). ``ModelRunner.warmup`` compiles these; tools/compile_time.py lowers them from abstract shapes."""
    max_blocks = -(-max_model_len // block_size)
    max_rows = bucket(max_num_seqs, 1)
    return [(t, min(t, max_rows), w) for t, w in step_buckets(bucket(max_num_batched_tokens, MIN_TOKENS),
                                                              max_blocks, min_width(block_size, max_blocks), small)]


def bucket_inputs(num_tokens: int, num_seqs: int, width: int) -> tuple[PackedBatch, np.ndarray]:
    """Host inputs of an empty engine step in the bucket (T = ``num_tokens``, S = ``num_seqs`` rows, block-table
    ``width``): (its ``PackedBatch``, remap_T int32 [T] zeros). The warm-up compiles each bucket from these; the
    values do not matter, the shapes are the bucket's."""
    return pack_batch(build_step([], num_tokens, num_seqs, width, num_seqs)[0]), np.zeros(num_tokens, np.int32)


# XLA options the model step compiles with; everything else is XLA's default, GEMM autotuning included (without it,
# xla_gpu_autotune_level=0 as in sessions 7-9, the GEMM fusions the step leaves to XLA took XLA's fallback tiling,
# 16 x 8 output tiles and 2 warps: on the H200 flash-slice decode at batch 64 ran 37.7 ms instead of 22.3 and a
# 1024-token prefill 244 ms instead of 58; docs/benchmarks.md, tenth session).
# Command buffers (CUDA graphs): FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL and CUDNN as in XLA's default, plus WHILE
# and CONDITIONAL: loops are recorded into the step's graph instead of launching each iteration behind a
# host-checked condition (the prefill step's loops). The option replaces XLA's list; it cannot extend it. Left out:
# DYNAMIC_SLICE_FUSION, in recent XLA defaults, which changes nothing here (XLA forms such fusions only under
# xla_gpu_enable_dynamic_slice_fusion, off by default). Measured on the H200 (tools/dispatch_probe.py, tiny default):
# at decode the list changes nothing measurable (twelfth session, as committed: 1.271 ms back to back at batch 1
# against 1.278 with XLA's default types plus DYNAMIC_SLICE_FUSION; the eleventh session's 0.6 ms gain through
# XLA_FLAGS did not repeat); the prefill steps have loops (a 256-token prefill: 1 while). GPU parity with it, as
# committed: tiny, tiny-nodrop and the engine run give the figures of the runs without it (docs/parity.md). No
# effect off the GPU.
STEP_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"}


@lru_cache(maxsize=8)
def compiled_step(cfg: ModelConfig, kernels: tuple[tuple[str, str], ...], params_tree: jax.tree_util.PyTreeDef,
                  ranks_mesh: Mesh | None = None, placement: Sharding | None = None):
    """One jitted model step per (config, kernel choice, parameter structure, attention-DP mesh, output placement),
    shared by every runner (and lowered from abstract shapes by tools/compile_time.py): step(param_leaves, cache,
    batch, consts, inject_topk=None, logits_RV=None, tokens_M=None, packed_7R=None) -> (outputs, new cache), the
    cache, ``logits_RV`` and ``tokens_M`` donated.
    ``param_leaves``: the parameter arrays as one flat list (``jax.tree.leaves`` of the parameters, whose structure
    is ``params_tree``): a call flattens a list in C++, where the nnx parameter tree (~340 variables for the tiny
    model) costs ~0.5 ms of Python per call on a 2-core host, every engine step. ``placement``: every output's
    placement on a mesh (the logits', the tokens' and the cache's), None without one.

    The engine step (``batch`` a ``StagedInputs``: the packed batch, remap_T [T] and prev_tokens_R [M] in the one
    buffer ``StepBuffers.stage`` keeps in place; ``inject_topk`` None; ``logits_RV`` float32 [S, V] and
    ``tokens_M`` int32 [M], the buffers the logits and the tokens are written into; ``packed_7R`` the sampling
    arguments, ``StepSampling.packed_7R``; dijax.runtime.step_buffers): in-flight tokens gathered through
    ``remap_T`` from ``prev_tokens_R`` (the previous step's tokens); outputs (logits_RV float32 of the S sampling
    rows, tokens_M: row r < S the token ``sample_packed`` draws from logits row r, the rest 0).
    The teacher-forced step (``batch`` a ``PackedBatch``, ``logits_RV`` None): outputs (logits_RV float32 of every
    row of ``batch.logit_rows_R``, {index-source layer: selected compressed positions int32 [T, N]}). The two steps
    are traces of one function, so they share the jit cache and its count.

    With ``ranks_mesh`` (attention data parallelism) the cache, the batch and ``inject_topk`` carry a leading rank
    axis and the step runs per rank under one ``shard_map`` (``consts`` replicated, every parameter as placed); the
    outputs get the rank axis too, the engine step's logits flattened to [R * S, V] (rank r's rows at
    [r S, (r + 1) S)).
    """

    def step(param_leaves, cache, batch, consts, inject_topk=None, logits_RV=None, tokens_M=None, packed_7R=None):
        _COMPILES[cfg] = _COMPILES.get(cfg, 0) + 1  # Python side effect: runs once per trace (= per bucket)
        params = jax.tree.unflatten(params_tree, param_leaves)
        if ranks_mesh is None:
            outputs, cache = rank_step(params, cache, batch, consts, inject_topk)
        else:
            specs = (param_specs(params), RANKS, RANKS, PartitionSpec(), RANKS)
            outputs, cache = over_ranks(rank_step, ranks_mesh, specs)(params, cache, batch, consts, inject_topk)
        if logits_RV is None:
            return outputs, cache
        # written over the donated buffers (whole-array updates: XLA writes the logits and tokens straight into them)
        logits_RV = lax.dynamic_update_slice(logits_RV, outputs.reshape(logits_RV.shape), (0, 0))
        tokens_S = sample_packed(logits_RV, packed_7R)
        padded_M = jnp.zeros(tokens_M.shape, jnp.int32).at[:tokens_S.shape[0]].set(tokens_S)
        return (logits_RV, lax.dynamic_update_slice(tokens_M, padded_M, (0,))), cache

    options = dict(kernels)

    def rank_step(params, cache, batch, consts, inject_topk):
        if isinstance(batch, PackedBatch):
            logits_RV, cache, topk = forward_step(params, cache, unpack_batch(batch), consts, cfg, inject_topk,
                                                  **options)
            return (logits_RV, topk), cache
        packed, remap_T, prev_tokens_R = batch.split()
        batch = unpack_batch(packed)
        tokens_T = jnp.where(batch.tokens_T == FROM_DEVICE, prev_tokens_R[remap_T], batch.tokens_T)
        batch = dataclasses.replace(batch, tokens_T=tokens_T)
        logits_RV, cache, _ = forward_step(params, cache, batch, consts, cfg, None, **options)
        return logits_RV, cache

    placed = {} if placement is None else {"out_shardings": placement}
    return jax.jit(step, donate_argnums=(1, 5, 6), compiler_options=STEP_COMPILER_OPTIONS, **placed)


class ModelRunner:
    """Owns the cache and launches the compiled steps. Pool sizes must match the scheduler's block / state
    managers (per rank with ``attention_dp``: module docstring; it has no effect without a mesh).
    ``small_token_buckets``: the token buckets below MIN_TOKENS (``small_buckets``; None: SMALL_TOKEN_BUCKETS)."""

    def __init__(self, cfg: ModelConfig, params: dict, consts: dict, num_blocks: int, num_slots: int,
                 block_size: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 debug_logits: bool = False, kernels: str = "auto", attention_dp: bool = False,
                 small_token_buckets: tuple[int, ...] | None = None):
        self.cfg, self.params, self.consts = cfg, params, consts
        self.small_token_buckets = small_buckets(small_token_buckets)  # token buckets below MIN_TOKENS
        self.param_leaves, params_tree = jax.tree.flatten(params)  # what the model step takes (compiled_step)
        # a Pallas kernel whose exact scale range a weight leaves hands its op to the reference (warning)
        self.kernel_options = exact_kernels(kernel_options(kernels, jax.default_backend()), params)
        spec = CacheSpec(num_blocks=num_blocks, num_slots=num_slots, block_size=block_size)
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.min_width = min_width(block_size, self.max_blocks)
        self._buckets = engine_buckets(max_num_batched_tokens, max_num_seqs, max_model_len, block_size,
                                       self.small_token_buckets)
        self.max_rows = bucket(max_num_seqs, 1)  # per rank
        self.max_tokens = bucket(max_num_batched_tokens, MIN_TOKENS)  # per rank
        self.debug_logits = debug_logits
        # experts split by dijax.parallel.mesh.place_params: every launch traces the MoE's shard_map on that mesh
        self._mesh = params_mesh(params)
        self._ranks_mesh = self._mesh if attention_dp else None
        self.num_ranks = num_ranks(self._ranks_mesh)
        # where the step's per-rank arrays live (the cache, the staged inputs, the logits), on a mesh: split by rank
        # with attention DP, else replicated; a fixed placement, so that every step keys the same executable
        placed = None if self._mesh is None else NamedSharding(
            self._mesh, RANKS if self._ranks_mesh is not None else PartitionSpec())
        self._jit = compiled_step(cfg, tuple(sorted(self.kernel_options.items())), params_tree, self._ranks_mesh,
                                  placed)
        replicated = None if self._mesh is None else NamedSharding(self._mesh, PartitionSpec())
        self.buffers = StepBuffers(placed, replicated)
        # the cache and prev_tokens_R of a step with no predecessor placed as later steps get them (the cache as the
        # step returns it: replicated on the mesh, or split by rank; the tokens as ``StepBuffers.copy`` returns
        # them: replicated): an executable is keyed on its inputs' shardings, so a first step with another placement
        # would compile every bucket (or the inputs' writer) twice
        self._no_previous = self._replicated(jnp.zeros(self.num_ranks * self.max_rows, jnp.int32))
        if self._ranks_mesh is None:
            self.cache = self._replicated(init_cache(cfg, spec))
        else:
            self.cache = stack_ranks(lambda: init_cache(cfg, spec), self._ranks_mesh)
        self._step = on_mesh(self._jit, self._mesh)

    def _replicated(self, tree):
        """``tree`` replicated over the runner's mesh (unchanged without one)."""
        if self._mesh is None:
            return tree
        return jax.device_put(tree, NamedSharding(self._mesh, PartitionSpec()))

    @property
    def compiles(self) -> int:
        """Model-step executables compiled so far for this model (shared by all its runners)."""
        return _COMPILES.get(self.cfg, 0)

    def buckets(self) -> list[tuple[int, int, int]]:
        """Every (tokens, sequence rows, block-table width) bucket a step can take (``engine_buckets``)."""
        return self._buckets

    def warmup(self, threads: int | None = None, progress: bool = False) -> None:
        """Compile the engine step's executables ahead of time, without running them: the model step of every
        bucket (``buckets``: ``len(buckets())`` executables, each sampling in every mode) and the small launches
        around it (``StepBuffers.compile``). The teacher-forced step of ``forward`` compiles on first use.

        Buckets are traced one after another here and compiled in ``threads`` parallel threads (default: one per
        CPU core, at most one per bucket): tracing holds the GIL (concurrent traces only slow each other down:
        measured 3x on the H200 host), XLA compiles without it. The warm-up takes the longer of the traces and the
        compiles' share of the cores: for the real 40-layer config at 8192 tokens, 256 sequences and 1M context
        (55 buckets) on the H200's 16-core host, the traces take ~4 s each; the whole warm-up took 6.0 min with XLA's
        GEMM autotuning off (seventh session) and about 10 min is estimated with it, as the step now compiles
        (``compiled_step``; docs/benchmarks.md, sixth, seventh and tenth sessions); with ``compile_cache_dir`` a
        later process loads what an earlier one compiled. An ahead-of-time compile fills the same executable cache
        that ``execute`` looks up, so no step traces or compiles again. ``progress`` shows a progress bar.
        """
        jobs = []
        for num_tokens, num_seqs, width in self.buckets():
            batch, remap = bucket_inputs(num_tokens, num_seqs, width)
            jobs.append((self._ranked([batch] * self.num_ranks), self.consts, self._no_previous,
                         self._ranked([remap] * self.num_ranks)))

        def compile_bucket(i: int, lowered: jax.stages.Lowered) -> None:
            lowered.compile()
            batch, _, prev_tokens, remap = jobs[i]
            self.buffers.compile(batch, remap, prev_tokens, self.logit_rows(batch), self.cfg.vocab_size)

        workers = max(1, min(threads or os.cpu_count() or 1, len(jobs)))
        with ThreadPoolExecutor(workers) as pool, tqdm(total=len(jobs), desc="compile step buckets",
                                                       disable=not progress) as bar:
            futures = [pool.submit(compile_bucket, i, self.lower(inputs)) for i, inputs in enumerate(jobs)]
            for future in as_completed(futures):
                future.result()  # re-raises a failed compile here
                bar.update()

    def _ranked(self, per_rank: list):
        """One step input from its per-rank parts (pytrees of host arrays): stacked on a leading rank axis in
        attention-DP mode, else the one part itself."""
        if self._ranks_mesh is None:
            return per_rank[0]
        return jax.tree.map(lambda *parts: np.stack(parts), *per_rank)

    def _batch(self, chunks: list[SeqChunk], ranks: list[int], all_rows: bool = False):
        """(batch (a ``PackedBatch``), rows_per_chunk, offsets, T, S) of ``chunks`` (chunk i on rank ``ranks[i]``)
        padded to the runner's buckets: T tokens, the max over ranks, S = min(T, the sequence capacity) rows, the
        block-table width following the longest table; logit rows S, or T when ``all_rows`` (a teacher-forced step
        asking for every position). ``rows_per_chunk``: each chunk's logit rows in the ranks' rows laid end to end
        (rank r's at [r rows, (r + 1) rows)); ``offsets``: each chunk's first token in its rank's part."""
        per_rank = [[i for i, r in enumerate(ranks) if r == k] for k in range(self.num_ranks)]
        num_tokens = token_bucket(max(sum(len(chunks[i].tokens) for i in idx) for idx in per_rank),
                                  self.small_token_buckets)
        num_seqs = min(num_tokens, self.max_rows)
        width = width_bucket(max(len(c.block_table) for c in chunks), self.max_blocks, self.min_width)
        num_rows = num_tokens if all_rows else num_seqs
        batches, rows_per_chunk, offsets = [], [[] for _ in chunks], [0] * len(chunks)
        for k, idx in enumerate(per_rank):
            batch, rows = build_step([chunks[i] for i in idx], num_tokens, num_seqs, width, num_rows)
            batches.append(pack_batch(batch))
            for i, chunk_rows in zip(idx, rows):
                rows_per_chunk[i] = [k * num_rows + row for row in chunk_rows]
            starts = np.cumsum([0] + [len(chunks[i].tokens) for i in idx])
            for i, t in zip(idx, starts):
                offsets[i] = int(t)
        return self._ranked(batches), rows_per_chunk, offsets, num_tokens, num_seqs

    def step_inputs(self, output: SchedulerOutput, previous: StepHandle | None
                    ) -> tuple[tuple, StepSampling, dict[str, int]]:
        """The engine step's arguments for ``output``: (the model step's after (param_leaves, cache): (batch, consts,
        prev_tokens_R, remap_T int32 [T]), its sampling arguments: a ``StepSampling`` of S rows per rank whose mode
        the sampling chunks' SamplingParams pick, and each sampling chunk's row: request id -> row of the step's
        logits and tokens); host arrays except the previous step's device tokens."""
        chunks = [SeqChunk(slot=c.slot, block_table=c.block_table, start=c.start, tokens=c.token_ids,
                           logits="last" if c.sample else "none") for c in output.chunks]
        ranks = [c.rank for c in output.chunks]
        batch, rows_per_chunk, offsets, num_tokens, num_seqs = self._batch(chunks, ranks)
        remap_RT = np.zeros((self.num_ranks, num_tokens), np.int32)
        layout = [None] * (self.num_ranks * num_seqs)  # the sampling chunks at their logits rows
        rows = {}
        for c, chunk_rows, offset in zip(output.chunks, rows_per_chunk, offsets):
            if c.token_ids[0] == FROM_DEVICE:
                remap_RT[c.rank, offset] = previous.rows[c.request_id]
            if c.sample:
                rows[c.request_id] = chunk_rows[0]
                layout[chunk_rows[0]] = c
        # host arrays throughout: the jitted call transfers them together with the batch
        sampling = step_sampling(layout, len(layout))
        prev_tokens = previous.tokens_R if previous is not None else self._no_previous
        return (batch, self.consts, prev_tokens, self._ranked(list(remap_RT))), sampling, rows

    def lower(self, inputs: tuple) -> jax.stages.Lowered:
        """The engine's model step lowered for ``inputs`` (the first of ``step_inputs``) under the runner's mesh:
        ``.compile()`` is the executable ``launch`` runs for that bucket, whatever the sampler mode (tools/bench.py
        reads its HLO and memory)."""
        batch, consts, prev_tokens, remap = inputs
        staged, logits, tokens, packed = self.buffers.abstract(batch, remap, prev_tokens, self.logit_rows(batch),
                                                               self.cfg.vocab_size)
        with mesh_context(self._mesh):
            return self._jit.lower(self.param_leaves, self.cache, staged, consts, None, logits, tokens, packed)

    def logit_rows(self, batch: PackedBatch) -> int:
        """The engine step's logit rows for ``batch``: its S sampling rows on every rank."""
        return self.num_ranks * batch.shapes[-1][0]  # logit_rows_R, the last field

    def execute(self, output: SchedulerOutput, previous: StepHandle | None,
                record: StepRecord | None = None) -> StepHandle:
        """Launch ``output``'s model step, which samples its logits; returns immediately (JAX dispatch is
        asynchronous). ``record``: the engine step's timeline record, given its inputs, model and tokens phases."""
        inputs, sampling, rows = self.step_inputs(output, previous)
        if record is not None:
            record.lap("inputs", output.step)
        handle = self.launch(output, inputs, sampling, rows, record)
        # the tokens' copy to the host queued now, behind the step: ``StepHandle.wait`` then finds them on the host
        # (or on their way) instead of asking for them only once the step is done. Outside ``launch``'s transfer
        # guard: on the GPU the guard refuses this asynchronous read too.
        handle.tokens_R.copy_to_host_async()
        return handle

    def launch(self, output: SchedulerOutput, inputs: tuple, sampling: StepSampling, rows: dict[str, int],
               record: StepRecord | None = None) -> StepHandle:
        """Dispatch the model step on ``inputs``, sampling with ``sampling`` (``step_inputs``'s parts for ``output``;
        ``rows``: each sampling chunk's row), then the copy of its tokens; no device read: it runs under
        ``transfer_guard_device_to_host("disallow")``, and the only transfers it makes are the host arrays of
        ``inputs`` and ``sampling`` (tests/test_step_timeline.py runs it under ``jax.transfer_guard("disallow")``
        with those placed first)."""
        batch, consts, prev_tokens, remap = inputs
        with jax.transfer_guard_device_to_host("disallow"):
            staged, sampling = self.buffers.stage(batch, remap, prev_tokens, sampling)
            logits_RV = self.buffers.logits(self.logit_rows(batch), self.cfg.vocab_size)
            tokens_M = self.buffers.tokens(self._no_previous.shape[0])
            (logits_RV, tokens_M), self.cache = self._step(self.param_leaves, self.cache, staged, consts, None,
                                                           logits_RV, tokens_M, sampling.packed_7R)
            if record is not None:
                record.lap("model", output.step)
            tokens_R = self.buffers.copy(tokens_M)
            kept = jnp.copy(logits_RV) if self.debug_logits else None  # the buffer itself goes to the next step
            self.buffers.recycle(logits_RV, tokens_M)
            if record is not None:
                record.lap("tokens", output.step)
        return StepHandle(output, rows, tokens_R, kept)

    def forward(self, chunks: list[SeqChunk], inject_topk: dict[int, np.ndarray] | None = None,
                ranks: list[int] | None = None) -> tuple[list[np.ndarray], dict[int, list[np.ndarray]]]:
        """Teacher-forced step: advance every chunk by its tokens and read back its logit rows and index sets.

        chunks: one per sequence (at most ``max_num_seqs``, together at most ``max_num_batched_tokens`` tokens, per
        rank); the caller owns their slots and blocks (of the chunk's rank's pool), and each block table covers
        ``start + len(tokens)`` positions.
        inject_topk: optional {index-source layer: int32 [total tokens, index_topk]} compressed positions, rows in
        the chunks' token order, overriding that layer's selection. Same buckets as ``execute``; the logit rows
        take the sequence-row bucket, or the token bucket when a chunk asks for "all".
        ranks: in attention-DP mode, each chunk's rank (default: all on rank 0); else None or all 0.

        Returns, per chunk, its logits float32 [rows, V] (rows: 1 for "last", len(tokens) for "all", 0 for
        "none"), and per index-source layer, per chunk, its selected compressed positions int32 [len(tokens),
        index_topk] (ascending, -1 padded).
        """
        if not chunks:
            raise ValueError("forward needs at least one chunk")
        ranks = [0] * len(chunks) if ranks is None else list(ranks)
        if len(ranks) != len(chunks) or any(r not in range(self.num_ranks) for r in ranks):
            raise ValueError(f"ranks must give each of the {len(chunks)} chunks a rank in [0, {self.num_ranks}), "
                             f"got {ranks}")
        for c in chunks:
            if len(c.block_table) * self.block_size < c.start + len(c.tokens):
                raise ValueError(f"block table of {len(c.block_table)} blocks of {self.block_size} does not cover "
                                 f"positions up to {c.start + len(c.tokens)}")
        lengths = [len(c.tokens) for c in chunks]
        busiest = max(sum(n for n, r in zip(lengths, ranks) if r == k) for k in range(self.num_ranks))
        if token_bucket(busiest, self.small_token_buckets) > self.max_tokens:
            raise ValueError(f"step of {busiest} tokens on one rank exceeds max_num_batched_tokens "
                             f"(bucket {self.max_tokens})")
        batch, rows_per_chunk, offsets, num_tokens, _ = self._batch(
            chunks, ranks, all_rows=any(c.logits == "all" for c in chunks))
        starts = np.cumsum([0] + lengths)
        inject = None
        if inject_topk is not None:
            inject = {}
            for layer, v in inject_topk.items():
                if v.shape != (sum(lengths), self.cfg.index_topk):
                    raise ValueError(f"inject_topk[{layer}] has shape {v.shape}, expected "
                                     f"({sum(lengths)}, {self.cfg.index_topk})")
                v_RTN = np.full((self.num_ranks, num_tokens, v.shape[1]), -1, np.int32)
                for r, t, a, b in zip(ranks, offsets, starts[:-1], starts[1:]):
                    v_RTN[r, t:t + b - a] = v[a:b]
                inject[layer] = self._ranked(list(v_RTN))
        (logits, topk), self.cache = self._step(self.param_leaves, self.cache, batch, self.consts, inject)
        logits_RV = np.asarray(logits).reshape(-1, self.cfg.vocab_size)  # the ranks' rows end to end
        per_layer = {}
        for layer, v in topk.items():
            v_RTN = np.asarray(v).reshape(self.num_ranks, num_tokens, -1)
            per_layer[layer] = [v_RTN[r, t:t + n] for r, t, n in zip(ranks, offsets, lengths)]
        return [logits_RV[r] for r in rows_per_chunk], per_layer
