"""Sparse single-KV-head attention with an attention sink, over per-query index lists (v41_spec §4 step 5, §16).

Two implementations behind ``sparse_attn(..., impl=...)``: the pure-jnp reference ``sparse_attn_reference`` and the
Pallas kernel ``sparse_attn_pallas`` (Triton lowering, which gathers rows by an index vector; interpret mode on CPU).

Semantics of the reference kernel (parity README §6.5): the index list is walked in blocks of 64 with an online
softmax whose running max starts at -1e30; probabilities are taken relative to the *running* max, summed in fp32
for the denominator and cast to bf16 before the PV product; the sink ``exp(sink_h - max)`` joins the denominator
unscaled; index -1 contributes nothing and a row with no valid index returns 0.

The kernel (flash-decoding): one program per (token, head group, split of the index list). It walks its split in
the same blocks of 64, gathers each block's latent rows once for all heads of its group (the masked load reads only
the source a row lives in; told where each token's second source starts, ``first_T``, it walks the blocks on either
side as one-source loops whose gathers pipeline), and keeps the reference's fp32 online softmax with the bf16 P cast
relative to the split's running max. The splits' partial sums are merged in fp32 outside the kernel, where the sink
joins the denominator. With one split (a program holds a whole list: prefill, and batches of more than half
``wave_programs`` tokens) the kernel adds the sink, divides and writes the bf16 output itself, so no fp32 partials
go through memory. With one split this is the reference's computation block for block; with several, each split's
P is rounded relative to its own running max instead of the global one (the same bf16 rounding, at other points),
and the QK and PV products accumulate in another order than the reference's fp32 einsums.

Letters: T query tokens, H heads, K head dim, L list length, N rows of a KV source, S splits of the list.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dijax.kernels import interpret_mode, sparse_attn_mgpu
from dijax.kernels.division import div_rn
from dijax.kernels.flash_merge import merge_splits
from dijax.kernels.numerics import divide

BLOCK = 64
HIGHEST = jax.lax.Precision.HIGHEST
IMPLS = ("reference", "pallas")
ENGINES = ("triton", "mgpu")
MAX_SOURCES = 3
MIN_HEADS = 16  # Triton's dot needs every dimension >= 16: fewer heads (tiny test models) are padded with zero queries


def gather_rows(sources: tuple[jax.Array, ...], idx: jax.Array) -> jax.Array:
    """Rows of the virtual concatenation of ``sources`` (each [N_i, K]) at ``idx`` (any shape, -1 allowed).

    Returns float32 [*idx.shape, K]; rows for idx = -1 are zero. No concatenated copy is made.
    """
    out = jnp.zeros((*idx.shape, sources[0].shape[-1]), jnp.float32)
    base = 0
    for src in sources:
        local = idx - base
        hit = (local >= 0) & (local < src.shape[0])
        rows = src[jnp.clip(local, 0, src.shape[0] - 1)].astype(jnp.float32)
        out = jnp.where(hit[..., None], rows, out)
        base += src.shape[0]
    return out


def sparse_attn_reference(q_THK: jax.Array, kv_sources: tuple[jax.Array, ...], idx_TL: jax.Array,
                          sink_H: jax.Array, softmax_scale: float) -> jax.Array:
    """Attention of each query over the rows its index list names (K = V, one KV head): the jnp reference.

    q_THK: bf16 queries; kv_sources: bf16 [N_i, K] arrays addressed as one concatenation; idx_TL: int32 indices
    (-1 = none); sink_H: float32 sink logits. Returns bf16 [T, H, K].
    """
    t, h, k = q_THK.shape
    length = idx_TL.shape[1]
    pad = -length % BLOCK
    if pad:
        idx_TL = jnp.concatenate([idx_TL, jnp.full((t, pad), -1, idx_TL.dtype)], axis=1)
    q = q_THK.astype(jnp.float32)
    scale = np.float32(softmax_scale)
    acc = jnp.zeros((t, h, k), jnp.float32)
    denom = jnp.zeros((t, h), jnp.float32)
    running_max = jnp.full((t, h), -1e30, jnp.float32)
    def block(b, carry):
        acc, denom, running_max = carry
        idx = jax.lax.dynamic_slice_in_dim(idx_TL, b * BLOCK, BLOCK, axis=1)
        valid = idx >= 0
        kv = gather_rows(kv_sources, idx)  # [T, 64, K], zero where invalid
        s = jnp.einsum("thk,tlk->thl", q, kv, precision=HIGHEST)
        s = jnp.where(valid[:, None, :], s, -jnp.inf) * scale
        new_max = jnp.maximum(running_max, jnp.max(s, axis=-1))
        alpha = jnp.exp(running_max - new_max)
        p = jnp.exp(s - new_max[..., None])
        denom = denom * alpha + jnp.sum(p, axis=-1)
        p16 = p.astype(jnp.bfloat16).astype(jnp.float32)
        acc = acc * alpha[..., None] + jnp.einsum("thl,tlk->thk", p16, kv, precision=HIGHEST)
        return acc, denom, new_max

    acc, denom, running_max = jax.lax.fori_loop(0, idx_TL.shape[1] // BLOCK, block, (acc, denom, running_max))
    denom = denom + jnp.exp(sink_H.astype(jnp.float32)[None, :] - running_max)
    return divide(acc, denom[..., None]).astype(jnp.bfloat16)


@dataclass(frozen=True)
class SparseAttnConfig:
    """Tiling of ``sparse_attn_pallas``.

    block_h: heads per program (a power of two dividing H; every head group re-gathers the rows, from L2);
    num_splits: programs per (token, head group) along the index list, None = as many as fit in
    ``wave_programs``;
    wave_programs: programs that run at once. A program holds a multiprocessor's whole register file (254
    registers x 8 warps), so an H200 runs 132 at a time and a grid past that runs in waves. The splits are chosen
    to fill one wave: more would add a wave and the fp32 partials' traffic (on the H200 at batch 64, 2 splits
    83.9 us against 124.9 us at 5, twenty-fifth session; at batch 256 1 split 260.5 us against 307.0 at 2);
    num_warps / num_stages: Triton launch parameters; num_stages None = 2 where each loop of the kernel reads one
    source (one source, or ``first_T``), else 1. Two stages pipeline the row gathers through shared memory
    (cp.async): a 64 KB row block a stage and source beside the 64 KB of queries, 192 KB for one source; three
    sources would need 448 KB, over the H200's 227 KB.

    engine: 'triton' (this module's kernel) or 'mgpu' (dijax.kernels.sparse_attn_mgpu: the rows gathered by
    ``cp.async`` into wgmma's shared-memory layout, one or two warpgroups each its part of the output dims, block
    b + 1's gathers in flight during block b's products; the same splits, those in ``cluster_splits`` merged in the
    kernel across a thread-block cluster, the default pairs only). 'mgpu' falls back to 'triton' off a
    compute-capability-9 GPU, when interpreted, for shapes it does not take (``sparse_attn_mgpu.shape_error``), and
    below ``mgpu_min_tokens`` tokens. By GPU kernel time on an H100 (forty-seventh session; 640 rows x 512, 64
    heads, the model's window + pool sources) it takes batch 1 / 64 / 256 in 10.0 / 38.3 / 81.9 us against the
    Triton kernel's 12.6 / 54.3 / 143.5, so it runs from one token on. (The thirty-first session had set 64 from
    wall time, 27.1 against 22.4 us at batch 1, which counts the standalone call's dispatch; in a step, flash-slice
    decode ran 2.56 ms back to back at batch 1 against 2.58 with the Triton kernel there, and 7.94 against 7.92 at
    batch 16.)
    pdl: 'mgpu' launches as a programmatic dependent (its CTAs start while the kernel before it still runs and
    wait for it in the kernel: ``plgpu.griddepcontrol_wait``), as XLA launches its own kernels on Hopper. Off: in
    the tiny decode step, which the host bounds, it showed no difference (H100, forty-ninth session); a step the
    device bounds (flash-slice at one token) has not run with it.
    mgpu_shared_scores: 'mgpu' with two warpgroups (K > 256): warpgroup 0 alone computes each block's scores and
    softmax and hands P to both through shared memory (``sparse_attn_mgpu``'s docstring, "Shared scores"); the
    same bits (its GPU tests). On: H100, fifty-fifth session, GPU kernel time at 640 rows x 512 in the prefill
    layout (window + pool), batch 64 29.2 against 30.1 us and 256 78.4 against 81.6 (71.3 % of the bytes floor);
    flash-slice decode at batch 64 the same back to back (18.60 against 18.59 ms, fifty-sixth session: attention is
    ~1 % of that step). The parity fixtures' 64-dim heads take one warpgroup, so GPU parity does not reach it.
    mgpu_wide_merge: 'mgpu''s cluster merge reads the partial sums 16 bytes a load instead of 8
    (``sparse_attn_mgpu``'s ``wide_merge``; the same arithmetic). Off until measured (sixtieth session).
    mgpu_dim_splits: the most CTAs 'mgpu' gives each (token, head group, split of its list), each computing the
    scores over the split's whole rows (gathered by each of them, mostly from L2 after the first) and writing its
    share of the output dims (``sparse_attn_mgpu``'s ``dim_splits``; the same bits). They fill what the list's
    splits leave of one wave: the most of 1, 2, 4, 8 up to this that K allows (``dim_splits_error``) with T x
    groups x splits x it <= ``wave_programs``. By GPU kernel time on an H100 (fifty-seventh session, 640 rows x 512,
    64 heads, window + pool) batch 1 (ten splits) took 10.0 us with 1, 8.3 with 2 and 7.2 with 4; at batch 64 two
    dim splits in place of the list's two took 29.5 against 27.8, so the list splits come first (the dims first
    everywhere: batch 64 29.2 against 27.8, batch 1 and 256 the same; fifty-eighth session). One of 1, 2, 4, 8.
    mgpu_trace_dir: 'mgpu' records each warpgroup's timeline (``sparse_attn_mgpu``'s ``trace_dir``: the clock at
    each step's start and end) into this directory, a Chrome trace a call; "" (the default) records nothing and
    leaves the kernel's code as it is. For tools/profile_attn.py --trace-dir, not for serving.

    At 64 heads x 512 dims over three sources the kernel takes 254 registers a thread and does not spill
    (tools/kernel_report.py, twenty-fifth session; 428 bytes of spill before the loads were chained). Splitting the
    output dims across this kernel's programs re-gathers the rows and recomputes the scores per part: on the H200 it
    was 1.1-1.9x slower at batch 64 / 256 (docs/benchmarks.md, ninth session), so this kernel has none; 'mgpu' has
    it as ``mgpu_dim_splits``.
    """

    block_h: int = 64
    num_splits: int | None = None
    wave_programs: int = 132
    num_warps: int = 8
    num_stages: int | None = None
    engine: str = "mgpu"
    mgpu_min_tokens: int = 1
    cluster_splits: tuple[int, ...] = sparse_attn_mgpu.CLUSTER_SPLITS
    pdl: bool = False
    mgpu_shared_scores: bool = True
    mgpu_wide_merge: bool = False
    mgpu_dim_splits: int = 4
    mgpu_trace_dir: str = ""

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"sparse_attn SparseAttnConfig.engine must be one of {ENGINES}, got {self.engine!r}")
        if self.mgpu_min_tokens < 1:
            raise ValueError(f"sparse_attn SparseAttnConfig.mgpu_min_tokens must be >= 1, got {self.mgpu_min_tokens}")
        if self.mgpu_dim_splits not in sparse_attn_mgpu.DIM_SPLITS:
            raise ValueError(f"sparse_attn SparseAttnConfig.mgpu_dim_splits must be one of "
                             f"{sparse_attn_mgpu.DIM_SPLITS}, got {self.mgpu_dim_splits!r}")
        object.__setattr__(self, "cluster_splits", tuple(self.cluster_splits))  # hashable: configs are jit statics
        error = sparse_attn_mgpu.cluster_splits_error(self.cluster_splits)
        if error:
            raise ValueError(f"sparse_attn SparseAttnConfig.{error}")


CONFIG = SparseAttnConfig()


def _mgpu_takes(config: SparseAttnConfig, t: int, h: int, k: int, n_sources: int, interpret: bool) -> bool:
    """Whether ``sparse_attn_pallas`` runs on ``sparse_attn_mgpu``: engine 'mgpu', at least ``mgpu_min_tokens``
    tokens, a compute-capability-9 GPU (not interpreted), shapes it takes."""
    return (config.engine == "mgpu" and t >= config.mgpu_min_tokens and not interpret and sparse_attn_mgpu.available()
            and sparse_attn_mgpu.shape_error(h, k, n_sources) is None)


def _attend(idx_ref, first_ref, q_ref, src_refs, *, sizes: tuple[int, ...], split_len: int, list_len: int,
            scale: float):
    """One (token, head group, split): the online-softmax sums (acc [h, K], denominator [h], running max [h]) over
    the split's blocks of 64 indices, without the sink.

    first_ref: None, or (two sources) int32 [T]: the token's lanes below first_ref[t] index only the first source
    and the rest only the second. Then the blocks below it read the first source alone, the blocks above it the
    second alone (loops of one load whose gathers Triton pipelines when ``num_stages`` > 1), and the one block
    across it, if any, reads both. The blocks are the list's, so the sums are the general walk's."""
    t, split = pl.program_id(0), pl.program_id(2)
    q_hK = q_ref[...]
    block_h, k = q_hK.shape
    start = t * list_len + split * split_len
    col_K = jnp.arange(k, dtype=jnp.int32)[None, :]

    def rows_from(sources, idx_L, kv_LK):
        for src_ref, base, n in sources:
            local = idx_L - base
            hit = (local >= 0) & (local < n)
            # a masked lane issues no memory access: each row is read from the one source it lives in
            row_L1 = jnp.clip(local, 0, n - 1)[:, None]
            mask_LK = jnp.broadcast_to(hit[:, None], (BLOCK, k))
            # the rows from earlier sources are the masked lanes' value, so each load lands in kv's registers (a
            # separate load and a select held three row blocks live). On the H200 (twenty-fifth session) this took
            # batch 256 from 264-267 to 167-171 us and prefill 8192 from 194.5 to 182.0 ms; at batch 64 (2 splits)
            # four runs gave 58.5-112.6 us against 84.0-88.4 for the select, so there it is no clear gain
            kv_LK = pltriton.load(src_ref.at[row_L1, col_K], mask=mask_LK, other=kv_LK)
        return kv_LK

    def loop_body(sources):
        def block(b, carry):
            acc_hK, den_h, max_h = carry
            idx_L = idx_ref[pl.ds(start + b * BLOCK, BLOCK)]
            kv_LK = rows_from(sources, idx_L, jnp.zeros((BLOCK, k), q_hK.dtype))
            s_hL = jax.lax.dot_general(q_hK, kv_LK, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            s_hL = jnp.where((idx_L >= 0)[None, :], s_hL, -jnp.inf) * scale
            new_max = jnp.maximum(max_h, jnp.max(s_hL, axis=1))
            alpha = jnp.exp(max_h - new_max)
            p_hL = jnp.exp(s_hL - new_max[:, None])
            den_h = den_h * alpha + jnp.sum(p_hL, axis=1)
            pv_hK = jax.lax.dot_general(p_hL.astype(jnp.bfloat16), kv_LK.astype(jnp.bfloat16),
                                        (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            return acc_hK * alpha[:, None] + pv_hK, den_h, new_max
        return block

    carry = (jnp.zeros((block_h, k), jnp.float32), jnp.zeros((block_h,), jnp.float32),
             jnp.full((block_h,), -1e30, jnp.float32))
    blocks = split_len // BLOCK
    bases = np.cumsum((0,) + sizes)[:-1].tolist()
    sources = list(zip(src_refs, bases, sizes))
    if first_ref is None:
        return jax.lax.fori_loop(0, blocks, loop_body(sources), carry)
    first = first_ref[t] - split * split_len  # in this split's lanes
    below = jnp.clip(first // BLOCK, 0, blocks)  # blocks wholly below it
    across = jnp.clip(-(-first // BLOCK), 0, blocks)  # and the one it cuts
    carry = jax.lax.fori_loop(0, below, loop_body(sources[:1]), carry)
    carry = jax.lax.cond(across > below, lambda c: loop_body(sources)(below, c), lambda c: c, carry)
    return jax.lax.fori_loop(across, blocks, loop_body(sources[1:]), carry)


def _first(refs: tuple, has_first: bool) -> tuple:
    """(first_ref or None, the refs after it): a kernel's refs after idx_ref start with first_T's when it has one."""
    return (refs[0], refs[1:]) if has_first else (None, refs)


def _split_kernel(idx_ref, *refs, sizes: tuple[int, ...], has_first: bool, **walk):
    """Several splits: each (token, head group, split) writes its partial sums, merged outside the kernel."""
    first_ref, (q_ref, *refs) = _first(refs, has_first)
    acc_ref, max_ref, den_ref = refs[len(sizes):]
    acc_ref[...], den_ref[...], max_ref[...] = _attend(idx_ref, first_ref, q_ref, refs[:len(sizes)], sizes=sizes,
                                                       **walk)


def _whole_kernel(idx_ref, *refs, sizes: tuple[int, ...], has_first: bool, interpret: bool, **walk):
    """One split: the program holds its token's whole list, so it adds the sink to the denominator and writes the
    bf16 output itself (the merge's weights would all be exp(0) = 1): no fp32 partials, no merge pass."""
    first_ref, (q_ref, sink_ref, *refs) = _first(refs, has_first)
    out_ref = refs[len(sizes)]
    acc_hK, den_h, max_h = _attend(idx_ref, first_ref, q_ref, refs[:len(sizes)], sizes=sizes, **walk)
    den_h = den_h + jnp.exp(sink_ref[...] - max_h)
    out_ref[...] = div_rn(acc_hK, jnp.broadcast_to(den_h[:, None], acc_hK.shape), interpret).astype(out_ref.dtype)


def _dim_splits(config: SparseAttnConfig, programs: int, k: int) -> int:
    """CTAs for each of ``programs`` (token, head group, split) triples over head dim ``k``: the most of
    ``sparse_attn_mgpu.DIM_SPLITS`` up to ``config.mgpu_dim_splits`` that K allows and that keep all of them in one
    wave."""
    fits = [d for d in sparse_attn_mgpu.DIM_SPLITS if d <= config.mgpu_dim_splits
            and programs * d <= config.wave_programs and sparse_attn_mgpu.dim_splits_error(k, d) is None]
    return max(fits, default=1)


def _num_splits(config: SparseAttnConfig, programs: int, blocks: int) -> int:
    """Splits of a list of ``blocks`` blocks for ``programs`` (token, head group) pairs: ``config.num_splits``, or
    as many as fit in one wave; then the fewest that give each split the same number of blocks (no empty split)."""
    splits = config.num_splits if config.num_splits is not None else config.wave_programs // programs
    splits = max(1, min(splits, blocks))
    return -(-blocks // -(-blocks // splits))


@functools.partial(jax.jit, static_argnames=("softmax_scale", "config", "interpret"))
def sparse_attn_pallas(q_THK: jax.Array, kv_sources: tuple[jax.Array, ...], idx_TL: jax.Array, sink_H: jax.Array,
                       softmax_scale: float, *, first_T: jax.Array | None = None,
                       config: SparseAttnConfig | None = None, interpret: bool | None = None) -> jax.Array:
    """The Pallas (Triton) kernel with ``sparse_attn_reference``'s signature and semantics.

    q_THK: bf16 [T, H, K]; kv_sources: 1 to 3 bf16 [N_i, K] arrays addressed as one concatenation; idx_TL: int32
    [T, L] (-1 = none); sink_H: float32 [H]. first_T: None, or with two sources int32 [T], the caller's promise that
    token t's lanes below first_T[t] index only the first source and the rest only the second (``_attend``): the
    blocks on either side then read one source each. The result does not depend on it while the promise holds.
    config: tiling (default the module's ``CONFIG``, which ``tools/bench.py --kernel-setting sparse_attn.CONFIG.X=V``
    sets); interpret: run the kernel in the Pallas interpreter (default: when the backend is not a GPU). Returns bf16
    [T, H, K]. Jitted: the layers of one shape share one trace and lowering.
    """
    config = config or CONFIG
    if not 1 <= len(kv_sources) <= MAX_SOURCES:
        raise ValueError(f"sparse_attn_pallas: kv_sources must hold 1 to {MAX_SOURCES} arrays, got {len(kv_sources)}")
    t, h, k = q_THK.shape
    if first_T is not None and (len(kv_sources) != 2 or first_T.shape != (t,)):
        raise ValueError(f"sparse_attn_pallas: first_T needs 2 kv_sources and shape ({t},), got shape "
                         f"{first_T.shape} with {len(kv_sources)} sources")
    if h < MIN_HEADS:
        q_THK = jnp.pad(q_THK, ((0, 0), (0, MIN_HEADS - h), (0, 0)))
        sink_H = jnp.pad(sink_H, (0, MIN_HEADS - h))
        out = sparse_attn_pallas(q_THK, kv_sources, idx_TL, sink_H, softmax_scale, first_T=first_T, config=config,
                                 interpret=interpret)
        return out[:, :h]
    block_h = min(config.block_h, h)
    if h % block_h:
        raise ValueError(f"sparse_attn_pallas: config.block_h ({config.block_h}) must divide the {h} heads")
    groups = h // block_h
    blocks = max(1, -(-idx_TL.shape[1] // BLOCK))
    splits = _num_splits(config, t * groups, blocks)
    interpret = interpret_mode(interpret)
    if _mgpu_takes(config, t, h, k, len(kv_sources), interpret):
        return sparse_attn_mgpu.sparse_attn_mgpu(q_THK, kv_sources, idx_TL, sink_H, softmax_scale, splits=splits,
                                                 cluster_splits=config.cluster_splits,
                                                 dim_splits=_dim_splits(config, t * groups * splits, k), pdl=config.pdl,
                                                 shared_scores=config.mgpu_shared_scores,
                                                 wide_merge=config.mgpu_wide_merge, trace_dir=config.mgpu_trace_dir)
    split_len = -(-blocks // splits) * BLOCK
    list_len = splits * split_len
    idx_TL = jnp.pad(idx_TL.astype(jnp.int32), ((0, 0), (0, list_len - idx_TL.shape[1])), constant_values=-1)
    walk = dict(sizes=tuple(src.shape[0] for src in kv_sources), split_len=split_len, list_len=list_len,
                scale=float(np.float32(softmax_scale)), has_first=first_T is not None)
    stages = config.num_stages or (2 if len(kv_sources) == 1 or first_T is not None else 1)
    firsts, first_specs = ([first_T.astype(jnp.int32)], [pl.no_block_spec]) if first_T is not None else ([], [])
    call = functools.partial(pl.pallas_call, grid=(t, groups, splits), interpret=interpret, name="sparse_attn",
                             compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=stages))
    q_spec = pl.BlockSpec((None, block_h, k), lambda i, g, s: (i, g, 0))
    sources_specs = [pl.no_block_spec] * len(kv_sources)
    if splits == 1:
        return call(
            functools.partial(_whole_kernel, interpret=interpret, **walk),
            in_specs=[pl.no_block_spec, *first_specs, q_spec, pl.BlockSpec((block_h,), lambda i, g, s: (g,))]
            + sources_specs,
            out_specs=pl.BlockSpec((None, block_h, k), lambda i, g, s: (i, g, 0)),
            out_shape=jax.ShapeDtypeStruct((t, h, k), jnp.bfloat16),
        )(idx_TL.reshape(-1), *firsts, q_THK, sink_H.astype(jnp.float32), *kv_sources)
    acc_TShK, max_TSh, den_TSh = call(
        functools.partial(_split_kernel, **walk),
        in_specs=[pl.no_block_spec, *first_specs, q_spec] + sources_specs,
        out_specs=[pl.BlockSpec((None, None, block_h, k), lambda i, g, s: (i, s, g, 0)),
                   pl.BlockSpec((None, None, block_h), lambda i, g, s: (i, s, g)),
                   pl.BlockSpec((None, None, block_h), lambda i, g, s: (i, s, g))],
        out_shape=[jax.ShapeDtypeStruct((t, splits, h, k), jnp.float32),
                   jax.ShapeDtypeStruct((t, splits, h), jnp.float32),
                   jax.ShapeDtypeStruct((t, splits, h), jnp.float32)],
    )(idx_TL.reshape(-1), *firsts, q_THK, *kv_sources)
    return merge_splits(acc_TShK, max_TSh, den_TSh, sink_H)


def sparse_attn(q_THK: jax.Array, kv_sources: tuple[jax.Array, ...], idx_TL: jax.Array, sink_H: jax.Array,
                softmax_scale: float, *, impl: str = "reference", first_T: jax.Array | None = None) -> jax.Array:
    """Sparse attention with the sink by the chosen implementation: "reference" (jnp) or "pallas" (kernel).

    Shapes and dtypes as ``sparse_attn_reference``: q_THK bf16 [T, H, K], kv_sources bf16 [N_i, K], idx_TL int32
    [T, L] (-1 = none), sink_H float32 [H]. first_T: the kernel's layout promise (``sparse_attn_pallas``); the
    reference does not need it. Returns bf16 [T, H, K].
    """
    if impl == "reference":
        return sparse_attn_reference(q_THK, kv_sources, idx_TL, sink_H, softmax_scale)
    if impl == "pallas":
        return sparse_attn_pallas(q_THK, kv_sources, idx_TL, sink_H, softmax_scale, first_T=first_T)
    raise ValueError(f"sparse_attn: impl must be one of {IMPLS}, got {impl!r}")
