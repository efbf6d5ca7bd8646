"""Lightning-indexer scores on Hopper's tensor cores (Mosaic GPU): ``index_scores_mgpu``.

Status: its GPU tests pass (within 1 ulp of the reference at the real 32 heads x 128). At prefill 8192 x 2048 it
took 433 us on the H200 against the Triton kernel's 496 (thirty-first session); on an H100 in the fiftieth session
408.4 us (21.3 % of the tensor-core floor), of it the kernel 239.6 and the XLA pick 141.2, and after that session's
changes (the rounding chain on bf16 pairs, dead blocks skipped) 326.9 us (26.6 %), the kernel 158.1 (issue 13 asks
50 %). In the fifty-first session (H100, one run, GPU kernel time): 349.1 us as by default (the kernel 161.8, the XLA
pick and transpose 157.2), 207.2 with the kernel writing the rows itself (the kernel 177.5, nothing to pick),
184.7 so with one compute warpgroup a CTA (47.0 % of the floor; the kernel 154.9), every score within 1 ulp. In the
fifty-second session both became its only form and the default (its GPU tests pass once no store crosses P: 21
passed on an H100), and the tiles' table lost its cumulative sums: 165.7 us (52.4 %), the kernel 151.2, XLA ~15.
``indexer.IndexerConfig.engine='mgpu'`` is the default; it takes prefill-shaped steps only.
The parity fixtures' 32-wide index heads are below its smallest J (64), so GPU parity does not reach it.

Why: issue 13 asks the indexer at prefill for 50 % of the tensor cores' peak. The Triton kernel (``indexer``) runs
one token a program: a [I, J] x [J, 128] product (I = 32 heads), its keys gathered again for every token.
Here a CTA takes a tile of up to ``TOKENS`` consecutive tokens of one sequence (``tiles``), so each gathered key
block serves them all, as wgmma's A operand (64 positions, swapped so that the tokens' heads are its N = 8 I):
  * the scores' product: keys [64, J] (gathered by ``row_gather`` into a swizzled tile) x queries [J, 8 I] (the
    tile's query rows, by TMA) -> fp32 [64, 8 I];
  * the reference's rounding chain in registers, on bf16 pairs: the scores rounded to bf16 (one packed convert a
    pair), ReLU and the head weight's product (one ``max`` and one ``mul`` of bf16x2 a pair: the product of two
    bf16 values is exact in fp32, so rounding it once to bf16 gives the reference's fp32 product rounded to bf16).
    In fp32 the chain was single converts, a shift back to fp32, a max and a multiply per element: 1232 SASS
    instructions; on pairs 752, 196 registers instead of 232 (tools/mgpu_build.py, fiftieth session);
  * the head sum as a second product: that bf16 tile (registers) x a 0/1 matrix [8 I, 8] that adds each token's I
    columns -> fp32 [64, 8], one column a token; then bf16, and a zero made +0.0;
  * two compute warpgroups take alternate blocks of the CTA's positions, each with its own two key slots (the next
    block's gather in flight during this one's products), so neither waits for the other; a block's scores are
    issued before the next block's gather (its index loads, then copies), so that the index loads' latency lies
    under the products rather than before them (thirty-fourth session). Four slots a warpgroup (three blocks'
    gathers in flight) did not pay: 403.8 against 405.5 us at prefill 8192 x 2048 on an H100 (forty-seventh
    session), so the gathers' latency is not what bounds it.
The kernel writes the scores [T, P] itself: each block's [64, 8] result is masked in registers (-inf at p >=
visible_T[t]), stored transposed (``store_transposed``) and copied out as the tile's rows (one TMA copy for a full
tile, one a token for a part-filled one, so tiles never write each other's rows); the blocks no token of the tile
sees are -inf rows from a constant tile, written by the CTA of the tile's last chunk with a seen position, so the
chunks past it take no CTA. Until the fifty-second session each tile wrote its [P, 8] columns and XLA picked each
token's row out of them (a transpose and a row gather: 157.2 us of the 349.1 at prefill 8192 x 2048 on an H100,
fifty-first session). What XLA still does is the tiles' table (``tiles``) and the pads of w and the index rows.

Numerics: the reference's chain (``indexer`` module docstring): each dot of bf16 values in fp32 rounded to bf16,
ReLU, times the weight in fp32 rounded to bf16, the heads summed in fp32 (here by the second product, whose terms
are those bf16 values times 1 or 0) and rounded to bf16. As for the Triton kernel, the fp32 sums take another order
than the reference's, so a score can differ by one bf16 ulp at a rounding tie.

Interpret mode: the interpreter runs no ``inline_mgpu`` and takes wgmma's A operand from shared memory only, so the
keys are gathered in XLA ([S, P, J]) and stored into the slots by each warpgroup, and the bf16 tile of the head sum
goes through a scratch tile; the rest is the kernel's.

Letters: T tokens, I index heads, J index head dim, N pool rows, S sequence rows, P positions, G = ``TOKENS``,
X tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir.dialects import memref
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dijax.kernels import row_gather
from dijax.kernels.fp4_wgmma import COL_LAYOUT, ROW_LAYOUT, available
from dijax.kernels.row_gather import ROWS, TILED, WARPGROUP

TOKENS = 8  # tokens a tile: the head sum's wgmma N
WARPGROUPS = 1  # compute warpgroups by default (``warpgroups``: with 2, alternate blocks of positions)
SLOTS = 2  # key slots a warpgroup
MAX_N = 256  # wgmma's N: TOKENS x heads


def shape_error(i: int, j: int) -> str | None:
    """Why the kernel cannot take I = ``i`` index heads of dim J = ``j`` (None when it can)."""
    if TOKENS * i > MAX_N or (TOKENS * i) % 64:
        return (f"indexer_mgpu: the heads I must be a multiple of {64 // TOKENS} up to {MAX_N // TOKENS} (the tile's "
                f"heads fill 64-wide wgmma columns), got {i}")
    if j not in row_gather.widths(WARPGROUP) or j > 256:
        return f"indexer_mgpu: J must be one of {tuple(w for w in row_gather.widths(WARPGROUP) if w <= 256)}, got {j}"
    return None


def prefix_count(x_T: jax.Array) -> jax.Array:
    """Inclusive prefix sums of 0/1 flags x_T [T] -> int32 [T], by two matrix products instead of XLA's cumulative
    sum (on the GPU a chain of ``reduce_window`` kernels): the flags as rows of 128, each row's prefix sums as a
    product with an upper-triangular ones matrix, then the rows' totals summed over the rows before. Exact: the
    operands (0 / 1, row totals <= 128) are bf16 integers and the sums, in fp32, stay below 2^24."""
    t = x_T.shape[0]
    r = -(-t // 128)
    x_RW = jnp.pad(x_T.astype(jnp.bfloat16), (0, r * 128 - t)).reshape(r, 128)
    upper_WW = jnp.asarray(np.triu(np.ones((128, 128))), jnp.bfloat16)
    within_RW = jnp.dot(x_RW, upper_WW, preferred_element_type=jnp.float32)
    lower_RR = jnp.asarray(np.tril(np.ones((r, r)), -1), jnp.bfloat16)
    before_R = jnp.dot(lower_RR, within_RW[:, -1].astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    return (within_RW + before_R[:, None]).reshape(-1)[:t].astype(jnp.int32)


def tiles(seq_T: jax.Array, visible_T: jax.Array, n_seqs: int) -> tuple[jax.Array, jax.Array]:
    """Tiles of up to ``TOKENS`` consecutive tokens of one sequence: a run of one sequence's tokens split at its
    start and at every multiple of ``TOKENS``. -> (int32 [X, 4] rows (sequence, first token, tokens, the most
    positions one of them sees), each tile's tokens' visible lengths int32 [X, G] (0 past its tokens: a row a tile,
    since a vector load of a tile's lengths from [T] would start at any token, misaligned on the GPU)); unused rows
    have 0 tokens.

    X = ceil(T / TOKENS) + ``n_seqs`` + 1: a tile opens at each multiple of ``TOKENS`` and at each run's start, and an
    engine step has at most ``n_seqs`` + 1 runs (a chunk a sequence, laid end to end, then the padding tokens, whose
    sequence row is 0). Tokens of more runs than that would fall in no tile. No cumulative sum or scatter-reduce
    (the former layout's, whose ``reduce_window`` kernels took ~15 us at 8192 tokens on an H100): one prefix count
    (``prefix_count``), one scatter of each tile's first token, gathers."""
    t = seq_T.shape[0]
    n_tiles = -(-t // TOKENS) + n_seqs + 1
    token_T = jnp.arange(t, dtype=jnp.int32)
    run_start = jnp.concatenate([jnp.ones((1,), bool), seq_T[1:] != seq_T[:-1]])
    opens = run_start | (token_T % TOKENS == 0)  # a token that starts a tile
    tile_T = prefix_count(opens) - 1
    # each tile's first token (T past the used tiles), so a tile's tokens run to the next one's first
    first_X = jnp.full((n_tiles + 1,), t, jnp.int32).at[jnp.where(opens, tile_T, n_tiles + 1)].set(token_T,
                                                                                                   mode="drop")
    count_X = first_X[1:] - first_X[:-1]
    first_X = jnp.minimum(first_X[:-1], t - 1)
    g_G = jnp.arange(TOKENS, dtype=jnp.int32)
    visible_XG = jnp.where(g_G < count_X[:, None], jnp.pad(visible_T, (0, TOKENS))[first_X[:, None] + g_G], 0)
    tiles_X4 = jnp.stack([seq_T[first_X], first_X, count_X, visible_XG.max(axis=1)], axis=1)
    return tiles_X4, visible_XG


def index_scores_mgpu(q_TIJ: jax.Array, w_TI: jax.Array, keys_NJ: jax.Array, rows_SP: jax.Array, seq_T: jax.Array,
                      visible_T: jax.Array, *, blocks: int = 8, warpgroups: int = WARPGROUPS,
                      interpret: bool | plgpu.InterpretGPUParams = False) -> jax.Array:
    """``indexer.index_scores_reference`` on one Mosaic GPU kernel (a GPU of compute capability 9.0; module
    docstring), with the tiles' table in XLA. -> float32 [T, P], -inf at p >= visible_T[t].

    Arguments as the reference's: q_TIJ bf16 [T, I, J], w_TI bf16 [T, I], keys_NJ bf16 [N, J], rows_SP int32 [S, P],
    seq_T int32 [T] (at most S + 1 runs of one sequence's consecutive tokens, as an engine step's: ``tiles``),
    visible_T int32 [T]. ``blocks``: blocks of 64 positions a CTA (a chunk). ``warpgroups``: compute warpgroups a CTA, 1
    or 2 (with one, a CTA needs ~104 KB of shared memory and under half an SM's registers, so two CTAs share an SM and
    one's start, its queries' copy and first gather, lies under the other's products). ``shape_error`` lists the
    shapes it takes. ``interpret``: run in the Mosaic GPU interpreter (keys gathered in XLA: module docstring), with
    its default parameters or the ``InterpretGPUParams`` given."""
    t, i, j = q_TIJ.shape
    s, width = rows_SP.shape
    error = shape_error(i, j)
    if error:
        raise ValueError(error)
    if warpgroups not in (1, 2):
        raise ValueError(f"indexer_mgpu: warpgroups must be 1 or 2, got {warpgroups}")
    chunk = blocks * ROWS
    padded = -(-width // chunk) * chunk
    visible_T = jnp.minimum(visible_T, width).astype(jnp.int32)
    tiles_X4, visible_XG = tiles(seq_T.astype(jnp.int32), visible_T, s)
    # a tile's query rows and weights read past the last token: its TMA copy of q fills them with zeros on the
    # GPU, no copy of q needed (a padded copy where the interpreter, which raises there, runs it, or where q has
    # fewer rows than the copy's box); w is read by plain loads, so TOKENS more zeros
    q_flat = q_TIJ.astype(jnp.bfloat16).reshape(t * i, j)
    if interpret or t < TOKENS:
        q_flat = jnp.pad(q_flat, ((0, TOKENS * i), (0, 0)))
    w_flat = jnp.pad(w_TI.astype(jnp.bfloat16).reshape(t * i), (0, TOKENS * i))
    rows_SP = jnp.pad(rows_SP.astype(jnp.int32), ((0, 0), (0, padded - width)), constant_values=-1)
    sum_GC = jnp.asarray(np.arange(TOKENS * i)[None, :] // i == np.arange(TOKENS)[:, None], jnp.bfloat16)
    gathered = ()
    if interpret:  # the keys gathered in XLA (module docstring): an index outside the pool gives zeros
        n = keys_NJ.shape[0]
        keys_SPJ = keys_NJ.astype(jnp.bfloat16)[jnp.clip(rows_SP, 0, n - 1)]
        gathered = (jnp.where(((rows_SP >= 0) & (rows_SP < n))[..., None], keys_SPJ, 0),)
    # no store may cross P: on the GPU the ragged cases' part-filled tiles left -inf over the next token's first
    # 8 / 4 scores at P = 3000 / 3001 (fifty-second session, H100), as if a one-row store's part past P had landed
    # at the next row's start; so the rows are a whole number of blocks wide, sliced after where that differs from P
    # (the interpreter runs the same widths; it drops a store's part past P, so it could not show this); and as for
    # q, a store's box is kept within the array (at least a tile's rows)
    out_width = -(-width // ROWS) * ROWS
    out = _call(tiles_X4, q_flat, w_flat, keys_NJ.astype(jnp.bfloat16), rows_SP, sum_GC, visible_XG, *gathered,
                heads=i, blocks=blocks, warpgroups=warpgroups, out_rows=max(t, TOKENS), out_width=out_width,
                interpret=interpret)
    return out[:t, :width]


def store_transposed(x_RC: jax.Array, ref, interpret) -> None:
    """Write the fp32 WGMMA-layout array ``x_RC`` transposed into ``ref`` (SMEM fp32 [C, R]): on the GPU each
    thread stores its own elements one by one (Warpgroup semantics has no ``transpose`` in jax 0.11.2, and a store
    through a transposed reference fails its layout inference); the interpreter, which runs no ``inline_mgpu``,
    transposes."""
    if interpret:
        ref[...] = x_RC.T
        return

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def store(ctx, x, out):
        del ctx
        x.foreach(lambda value, idx: memref.store(value, out, [idx[1], idx[0]]))

    store(x_RC, ref)


@functools.partial(jax.jit, static_argnames=("heads", "blocks", "warpgroups", "out_rows", "out_width", "interpret"))
def _call(tiles_X4, q_flat, w_flat, keys_NJ, rows_SP, sum_GC, visible_XG, gathered_SPJ=None, *, heads: int,
          blocks: int, warpgroups: int, out_rows: int, out_width: int,
          interpret: bool | plgpu.InterpretGPUParams):
    """The kernel: the scores [max(T, G), out_width], token t's row written by its tile (-inf at p >=
    visible_XG[its tile, its column], over the blocks no token of the tile sees too; columns past P and rows past T
    unwritten)."""
    n_tiles = tiles_X4.shape[0]
    j = keys_NJ.shape[1]
    width = rows_SP.shape[1]
    n = TOKENS * heads  # the scores' wgmma N
    chunk = blocks * ROWS
    positions_R = jnp.arange(ROWS, dtype=jnp.int32)  # a block's positions as a vector
    ninf_GR = jnp.full((TOKENS, ROWS), -jnp.inf, jnp.float32)  # a tile's rows of an unseen block

    def kernel(tiles_ref, q_gmem, w_gmem, keys_gmem, rows_gmem, sum_gmem, visible_gmem, pos_gmem, ninf_gmem, *refs):
        gathered_gmem = refs[0] if interpret else None
        out_gmem = refs[-1]
        x, c = lax.axis_index("x"), lax.axis_index("c")  # (c varies fastest: a tile's chunks run side by side)
        seq, first, count, seen = (tiles_ref[x, f] for f in range(4))
        wg = lax.axis_index("wg")

        def fetch(jb, k_smem):
            """Start the gather of this warpgroup's jb-th block into slot jb % 2."""
            p0 = c * chunk + (warpgroups * jb + wg) * ROWS
            slot = lax.rem(jb, SLOTS)
            if interpret:
                k_smem.at[wg, slot][...] = gathered_gmem.at[seq, pl.ds(p0, ROWS)][...]
            else:
                row_gather.gather_rows(rows_gmem.at[seq, pl.ds(p0, ROWS)], keys_gmem, k_smem.at[wg, slot],
                                       sizes=(keys_gmem.shape[0],), threads=WARPGROUP)

        def store_rows(o_smem, p0):
            """Start the stores of the tile's tokens' rows at positions p0 + [0, 64) from ``o_smem``
            (SMEM fp32 [G, 64]): one copy for a full tile, else a copy a token."""
            @pl.when(count == TOKENS)
            def _():
                plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[pl.ds(first, TOKENS), pl.ds(p0, ROWS)])

            for g in range(TOKENS - 1):
                @pl.when((g < count) & (count < TOKENS))
                def _():
                    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(g, 1)], out_gmem.at[pl.ds(first + g, 1), pl.ds(p0, ROWS)])

        def body(q_smem, e_smem, k_smem, o_smem, n_smem, t_smem, bar, n_bar):
            # the chunk's blocks some token of the tile sees, and this warpgroup's of them: wg, wg + warpgroups, ...
            live = jnp.minimum(blocks, (seen - c * chunk + ROWS - 1) // ROWS)
            mine = (live - wg + warpgroups - 1) // warpgroups
            # the tile's last chunk with a seen position (chunk 0 if none) writes -inf over every block past it, so
            # that the chunks past it need no CTA
            last = c == jnp.maximum(seen - 1, 0) // chunk

            @pl.when(wg == 0)
            def _():
                @pl.when(live > 0)
                def _():
                    plgpu.copy_gmem_to_smem(q_gmem.at[pl.ds(first * heads, n)], q_smem, bar)
                    plgpu.copy_gmem_to_smem(sum_gmem, e_smem, bar)

                @pl.when(last)
                def _():
                    plgpu.copy_gmem_to_smem(ninf_gmem, n_smem, n_bar)

            @pl.when(mine > 0)  # (with one live block, the second warpgroup has none)
            def _():
                compute(q_smem, e_smem, k_smem, o_smem, t_smem, bar, mine)

            @pl.when(last)
            def _():
                plgpu.barrier_wait(n_bar)
                unseen = c * blocks + jnp.maximum(live, 0)  # the first block no token of the tile sees
                todo = (-(-out_width // ROWS) - unseen - wg + warpgroups - 1) // warpgroups  # this warpgroup's

                def store_unseen(k, _):
                    store_rows(n_smem, (unseen + warpgroups * k + wg) * ROWS)
                    return _

                lax.fori_loop(0, todo, store_unseen, None)
            plgpu.wait_smem_to_gmem(0)

        def compute(q_smem, e_smem, k_smem, o_smem, t_smem, bar, mine):
            """This warpgroup's ``mine`` blocks of the chunk: gathers, both products, the rounding chain, stores."""
            w_col = plgpu.load(w_gmem.at[pl.ds(first * heads, n)], layout=COL_LAYOUT, optimized=False)
            w_col = lax.broadcast_in_dim(w_col, (ROWS, n), [1])
            visible_RG = lax.broadcast_in_dim(plgpu.load(visible_gmem.at[x], layout=COL_LAYOUT, optimized=False),
                                              (ROWS, TOKENS), [1])
            pos_R = plgpu.load(pos_gmem, layout=ROW_LAYOUT, optimized=False)
            fetch(0, k_smem)
            row_gather.commit_group(interpret)
            plgpu.barrier_wait(bar)

            def block(jb, _):
                row_gather.wait_group(0, interpret)  # this thread's copies of block jb (the only ones in flight)
                plgpu.commit_smem()  # the warpgroup's copies, seen by wgmma; the warpgroup done with block jb - 1
                slot = lax.rem(jb, SLOTS)

                def scores(s_ref):
                    plgpu.wgmma(s_ref, k_smem.at[wg, slot], q_smem.T)

                    @pl.when(jb + 1 < mine)  # the next block's gather (index loads, then copies) under the products
                    def _():
                        fetch(jb + 1, k_smem)
                    row_gather.commit_group(interpret)
                    return s_ref[...]

                s = pl.run_scoped(scores, plgpu.ACC((ROWS, n), jnp.float32))
                terms = jnp.maximum(s.astype(jnp.bfloat16), jnp.bfloat16(0)) * w_col
                if interpret:  # the interpreter takes A from shared memory only
                    t_smem.at[wg][...] = terms
                    plgpu.commit_smem()
                    terms = t_smem.at[wg]
                    k_smem.at[wg, slot][...]  # its race detector does not see wgmma's reads: this load stands for them

                def head_sum(r_ref):
                    plgpu.wgmma(r_ref, terms, e_smem.T)
                    return r_ref[...]

                r = pl.run_scoped(head_sum, plgpu.ACC((ROWS, TOKENS), jnp.float32))
                r = r.astype(jnp.bfloat16).astype(jnp.float32)
                r = jnp.where(r == 0, 0.0, r)  # +0.0 (the indexer module docstring)
                plgpu.wait_smem_to_gmem(0)  # the last block's store has read o_smem
                p0 = c * chunk + (warpgroups * jb + wg) * ROWS
                seen_RG = lax.broadcast_in_dim(pos_R + p0, (ROWS, TOKENS), [0]) < visible_RG
                store_transposed(jnp.where(seen_RG, r, -jnp.inf), o_smem.at[wg], interpret)
                plgpu.commit_smem()
                store_rows(o_smem.at[wg], p0)
                return _

            lax.fori_loop(0, mine, block, None)

        # a chunk some token of the tile sees (and chunk 0 of a tile none of whose tokens sees a position: it writes
        # the -inf rows)
        @pl.when((count > 0) & (c * chunk < jnp.maximum(seen, 1)))
        def _():
            pl.run_scoped(
                body,
                q_smem=plgpu.SMEM((n, j), jnp.bfloat16, transforms=TILED),
                e_smem=plgpu.SMEM((TOKENS, n), jnp.bfloat16, transforms=TILED),
                k_smem=plgpu.SMEM((warpgroups, SLOTS, ROWS, j), jnp.bfloat16, transforms=TILED),
                o_smem=plgpu.SMEM((warpgroups, TOKENS, ROWS), jnp.float32),
                n_smem=plgpu.SMEM((TOKENS, ROWS), jnp.float32),
                t_smem=plgpu.SMEM((warpgroups, ROWS, n), jnp.bfloat16, transforms=TILED) if interpret else None,
                bar=plgpu.Barrier(num_arrivals=2),
                n_bar=plgpu.Barrier(num_arrivals=1),
                collective_axes="wg")

    run = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((out_rows, out_width), jnp.float32),
        grid=(n_tiles, width // chunk), grid_names=("x", "c"), num_threads=warpgroups, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=row_gather.interpreter(interpret))
    return run(tiles_X4, q_flat, w_flat, keys_NJ, rows_SP, sum_GC, visible_XG, positions_R, ninf_GR,
               *(() if gathered_SPJ is None else (gathered_SPJ,)))
