"""Lightning-indexer scores over the paged index-key pool (v41_spec §5.2 step 4, with the causal mask of step 5).

Two implementations behind ``index_scores(..., impl=...)``, one signature:
  * ``"reference"`` (``index_scores_reference``): jnp. It gathers every token's keys into a [T, P, J] array and
    runs the reference's bf16 chain (the math ``model.attention`` used inline before this module existed);
  * ``"pallas"`` (``index_scores_pallas``): a Triton-lowered ``pl.pallas_call`` (interpret mode off the GPU) that
    gathers each token's key rows from the pool by row index, block by block, never forming [T, P, J], and does no
    loads or dots for blocks past the token's visible length.

Semantics (both): for token t and compressed position p of its sequence,
``score[t, p] = bf16(sum_i bf16(relu(bf16(q[t, i] . k[p])) * w[t, i]))``, every sum and product in fp32: the dot
of bf16 values accumulated in fp32 and rounded to bf16, ReLU, times the head weight (exact in fp32, rounded to
bf16), the heads summed in fp32 and rounded to bf16. The result is returned as float32, with -inf (``NEG_INF``) at every
p >= visible_T[t].

Agreement: both accumulate exact products of bf16 values in fp32, but in different orders (the dot over J, the sum
over heads), so a score can differ by one bf16 ulp where an fp32 sum lands next to a bf16 rounding boundary: a
small fraction of entries with random inputs, none when the sums are exact (fq4-quantised queries and keys, the
model's case, usually are). The -inf mask is identical. A zero score is +0.0 in both: the sign of a sum whose
every head gives -0.0 (ReLU'd to zero, negative weight) depends on the backend's reduction (XLA's reduce starts
from +0.0 but drops a one-head reduce; Triton's tree sum of -0.0 terms is -0.0), and the top-k orders -0.0 below
+0.0, so both implementations make every zero score +0.0. XLA:CPU (jax 0.12) would fuse the reference's
weighted terms into the head sum as one YNNPACK fusion that drops their bf16 rounding (~40 % of scores a bf16 ulp
or more off the definition at 24+ heads); an optimization barrier before the sum keeps them.

The kernel: grid (T, chunks of ``blocks * block_p`` positions); program (t, c) reads t's sequence and visible
length, and if its chunk holds a visible position it loads t's queries [I, J] and weights [I] once, then for each
block of ``block_p`` positions with a visible one: the pool rows of those positions (the row-index vector of
``rows_SP``), the keys at those rows (a masked gather: invisible positions issue no loads), one tensor-core dot
[I, J] x [J, block_p] with fp32 accumulation, the rounding chain above, and a store of the block's scores. Blocks
past the visible length store -inf only. The grid's first axis is the token, so consecutive programs are the
tokens of one chunk: a prefill's tokens of one sequence read the same key rows, from L2 after the first.

Letters: T tokens, I index heads, J index head dim, N pool rows, S sequence rows, P compressed positions of a
sequence.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dijax.kernels import indexer_mgpu, interpret_mode, poison

HIGHEST = jax.lax.Precision.HIGHEST
IMPLS = ("reference", "pallas")
ENGINES = ("triton", "mgpu")
MIN_DOT = 16  # Triton's dot needs every dimension >= 16: fewer heads (tiny test models) are padded
NEG_INF = -jnp.inf


def index_scores_reference(q_TIJ: jax.Array, w_TI: jax.Array, keys_NJ: jax.Array, rows_SP: jax.Array,
                           seq_T: jax.Array, visible_T: jax.Array) -> jax.Array:
    """Masked lightning-indexer scores, the jnp reference (module docstring). -> float32 [T, P].

    q_TIJ: bf16 index queries (fq4'd, roped); w_TI: bf16 head weights (scaled, rounded to bf16); keys_NJ: bf16 pool
    of index keys; rows_SP: int32 pool row of every compressed position of every sequence row; seq_T: int32 each
    token's sequence row; visible_T: int32, positions p < visible_T[t] are visible, the rest are -inf. A zero
    score is +0.0.
    """
    keys_TPJ = keys_NJ[rows_SP[seq_T]]
    s = jnp.einsum("tij,tpj->tip", q_TIJ, keys_TPJ, preferred_element_type=jnp.float32,
                   precision=HIGHEST).astype(jnp.bfloat16)
    s = jnp.maximum(s, 0)
    s = (s.astype(jnp.float32) * w_TI.astype(jnp.float32)[..., None]).astype(jnp.bfloat16)
    # XLA:CPU (jax 0.12) fuses this product into the head sum as one YNNPACK fusion that drops the bf16 rounding
    # (--xla_allow_excess_precision=false notwithstanding: ~40 % of scores moved at 24+ heads); the barrier keeps
    # the rounded terms
    s = jax.lax.optimization_barrier(s)
    score = jnp.sum(s.astype(jnp.float32), axis=1).astype(jnp.bfloat16).astype(jnp.float32)
    visible = jnp.arange(rows_SP.shape[1], dtype=jnp.int32)[None, :] < visible_T[:, None]
    return jnp.where(visible, jnp.where(score == 0, 0.0, score), NEG_INF)


@dataclass(frozen=True)
class IndexerConfig:
    """Tiling of ``index_scores_pallas``.

    block_p: positions per dot (a power of two >= 16); blocks: blocks per program (a power of two), None = the
    most, up to ``max_blocks``, that still leaves ``target_programs`` programs for T x P (more blocks per program
    load the queries once for more keys and launch fewer programs that only write -inf; fewer keep a short step's
    grid wide enough to fill the GPU); num_warps / num_stages: Triton launch parameters. poison: the output starts
    NaN-filled instead of uninitialised (tests: an element no program writes shows). The defaults are reasoned,
    not yet measured (``tools/bench_kernels.py --only indexer --sweep`` times the alternatives).

    engine: 'triton' (this module's kernel) or 'mgpu' (dijax.kernels.indexer_mgpu: tiles of up to 8 tokens of one
    sequence on wgmma, the head sum a second product; for prefill). 'mgpu' takes a call only where the step has at
    least ``mgpu_min_tokens_per_seq`` tokens a sequence row (T / S, static: a decode step's one token a sequence
    would fill an eighth of its tiles), on a compute-capability-9 GPU, not interpreted, for shapes it takes
    (``indexer_mgpu.shape_error``); otherwise 'triton'. It needs an engine step's token order (at most S + 1 runs
    of one sequence's consecutive tokens: ``indexer_mgpu.tiles``), which the Triton kernel does not. On the H200
    (thirty-first session) it took prefill 8192 x 2048 (32 heads x 128) in 433 us against 496 (20.2 % of the
    tensor-core floor against 17.7 %), its outputs within 1 ulp of the reference. mgpu_blocks: the Mosaic GPU kernel's
    blocks of 64 positions a CTA (``index_scores_mgpu``'s ``blocks``: each CTA loads its tile's queries once for that
    many blocks). mgpu_warpgroups: its compute warpgroups a CTA (``warpgroups``: with 1, two CTAs share an SM; at
    prefill 8192 x 2048 on an H100 its kernel took 154.9 us against 177.5 with 2, fifty-first session).
    """

    block_p: int = 128
    blocks: int | None = None
    max_blocks: int = 8
    target_programs: int = 1056  # 8 per multiprocessor of an H200
    num_warps: int = 4
    num_stages: int = 1
    poison: bool = False
    engine: str = "mgpu"
    mgpu_min_tokens_per_seq: int = 4
    mgpu_blocks: int = 8
    mgpu_warpgroups: int = 1

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"indexer IndexerConfig.engine must be one of {ENGINES}, got {self.engine!r}")
        if self.mgpu_blocks < 1:
            raise ValueError(f"indexer IndexerConfig.mgpu_blocks must be >= 1, got {self.mgpu_blocks}")
        if self.mgpu_warpgroups not in (1, 2):
            raise ValueError(f"indexer IndexerConfig.mgpu_warpgroups must be 1 or 2, got {self.mgpu_warpgroups}")


CONFIG = IndexerConfig()


def _power_of_two(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def blocks_per_program(config: IndexerConfig, tokens: int, width: int) -> int:
    """Blocks of ``config.block_p`` positions per program for T = ``tokens`` and P = ``width`` (static)."""
    if config.blocks is not None:
        return config.blocks
    total = tokens * -(-width // config.block_p)
    blocks = 1
    while blocks < config.max_blocks and total // (2 * blocks) >= config.target_programs:
        blocks *= 2
    return blocks


def _score_kernel(seq_ref, visible_ref, rows_ref, q_ref, w_ref, keys_ref, out_ref, *, block_p: int, blocks: int):
    """Program (t, c): scores of token t at positions [c * blocks * block_p, (c + 1) * blocks * block_p)."""
    t = pl.program_id(0)
    base = pl.program_id(1) * (blocks * block_p)
    visible = visible_ref[t]
    n_rows, j = keys_ref.shape

    @pl.when(base >= visible)
    def _():
        out_ref[...] = jnp.full((blocks * block_p,), NEG_INF, jnp.float32)

    @pl.when(base < visible)
    def _():
        seq = seq_ref[t]
        q_IJ = q_ref[...]
        w_I1 = w_ref[...].astype(jnp.float32)[:, None]
        col_1J = jnp.arange(j, dtype=jnp.int32)[None, :]

        def block(b, carry):
            p0 = base + b * block_p
            local = pl.ds(pl.multiple_of(b * block_p, block_p), block_p)

            @pl.when(p0 < visible)
            def _():
                live_P = p0 + jnp.arange(block_p, dtype=jnp.int32) < visible
                # masked lanes issue no memory access: only visible positions read their row index and key
                row_P = pltriton.load(rows_ref.at[seq, pl.ds(p0, block_p)], mask=live_P, other=0)
                row_P1 = jnp.clip(row_P, 0, n_rows - 1)[:, None]
                keys_PJ = pltriton.load(keys_ref.at[row_P1, col_1J], mask=jnp.broadcast_to(live_P[:, None],
                                                                                           (block_p, j)), other=0)
                s_IP = jax.lax.dot_general(q_IJ, keys_PJ, (((1,), (1,)), ((), ())),
                                           preferred_element_type=jnp.float32)
                # ReLU of the bf16-rounded dot, in fp32 (exact); the accumulator starts at +0.0, so no dot is -0.0
                s_IP = jnp.maximum(s_IP.astype(jnp.bfloat16).astype(jnp.float32), 0.0)
                s_IP = (s_IP * w_I1).astype(jnp.bfloat16).astype(jnp.float32)
                score_P = jnp.sum(s_IP, axis=0).astype(jnp.bfloat16).astype(jnp.float32)
                # zero scores are +0.0 (module docstring): Triton's sum of heads that are all -0.0 is -0.0
                score_P = jnp.where(score_P == 0, 0.0, score_P)
                out_ref[local] = jnp.where(live_P, score_P, NEG_INF)

            @pl.when(p0 >= visible)
            def _():
                out_ref[local] = jnp.full((block_p,), NEG_INF, jnp.float32)

            return carry

        jax.lax.fori_loop(0, blocks, block, 0)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def index_scores_pallas(q_TIJ: jax.Array, w_TI: jax.Array, keys_NJ: jax.Array, rows_SP: jax.Array,
                        seq_T: jax.Array, visible_T: jax.Array, *, config: IndexerConfig | None = None,
                        interpret: bool | None = None) -> jax.Array:
    """The Pallas (Triton) kernel with ``index_scores_reference``'s arguments and semantics. -> float32 [T, P].

    Agrees with the reference up to one bf16 ulp at fp32 summation-order ties, with the same -inf mask (module
    docstring). J must be a power of two >= 16. Heads are padded to a power of two >= 16 with zero queries and
    weights: a padded head's term is +0.0, which leaves every fp32 sum as it was (a -0.0 sum becomes +0.0, which
    every zero score is made anyway). A P that is not a multiple of ``blocks * block_p`` is padded
    (rows_SP copied with the padding, the scores sliced after). The pool, the padded rows_SP and the padded
    scores must each hold fewer than 2^31 elements (Triton's int32 offsets: N < 2^24 rows at J = 128).
    config: tiling (default the module's ``CONFIG``, which ``tools/bench.py --kernel-setting indexer.CONFIG.X=V``
    sets); interpret: run in the Pallas interpreter (default: when the backend is not a GPU). Jitted: the index
    layers of one shape share one trace and lowering.
    """
    config = config or CONFIG
    t, i, j = q_TIJ.shape
    s, width = rows_SP.shape
    interpret = interpret_mode(interpret)
    if (config.engine == "mgpu" and not interpret and t >= config.mgpu_min_tokens_per_seq * s
            and indexer_mgpu.available() and indexer_mgpu.shape_error(i, j) is None):
        return indexer_mgpu.index_scores_mgpu(q_TIJ, w_TI, keys_NJ, rows_SP, seq_T, visible_T,
                                              blocks=config.mgpu_blocks, warpgroups=config.mgpu_warpgroups)
    if not _power_of_two(j) or j < MIN_DOT:
        raise ValueError(f"index_scores_pallas: the index head dim J={j} must be a power of two >= {MIN_DOT}")
    if not _power_of_two(config.block_p) or config.block_p < MIN_DOT:
        raise ValueError(f"index_scores_pallas: config.block_p={config.block_p} must be a power of two >= {MIN_DOT}")
    blocks = blocks_per_program(config, t, width)
    if not _power_of_two(blocks):
        raise ValueError(f"index_scores_pallas: config.blocks={blocks} must be a power of two")
    heads = max(MIN_DOT, pl.next_power_of_2(i))
    if heads != i:
        q_TIJ = jnp.pad(q_TIJ, ((0, 0), (0, heads - i), (0, 0)))
        w_TI = jnp.pad(w_TI, ((0, 0), (0, heads - i)))
    chunk = blocks * config.block_p
    padded = -(-width // chunk) * chunk
    if padded != width:
        rows_SP = jnp.pad(rows_SP, ((0, 0), (0, padded - width)))
    for name, size in (("keys_NJ", keys_NJ.size), ("rows_SP padded", s * padded), ("the padded scores", t * padded)):
        if size >= 2 ** 31:
            raise ValueError(f"index_scores_pallas: {name} has {size} elements; the kernel's int32 offsets need "
                             f"fewer than 2^31")
    visible_T = jnp.minimum(visible_T.astype(jnp.int32), width)
    kernel = functools.partial(_score_kernel, block_p=config.block_p, blocks=blocks)
    out_spec = pl.BlockSpec((None, chunk), lambda a, c: (a, c))
    per_token = [pl.BlockSpec((None, heads, j), lambda a, c: (a, 0, 0)),
                 pl.BlockSpec((None, heads), lambda a, c: (a, 0))]
    in_specs = [pl.no_block_spec] * 3 + per_token + [pl.no_block_spec]
    args = [seq_T.astype(jnp.int32), visible_T, rows_SP.astype(jnp.int32), q_TIJ.astype(jnp.bfloat16),
            w_TI.astype(jnp.bfloat16), keys_NJ.astype(jnp.bfloat16)]
    score_TP = poison.pallas_call(
        kernel, *args,
        out_shape=jax.ShapeDtypeStruct((t, padded), jnp.float32),
        poison=config.poison,
        grid=(t, padded // chunk),
        in_specs=in_specs,
        out_specs=out_spec,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="index_scores",
    )
    return score_TP[:, :width] if padded != width else score_TP


def index_scores(q_TIJ: jax.Array, w_TI: jax.Array, keys_NJ: jax.Array, rows_SP: jax.Array, seq_T: jax.Array,
                 visible_T: jax.Array, *, impl: str = "reference") -> jax.Array:
    """Masked lightning-indexer scores by the chosen implementation: "reference" (jnp) or "pallas" (kernel).

    Arguments as ``index_scores_reference``: q_TIJ bf16 [T, I, J], w_TI bf16 [T, I], keys_NJ bf16 [N, J], rows_SP
    int32 [S, P], seq_T int32 [T], visible_T int32 [T]. Returns float32 [T, P], -inf at p >= visible_T[t].
    """
    if impl == "reference":
        return index_scores_reference(q_TIJ, w_TI, keys_NJ, rows_SP, seq_T, visible_T)
    if impl == "pallas":
        return index_scores_pallas(q_TIJ, w_TI, keys_NJ, rows_SP, seq_T, visible_T)
    raise ValueError(f"index_scores: impl must be one of {IMPLS}, got {impl!r}")
