"""Sparse attention with the sink on Hopper's tensor cores (Mosaic GPU): ``sparse_attn_mgpu``.

Status (thirty-first session, on the H200): its GPU tests pass (the first run found a row past the second source
read from the wrong one: ``row_gather.locate`` now, tested on the CPU). GPU parity with it as the engine at every
step: tiny-nodrop's statistics within 2e-5 of the Triton kernel's, tokens and index sets the same; tiny's tier 2
0.669 (>= 0.6). At 640 rows x 512 and 64 heads it took batch 64 in 41.2 us against the Triton kernel's 53.1 (23.7 %
of the gathered-bytes floor) and 256 in 96.6 against 147.3 (40.4 %). Since the forty-seventh session the indices
come from shared memory (below): GPU kernel time on an H100, the model's window + pool layout, 10.0 / 38.3 / 81.9 us
at batch 1 / 64 / 256 against the Triton kernel's 12.6 / 54.3 / 143.5 (36.5 % / 68.3 % of the H100's bytes floor at
64 / 256), so ``sparse_attn.SparseAttnConfig`` runs it at every token count (``mgpu_min_tokens`` 1).

Why: at decode the Triton kernel (``sparse_attn``) runs at 18-28 % of its gathered-bytes floor (docs/benchmarks.md,
twenty-sixth session; issue 13 asks 70 %). It holds one program a multiprocessor, its 64 x 512 fp32 accumulator in
one program's registers, and its row gathers do not overlap its products. Here, as in FlashMLA's structure:
  * a CTA is one (token, split of its list, group of 64 heads) with one compute warpgroup up to K = 256 and two
    above (``warpgroups``); each warpgroup owns its part of the K output dims (a 64 x K/2 fp32 accumulator, 128
    registers a thread at K = 512); warpgroup 0 computes the 64 x 64 score tile and the softmax for both and hands
    P over in shared memory ("Shared scores" below; each warpgroup its own K-half's scores, added through shared
    memory behind one more meeting, was measured twice and never paid, so it is gone);
  * the rows are gathered by the warpgroups' threads themselves with ``cp.async`` (16 bytes a copy), straight into
    wgmma's 128-byte-swizzled shared-memory layout: Mosaic GPU has no gather and a TMA copy cannot address one row
    of a swizzled tile, but an address computed per thread can (``row_gather``);
  * two row slots: block b + 1's copies are in flight while block b's products run. A 64 x 512 row block is 64 KB;
    q (64 KB) and the two slots fill 192 KB of shared memory, one CTA a multiprocessor;
  * each block's 64 indices are copied by TMA into shared memory two blocks ahead (``IDX_SLOTS``: block b - 1's
    slot, free once block b's meeting has passed, takes block b + 2's), so a block's gather reads its row indices
    from shared memory instead of waiting a global load's latency before its first copy;
  * a block's order: one meeting (its rows landed, the block before done with), block b + 2's index copy started,
    then the next block's gather (16 index reads from shared memory, then 16 copies a thread), so that its copies
    are in flight during all of this block's work; then its mask indices, the score products, the softmax and the
    PV product. On an H100 (forty-seventh session, GPU kernel time) this took batch 256 from 88.5 to 81.9 us and
    64 from 40.8 to 38.3; the same index slots with the gather after the score products (the thirty-fourth
    session's order, which hid the global index loads under the products) gave 84.0 and 40.0;
  * an index of -1 copies nothing (``cp.async``'s source size 0 fills the row with zeros) and its score is masked;
  * with one split the kernel adds the sink, divides and writes the bf16 output. Several splits of a list
    (flash-decoding): with a count in ``cluster_splits`` (2, 4 or 8: ``CLUSTER_SIZES``; by default 2 only,
    ``CLUSTER_SPLITS``) a token's splits are one thread-block cluster, and each CTA leaves its fp32 partial sums in
    its own shared memory; after the cluster's meeting, CTA s reads its 1 / S of every warpgroup's output dims from
    every CTA's shared memory (``cluster``), merges them in split order with the sink as
    ``flash_merge.merge_splits`` does, and writes that part of the bf16 output. Before, at batch 64 the
    two splits' partials (16.8 MB of fp32) went through memory to two XLA fusions, ~11 of 38.3 us on an H100
    (Nsight Compute, forty-seventh session); on the H200 batch 64 now takes 27.7 us against 31.3 (GPU kernel
    time, forty-eighth session). Other split counts (and interpret mode, which has no distributed shared memory)
    write the partials and merge them in XLA (``flash_merge``), as the Triton kernel does;
  * no shared-memory bank conflicts in the cluster merge (fifty-sixth session): its fp32 tiles have their rows
    padded 8 banks apart (``cluster.tiles_shape``). Until then they were row-major with rows a multiple of 128 bytes
    apart, for which Mosaic GPU finds no conflict-free order (``plan_tiled_transfer``): the WGMMA layout's 8 rows of
    a transfer all fell in the same banks. (The arrays copied out by TMA need nothing: Mosaic GPU's layout inference
    gives their shared memory swizzled tiles, as the built PTX shows.) The merge's leaving meeting is split
    (``cluster.arrive`` after the last read of a peer's memory, ``cluster.wait`` after the output's copy), so the
    write overlaps the wait.

Tried and removed (fifty-fourth session, an H100, GPU kernel time at batch 64 / 256, 640 rows x 512): the two
warpgroups taking turns on the tensor cores (jax's Hopper flash-attention order: one softmax a block under the other
warpgroup's products), 30.3 / 83.7 us against 30.0 / 81.5; and a block's rows gathered in two 32-row pieces into a
ring of five slots (one piece always in flight across a meeting, where Nsight Compute put ~35-40 % of the warps'
stalls on the gathered rows' dependencies), 36.1 / 100.3 against 30.1 / 82.3: its 64 x 32 score products read q
from shared memory twice as often a FLOP (a wgmma with both operands in shared memory is bound by its bandwidth
below N = 64; the PV products of K = 32 also needed the 64-byte swizzle), ~1 us a block more, and the longer lead
bought nothing visible under it. A third 64-row slot does not fit beside q's 64 KB (256 KB against 227).

Pushed merge tiles (fifty-ninth session, same card and timing): each CTA, after one more cluster meeting, stored
the tiles its peers merge straight into their shared memory (``st.shared::cluster``, which waits for no answer) and
merged from its own, its running max and denominator pushed the same way (so no leaving meeting either). The same
bits (its GPU tests), but batch 64 took 28.2 against 27.9 us: the timeline gave the pushed stores ~7,000 clocks,
what the pulled reads cost (~7,900). The cluster's traffic is bound by its bandwidth (~64 KB a CTA in ~7,000
clocks, ~9 bytes a clock a multiprocessor), not by the loads' latency, whichever side moves it.

Wide merge (``wide_merge``, sixtieth session; built for sm_90, not yet run on a GPU, so off): the cluster merge
reads the tiles 16 bytes a load instead of 8 (``cluster.merge_tiles``: a layout of 4 consecutive fp32 a thread, the
tiles' rows padded 16 banks apart), weighs, adds and divides them in the same order, and turns the bf16 result back
into the WGMMA layout for the output's store. At batch 64 the build has the same 233 registers, no spill, and 2,448
SASS instructions against 2,240. The fifty-ninth session put the merge's ~64 KB a CTA at ~9 bytes a clock with
8-byte accesses; whether wider ones move more is what ``gpu_validate.sh wide-merge`` measures.

Shared scores (``shared_scores``, the default since the fifty-fifth session): unshared, each of two warpgroups
computes the whole 64 x 64 score tile and the softmax, so a block's tensor-core work is 2 x 1,024 clocks of score
products (both operands in shared memory) and 2 x 1,024 of PV products; the rows in two pieces, whose score products
cost ~1,000 clocks more a block, took ~1 us more a block (fifty-fourth session), so the block is bound by that work.
Shared, warpgroup 0 alone computes the scores and the softmax, stores P (bf16, 8 KB) and alpha into shared memory,
keeps the running max and denominator there, and arrives on a barrier both warpgroups wait on; each then rescales
its accumulator and issues its PV product with P from shared memory. A block's tensor work drops to ~3,000 clocks
for an 8 KB store and one barrier. Every value is the same as unshared: the same products in the same order, P the
same bf16 values (A from shared memory instead of registers). On an H100 (fifty-fifth session, GPU kernel time, the
prefill layout, window + pool, at 640 rows x 512) batch 64 took 29.2 us against 30.1 unshared and batch 256 78.4
against 81.6; batch 1 10.2 both. The kernel's timeline (``trace_dir``) then says where the rest goes: at batch
256 a block's scores and softmax were ~3,500 of its ~5,900 marked clocks unshared; at batch 64 the cluster merge at
the end (the "output" region) took ~16,000 clocks, 31 % of a CTA's span, against ~4,000 for one split's output at
batch 256. Without its bank conflicts (fifty-sixth session, same card and layout) it takes ~12,600 and batch 64
27.8 us (50.3 % of the floor; the decode step's three sources 27.9): of it, storing the tiles ~1,100 clocks, the
meeting ~1,700, reading and merging ~7,800 (half the tiles it reads are in the peer's shared memory), writing ~1,700
(docs/benchmarks.md).

Split output dims (``dim_splits``, fifty-seventh session): a (token, split, head group) may run as D CTAs, CTA d
writing columns [d K/(P D), (d + 1) K/(P D)) of each warpgroup's K/P output dims. Each gathers the split's whole
rows (the scores need every dim; the D copies of a row are read from L2 after the first) and computes the scores
and softmax itself; only its PV products are 1 / D as wide (N = K/(P D): a slice of whole 64-column tiles of the
warpgroup's K-part of the slot). The values are the same bits: the same products for each output element. It adds
CTAs where the list's splits leave the machine idle: on an H100 (GPU kernel time, 640 rows x 512, 64 heads, window
+ pool) batch 1, ten splits of one block, took 10.0 us with one CTA a split, 8.3 with 2 and 7.2 with 4. Where the
splits already fill a wave it does not pay: at batch 64, two dim splits of one list split took 29.5 us against 27.8
for the list's two splits merged in a cluster (the rows' second reads from L2, and the scores twice).

Numerics: the reference's walk, block for block (``sparse_attn`` module docstring): blocks of 64 indices, the fp32
online softmax from a running max of -1e30, P cast to bf16 for the PV product, the sink in the denominator only.
The scores are the wgmma K-parts added in fp32 (another summation order than the reference's einsum, as the
Triton kernel's dot).

The shared-memory layout: rows [slot, part, row, K/P] (P warpgroups) with the tiling (8, 64) and the 128-byte
swizzle, so that ``.at[slot, part]`` is a plain leading-index view (a warpgroup's B operand of the PV product, and
one K-part of the scores' B operand). Element (row r, dim d) of a slot lies at byte ``part * 64 * (K/P) * 2 + ((r //
8) * (K/P / 64) + d' // 64) * 1024 + (r % 8) * 128 + ((d' % 64) // 8 XOR r % 8) * 16 + (d' % 8) * 2`` with part = d
// (K/P) and d' = d mod K/P: Mosaic GPU's swizzle (its ``transfer_tiled``: a 16-byte chunk's index XOR the 128-byte
line's index in its 1024-byte group).

Interpret mode: the interpreter runs no ``inline_mgpu``, so there the rows are gathered in XLA before the kernel
([T, L, K]) and each warpgroup stores its K-part of a block's rows into the slot where the GPU's threads start their
copies; everything else (the slots and the meetings that guard them, both products, the softmax, the stores, the
merge) is the kernel's. Its race detector (``detect_races``) checks the slots' protocol: it finds no race, and one
when the meeting before a slot is refilled is left out (loads stand for wgmma's operand reads, which it does not
see). The interpreter also takes wgmma's A operand only from shared memory, so P
goes through a scratch tile, and has no accumulator initialised from registers, so the PV product goes into a fresh
one added to the running sum.

Letters: T query tokens, H heads, K head dim, L list length, S splits of the list, N rows of a KV source.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dijax.kernels import cluster, flash_merge, row_gather
from dijax.kernels.fp4_wgmma import COL_LAYOUT, ROW_LAYOUT, available
from dijax.kernels.row_gather import ROWS, TILED, WARPGROUP

HEADS = 64  # heads a CTA: wgmma's M (ROWS, the rows a block, is the reference's block and the scores' wgmma N)
MAX_PART = 256  # output dims a warpgroup: a 64 x 256 fp32 accumulator is 128 registers a thread (and wgmma's N)
SLOTS = 2
# index blocks in shared memory: b - 1's (free once block b's meeting is passed), b's (its mask) and b + 1's (its
# gather); block b + 2's is copied by TMA while block b runs
IDX_SLOTS = 3
MAX_SOURCES = 3
# split counts that can merge in the kernel, across a cluster of CTAs (each writes its 1 / S of every warpgroup's
# output dims: a cluster holds at most 8 CTAs, and a slice stays a whole number of 8-column WGMMA tiles), and those
# that do by default: 4 works too but lost on the H200 (forty-eighth session, GPU kernel time, 640 rows x 512: batch
# 32 47.3 us with 4 splits in clusters of 4 against 27.0 with 3 merged in XLA, batch 1 23.2 against 18.7). At batch
# 32 the 32 clusters of 4 do not fit at once: Nsight Compute gives 30 active clusters of 4 at most (66 pairs; H100,
# forty-ninth session), so two run in a second round (docs/mosaic_gpu.md)
CLUSTER_SIZES = (2, 4, 8)
CLUSTER_SPLITS = (2,)
DIM_SPLITS = (1, 2, 4, 8)  # CTAs a (token, split, head group) can share its output dims among (``dim_splits``)


def shape_error(h: int, k: int, n_sources: int) -> str | None:
    """Why the kernel cannot take H = ``h`` heads of dim K = ``k`` over ``n_sources`` sources (None when it can)."""
    if not 1 <= n_sources <= MAX_SOURCES:
        return f"sparse_attn_mgpu: kv_sources must hold 1 to {MAX_SOURCES} arrays, got {n_sources}"
    if k not in HEAD_DIMS:
        return f"sparse_attn_mgpu: K must be one of {HEAD_DIMS}, got {k}"
    if h > HEADS and h % HEADS:
        return f"sparse_attn_mgpu: H must be at most {HEADS} or a multiple of it, got {h}"
    return None


def merges_in_cluster(splits: int, interpret: bool | plgpu.InterpretGPUParams,
                      cluster_splits: tuple[int, ...] = CLUSTER_SPLITS) -> bool:
    """Whether ``splits`` splits of a list are merged in the kernel, across a cluster (module docstring): when they
    are one of ``cluster_splits``, not interpreted (the interpreter has no distributed shared memory, so there they
    go through XLA, ``flash_merge``)."""
    return not interpret and splits in cluster_splits


def cluster_splits_error(cluster_splits: tuple[int, ...]) -> str | None:
    """Why ``cluster_splits`` cannot be merged across clusters (None when it can)."""
    if not set(cluster_splits) <= set(CLUSTER_SIZES):
        return f"cluster_splits must hold split counts from {CLUSTER_SIZES}, got {tuple(cluster_splits)}"
    return None


def dim_splits_error(k: int, dim_splits: int) -> str | None:
    """Why a CTA cannot write 1 / ``dim_splits`` of head dim ``k``'s output dims (None when it can): each
    warpgroup's share must stay a whole number of the 64-column tiles its rows are stored in."""
    allowed = [d for d in DIM_SPLITS if (k // warpgroups(k)) % (64 * d) == 0]
    if dim_splits not in allowed:
        return f"dim_splits must be one of {allowed} at K = {k}, got {dim_splits}"
    return None


def warpgroups(k: int) -> int:
    """Compute warpgroups a CTA for head dim ``k``: one up to ``MAX_PART`` dims, else two (each K / 2)."""
    return 1 if k <= MAX_PART else 2


# head dims of one or two warpgroups whose rows the gathering threads split evenly (row_gather.widths)
HEAD_DIMS = tuple(k for k in range(64, 2 * MAX_PART + 1, 64) if k in row_gather.widths(warpgroups(k) * WARPGROUP))


def sparse_attn_mgpu(q_THK: jax.Array, kv_sources: tuple[jax.Array, ...], idx_TL: jax.Array, sink_H: jax.Array,
                     softmax_scale: float, *, splits: int = 1, cluster_splits: tuple[int, ...] = CLUSTER_SPLITS,
                     dim_splits: int = 1, pdl: bool = False, shared_scores: bool = True, wide_merge: bool = False,
                     trace_dir: str = "", interpret: bool | plgpu.InterpretGPUParams = False) -> jax.Array:
    """``sparse_attn.sparse_attn_reference`` on one Mosaic GPU kernel (a GPU of compute capability 9.0; module
    docstring); with several splits not merged in the kernel, their merge in XLA.

    q_THK: bf16 [T, H, K]; kv_sources: 1 to 3 bf16 [N_i, K] arrays addressed as one concatenation; idx_TL: int32
    [T, L] (-1 = none); sink_H: float32 [H]; ``splits``: parts of each list (each a whole number of blocks of 64),
    one CTA each; ``cluster_splits``: the split counts merged in the kernel across a cluster (from
    ``CLUSTER_SIZES``), the others in XLA. ``dim_splits``: CTAs a (token, split, head group), each computing the
    scores over the whole rows and writing 1 / ``dim_splits`` of the output dims (module docstring, "Split output
    dims"; ``dim_splits_error`` says which counts a K takes). ``shape_error`` lists the shapes it takes; fewer than
    64 heads are padded with zero queries. ``pdl``: launch as a programmatic dependent, its CTAs free to start while
    the kernel before it still runs (not when interpreted). ``shared_scores``: with two warpgroups, warpgroup 0
    alone computes each block's scores and softmax and hands P to both through shared memory (module docstring,
    "Shared scores"); the same arithmetic. ``wide_merge``: the cluster merge reads its tiles 16 bytes a load
    (``cluster.merge_tiles``) where each CTA's share of a warpgroup's output dims is a multiple of
    ``cluster.WIDE_COLUMNS`` wide; the same arithmetic. ``trace_dir``: record a timeline of each warpgroup's steps
    (Mosaic GPU's on-device profiler: the clock at each named region's start and end) and write it to this
    directory, one Chrome trace a call (tools/kernel_regions.py sums it up); not when interpreted. ``interpret``: run
    in the Mosaic GPU interpreter (rows gathered in XLA: module docstring), with its default parameters or the
    ``InterpretGPUParams`` given (``detect_races=True``: its happens-before race detector).
    -> bf16 [T, H, K].
    """
    t, h, k = q_THK.shape
    error = (shape_error(h, k, len(kv_sources)) or cluster_splits_error(cluster_splits)
             or dim_splits_error(k, dim_splits))
    if error:
        raise ValueError(error)
    heads = -(-h // HEADS) * HEADS
    q_THK = jnp.pad(q_THK, ((0, 0), (0, heads - h), (0, 0)))
    blocks = max(1, -(-idx_TL.shape[1] // ROWS))
    splits = max(1, min(splits, blocks))
    split_len = -(-blocks // splits) * ROWS
    idx_TL = jnp.pad(idx_TL.astype(jnp.int32), ((0, 0), (0, splits * split_len - idx_TL.shape[1])),
                     constant_values=-1)
    gathered = ()
    if interpret:  # the rows gathered in XLA (module docstring): an index outside the sources gives zeros
        rows = sum(src.shape[0] for src in kv_sources)
        rows_TLK = jnp.concatenate(kv_sources)[jnp.clip(idx_TL, 0, rows - 1)]
        gathered = (jnp.where(((idx_TL >= 0) & (idx_TL < rows))[..., None], rows_TLK, 0).astype(jnp.bfloat16),)
    sink_H = jnp.pad(sink_H.astype(jnp.float32), (0, heads - h))
    in_cluster = merges_in_cluster(splits, interpret, tuple(cluster_splits))
    out = _call(q_THK, idx_TL.reshape(-1), tuple(kv_sources), sink_H, *gathered, split_len=split_len,
                scale=float(np.float32(softmax_scale)), in_cluster=in_cluster, dim_splits=dim_splits,
                pdl=pdl and not interpret, shared=shared_scores and warpgroups(k) == 2,
                wide_merge=wide_merge and in_cluster,
                trace_dir="" if interpret else trace_dir, interpret=interpret)
    if splits == 1 or in_cluster:
        return out[:, :h]
    return flash_merge.merge_splits(*out, sink_H)[:, :h]


@functools.partial(jax.jit, static_argnames=("split_len", "scale", "in_cluster", "dim_splits", "pdl", "shared",
                                             "wide_merge", "trace_dir", "interpret"))
def _call(q_THK, idx_X, sources, sink_H, gathered_TLK=None, *, split_len: int, scale: float, in_cluster: bool,
          dim_splits: int, pdl: bool, shared: bool, wide_merge: bool, trace_dir: str,
          interpret: bool | plgpu.InterpretGPUParams):
    """The kernel over the flat lists ``idx_X`` (int32 [T * L]), ``split_len`` indices a (token, split, head
    group) CTA. Several splits: their fp32 partial sums acc [T, S, H, K], running max and denominator [T, S, H].
    One, or several merged ``in_cluster``: the output itself, bf16 [T, H, K] (the sink added to the denominator and
    the division in the kernel, as ``flash_merge.merge_splits`` does them: no partials go through memory)."""
    t, h, k = q_THK.shape
    splits = idx_X.shape[0] // t // split_len
    list_len = splits * split_len
    wgs = warpgroups(k)
    half = k // wgs  # a warpgroup's part of K: of q and the rows in shared memory
    out_part = half // dim_splits  # a warpgroup's part of the output dims in a CTA (of its K-part's columns)
    width = out_part // splits  # in a cluster, the output dims a CTA merges (of a warpgroup's out_part)
    wide_merge = wide_merge and width % cluster.WIDE_COLUMNS == 0
    blocks = split_len // ROWS
    sizes = tuple(src.shape[0] for src in sources)
    n_src = len(sources)
    # a warpgroup's steps, timed: those of each block, and those entered once (the cluster merge's parts are
    # regions inside "output")
    block_regions = ("meeting", "gather", "scores", "softmax", "pv")
    once_regions = ("start", "output", "cluster_store", "cluster_meet", "cluster_merge", "cluster_write",
                    "cluster_leave")
    regions = block_regions + once_regions

    def region(name: str):
        """One of ``regions``: a named scope, which Mosaic GPU's profiler times, with a ``trace_dir``; else nothing
        (the kernel's code is then the same as without the regions)."""
        assert name in regions
        return jax.named_scope(name) if trace_dir else contextlib.nullcontext()

    def kernel(q_gmem, idx_gmem, *refs):
        if pdl:  # launched as a programmatic dependent: wait here until the kernel before it has finished and its
            plgpu.griddepcontrol_wait()  # writes are visible (Mosaic GPU then marks the kernel ``uses_pdl``)
        src_gmems, (sink_gmem, *refs) = refs[:n_src], refs[n_src:]
        gathered_gmem = refs.pop(0) if interpret else None
        ti, si = lax.axis_index("t"), lax.axis_index("s")
        gi, di = lax.div(lax.axis_index("g"), dim_splits), lax.rem(lax.axis_index("g"), dim_splits)
        wg = lax.axis_index("wg")
        start = ti * list_len + si * split_len  # this split's first index in idx_X

        def load_indices(b, idx_smem, idx_bar):
            """Start the TMA copy of block b's indices into their slot (by warpgroup 0; nothing past the list)."""
            @pl.when((wg == 0) & (b < blocks))
            def _():
                slot = lax.rem(b, IDX_SLOTS)
                plgpu.copy_gmem_to_smem(idx_gmem.at[pl.ds(start + b * ROWS, ROWS)], idx_smem.at[slot],
                                        idx_bar.at[slot])

        def fetch(b, slot, kv_smem, idx_smem, idx_bar):
            """Wait for block b's indices, then start its row copies into ``slot`` (interpret mode: each warpgroup
            stores its K-part of the gathered rows at once, the threads' copies done early)."""
            idx_slot = lax.rem(b, IDX_SLOTS)
            plgpu.barrier_wait(idx_bar.at[idx_slot])
            if interpret:
                rows = pl.ds(si * split_len + b * ROWS, ROWS)
                kv_smem.at[slot, wg][...] = gathered_gmem.at[ti, rows, pl.ds(wg * half, half)][...]
            else:
                row_gather.gather_rows(idx_smem.at[idx_slot], *src_gmems, kv_smem.at[slot], sizes=sizes,
                                       threads=wgs * WARPGROUP)

        def landed(cta_bar):
            """The block's one meeting: every thread's copies of it are in shared memory, seen by wgmma (each
            thread has only this block's copies in flight), and every thread is done with the block before, whose
            slot the next block's gather then takes."""
            row_gather.wait_group(0, interpret)
            plgpu.commit_smem()  # its writes made visible to wgmma's async proxy; the warpgroup synced
            _cta_sync(cta_bar)

        def begin(q_smem, kv_smem, idx_smem, q_bar, idx_bar):
            """The first blocks' indices and q copied in, block 0's gather started; q landed."""
            load_indices(0, idx_smem, idx_bar)
            load_indices(1, idx_smem, idx_bar)

            @pl.when(wg == 0)
            def _():
                for part in range(wgs):
                    plgpu.copy_gmem_to_smem(q_gmem.at[ti, pl.ds(gi * HEADS, HEADS), pl.ds(part * half, half)],
                                            q_smem.at[part], q_bar)
            fetch(0, 0, kv_smem, idx_smem, idx_bar)
            row_gather.commit_group(interpret)
            plgpu.barrier_wait(q_bar)

        def walk(q_smem, kv_smem, idx_smem, p_smem, q_bar, idx_bar, cta_bar, p_bar, stats_smem):
            with region("start"):
                begin(q_smem, kv_smem, idx_smem, q_bar, idx_bar)

            def meet_and_gather(b, slot):
                with region("meeting"):
                    landed(cta_bar)
                with region("gather"):
                    load_indices(b + 2, idx_smem, idx_bar)  # into block b - 1's slot, which every thread is done with

                    @pl.when(b + 1 < blocks)  # the next block's gather, in flight during all of this block's work
                    def _():
                        fetch(b + 1, 1 - slot, kv_smem, idx_smem, idx_bar)
                    row_gather.commit_group(interpret)

            def scores(b, slot):
                """The block's mask indices and the whole 64 x 64 score tile (wgmma over every K-part)."""
                def product(s_ref):
                    for part in range(wgs):
                        plgpu.wgmma(s_ref, q_smem.at[part], kv_smem.at[slot, part].T)
                    return s_ref[...]

                with region("scores"):
                    idx = plgpu.load(idx_smem.at[lax.rem(b, IDX_SLOTS)], layout=COL_LAYOUT, optimized=False)
                    return idx, pl.run_scoped(product, plgpu.ACC((HEADS, ROWS), jnp.float32))

            def softmax(idx, s, max_h, den_h, acc=None):
                """The online softmax's step: -> (P in bf16, alpha, the new running max and denominator, the
                accumulator rescaled by alpha (None without one))."""
                with region("softmax"):
                    valid = lax.broadcast_in_dim(idx >= 0, (HEADS, ROWS), [1])
                    s = jnp.where(valid, s, -jnp.inf) * np.float32(scale)
                    new_max = jnp.maximum(max_h, s.max(axis=1))
                    alpha = jnp.exp(max_h - new_max)
                    p = jnp.exp(s - lax.broadcast_in_dim(new_max, s.shape, [0]))
                    den_h = den_h * alpha + p.sum(axis=1)
                    if acc is not None:
                        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    return p.astype(jnp.bfloat16), alpha, new_max, den_h, acc

            def block(b, carry):
                acc, max_h, den_h = carry
                slot = lax.rem(b, SLOTS)
                meet_and_gather(b, slot)
                if shared:  # warpgroup 0 alone: the scores and softmax, P and the statistics through shared memory
                    @pl.when(wg == 0)
                    def _():
                        idx, s = scores(b, slot)
                        stats = [plgpu.load(stats_smem.at[i], layout=ROW_LAYOUT, optimized=False) for i in (0, 1)]
                        p16, alpha, new_max, new_den, _ = softmax(idx, s, *stats)
                        p_smem.at[0][...] = p16
                        stats_smem.at[0][...] = new_max
                        stats_smem.at[1][...] = new_den
                        stats_smem.at[2][...] = alpha
                        plgpu.commit_smem()  # P seen by either warpgroup's wgmma
                        plgpu.barrier_arrive(p_bar)
                    plgpu.barrier_wait(p_bar)
                    alpha = plgpu.load(stats_smem.at[2], layout=ROW_LAYOUT, optimized=False)
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    p16, new_max = None, max_h  # P in shared memory (``pv``); the statistics stay there
                else:
                    idx, s = scores(b, slot)
                    p16, alpha, new_max, den_h, acc = softmax(idx, s, max_h, den_h, acc)
                if interpret and not shared:  # the interpreter takes A from shared memory only
                    p_smem.at[wg][...] = p16
                    p16 = p_smem.at[wg]

                def pv(acc_ref):  # (P's slot indexed here: a ref indexed outside would be one of run_state's operands)
                    rows_ref = kv_smem.at[slot, wg]
                    if dim_splits > 1:  # this CTA's columns of the warpgroup's K-part: whole 64-column tiles
                        rows_ref = rows_ref.at[:, pl.ds(pl.multiple_of(di * out_part, out_part), out_part)]
                    plgpu.wgmma(acc_ref, p_smem.at[0] if shared else p16, rows_ref)

                def pv_alone(acc_ref):
                    pv(acc_ref)
                    return acc_ref[...]

                if interpret:  # the interpreter has no accumulator initialised from registers (``ACC.init``)
                    acc = acc + pl.run_scoped(pv_alone, plgpu.ACC((HEADS, out_part), jnp.float32))
                    # its race detector does not see wgmma's operand reads: these loads stand for them
                    for part in range(wgs):
                        kv_smem.at[slot, part][...]
                    if shared:
                        p_smem.at[0][...]
                else:
                    with region("pv"):
                        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                return acc, new_max, den_h

            init = (plgpu.layout_cast(jnp.zeros((HEADS, out_part), jnp.float32), plgpu.Layout.WGMMA),
                    plgpu.layout_cast(jnp.full((HEADS,), -1e30, jnp.float32), ROW_LAYOUT),
                    plgpu.layout_cast(jnp.zeros((HEADS,), jnp.float32), ROW_LAYOUT))
            if not shared:
                return lax.fori_loop(0, blocks, block, init)

            @pl.when(wg == 0)  # the running max and denominator start in shared memory (seen after block 0's meeting)
            def _():
                stats_smem.at[0][...] = init[1]
                stats_smem.at[1][...] = init[2]
            acc = lax.fori_loop(0, blocks, block, init)[0]
            # every warpgroup has waited for the last block's P, after the statistics were stored
            return acc, *[plgpu.load(stats_smem.at[i], layout=ROW_LAYOUT, optimized=False) for i in (0, 1)]

        acc, max_h, den_h = pl.run_scoped(
            walk,
            q_smem=plgpu.SMEM((wgs, HEADS, half), jnp.bfloat16, transforms=TILED),
            kv_smem=plgpu.SMEM((SLOTS, wgs, ROWS, half), jnp.bfloat16, transforms=TILED),
            idx_smem=plgpu.SMEM((IDX_SLOTS, ROWS), jnp.int32),
            p_smem=(plgpu.SMEM((wgs, HEADS, ROWS), jnp.bfloat16, transforms=TILED) if interpret or shared
                    else None),
            # shared scores: P's arrival (warpgroup 0's), and the running max, denominator and alpha
            p_bar=plgpu.Barrier(num_arrivals=1) if shared else None,
            stats_smem=plgpu.SMEM((3, HEADS), jnp.float32) if shared else None,
            q_bar=plgpu.Barrier(num_arrivals=wgs),  # a copy a K-half
            idx_bar=plgpu.Barrier(num_barriers=IDX_SLOTS),
            cta_bar=plgpu.Barrier(num_arrivals=wgs),
            collective_axes="wg")

        rows, cols = pl.ds(gi * HEADS, HEADS), pl.ds(wg * half + di * out_part, out_part)

        def store_partials(o_smem, stats_smem):
            acc_gmem, max_gmem, den_gmem = refs
            o_smem.at[wg][...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[wg], acc_gmem.at[ti, si, rows, cols])

            # both warpgroups hold the same running max and denominator, and so do a head group's CTAs (dim_splits)
            @pl.when((wg == 0) & (di == 0))
            def _():
                stats_smem.at[0][...] = max_h
                stats_smem.at[1][...] = den_h
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(stats_smem.at[0], max_gmem.at[ti, si, rows])
                plgpu.copy_smem_to_gmem(stats_smem.at[1], den_gmem.at[ti, si, rows])
            plgpu.wait_smem_to_gmem(0)

        def sink_term(running_max):
            """The sink's part of the denominator, exp(sink - running max), for this CTA's heads."""
            return jnp.exp(plgpu.load(sink_gmem.at[rows], layout=ROW_LAYOUT, optimized=False) - running_max)

        def write_output(o_smem, out16, out_cols):
            """The bf16 ``out16`` through this warpgroup's ``o_smem`` tile into the output's ``out_cols``."""
            [out_gmem] = refs
            o_smem.at[wg][...] = out16
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[wg], out_gmem.at[ti, rows, out_cols])
            plgpu.wait_smem_to_gmem(0)

        def divided(acc_sums, den):
            """acc_sums / den (a row each) as bf16."""
            return (acc_sums / lax.broadcast_in_dim(den, acc_sums.shape, [0])).astype(jnp.bfloat16)

        def store_output(o_smem):
            write_output(o_smem, divided(acc, den_h + sink_term(max_h)), cols)

        def merge_in_cluster(o_smem, max_smem, den_smem, out_smem):
            """Each CTA's partials into its own shared memory (``cluster``: o as S tiles of its warpgroup's output
            dims); after the cluster's meeting, CTA s reads tile s of every CTA (in split order), merges them as
            ``flash_merge.merge_splits`` does and writes that 1 / S of the warpgroup's output dims."""
            with region("cluster_store"):
                cluster.store_tiles(acc, o_smem.at[wg])

                @pl.when(wg == 0)  # both warpgroups hold the same running max and denominator
                def _():
                    max_smem[...] = max_h
                    den_smem[...] = den_h
            with region("cluster_meet"):
                cluster.sync()
            with region("cluster_merge"):
                maxes = [plgpu.load(plgpu.cluster_ref(max_smem, {"s": p}), layout=ROW_LAYOUT, optimized=False)
                         for p in range(splits)]
                running = functools.reduce(jnp.maximum, maxes)
                weights = [jnp.exp(max_p - running) for max_p in maxes]
                den = sink_term(running)
                for p, weight in enumerate(weights):
                    den_p = plgpu.load(plgpu.cluster_ref(den_smem, {"s": p}), layout=ROW_LAYOUT, optimized=False)
                    den = den + den_p * weight
                if wide_merge:
                    out16 = cluster.merge_tiles(o_smem.at[wg], weights, den, width)
                else:
                    merged = None
                    for p, weight in enumerate(weights):
                        part = (cluster.load_peer_tile(o_smem.at[wg], p, width)
                                * lax.broadcast_in_dim(weight, (HEADS, width), [0]))
                        merged = part if merged is None else merged + part
                    out16 = divided(merged, den)
                cluster.arrive()  # done reading the others' shared memory: they may leave once all have arrived
            with region("cluster_write"):
                write_output(out_smem, out16, pl.ds(wg * half + di * out_part + si * width, width))
            with region("cluster_leave"):
                cluster.wait()  # no CTA leaves while another still reads its shared memory

        with region("output"):
            if splits == 1:
                pl.run_scoped(store_output, plgpu.SMEM((wgs, HEADS, out_part), jnp.bfloat16), collective_axes="wg")
            elif in_cluster:
                pl.run_scoped(merge_in_cluster,
                              o_smem=plgpu.SMEM(
                                  (wgs, *cluster.tiles_shape(splits, HEADS, width, wide=wide_merge)),
                                  jnp.float32),
                              max_smem=plgpu.SMEM((HEADS,), jnp.float32), den_smem=plgpu.SMEM((HEADS,), jnp.float32),
                              out_smem=plgpu.SMEM((wgs, HEADS, width), jnp.bfloat16),
                              collective_axes="wg")
            else:
                pl.run_scoped(store_partials, o_smem=plgpu.SMEM((wgs, HEADS, out_part), jnp.float32),
                              stats_smem=plgpu.SMEM((2, HEADS), jnp.float32), collective_axes="wg")

    out_type = (jax.ShapeDtypeStruct((t, h, k), jnp.bfloat16) if splits == 1 or in_cluster else
                (jax.ShapeDtypeStruct((t, splits, h, k), jnp.float32),
                 jax.ShapeDtypeStruct((t, splits, h), jnp.float32), jax.ShapeDtypeStruct((t, splits, h), jnp.float32)))
    run = plgpu.kernel(
        kernel,
        out_type=out_type,
        # in a cluster, the splits are its CTAs ("s" their index in it)
        # a head group's CTAs along "g", one a part of the output dims (``dim_splits``)
        grid=(t, h // HEADS * dim_splits) if in_cluster else (t, splits, h // HEADS * dim_splits),
        grid_names=("t", "g") if in_cluster else ("t", "s", "g"),
        cluster=(splits,) if in_cluster else (), cluster_names=("s",) if in_cluster else (),
        num_threads=wgs, thread_name="wg",
        # with a trace: room for every region a warpgroup enters, Mosaic GPU's own "Init" and one more for the
        # buffer's 3-entry header (``profile_space`` counts regions of 4 entries: a begin and an end of two each;
        # 16 bytes a region a warpgroup, in shared memory); an overflow drops events, and the trace's reader fails
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
            **(dict(profile_space=len(block_regions) * blocks + len(once_regions) + 2, profile_dir=trace_dir,
                    profile_bounds_check=True) if trace_dir else {})),
        interpret=row_gather.interpreter(interpret))
    return run(q_THK, idx_X, *sources, sink_H, *(() if gathered_TLK is None else (gathered_TLK,)))


def _cta_sync(cta_bar) -> None:
    """The CTA's compute warpgroups meet (an mbarrier of one arrival a warpgroup)."""
    plgpu.barrier_arrive(cta_bar)
    plgpu.barrier_wait(cta_bar)
