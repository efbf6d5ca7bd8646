"""MXFP4 expert weights times token tiles on Hopper's tensor cores (Mosaic GPU): ``grouped_gemm_t``.

Status (thirty-first session, on the H200): the output tiles are stored untransposed ([R, F], through a transposed
view of the shared-memory staging tile), so the routed path needs no XLA transposes around the GEMMs; tiles come in
several sizes (one compiled pipeline each), so that ``routed_experts.fit_tiles`` can give each expert one tile of
about its size instead of whole 128-row tiles; the scales are read in their stored layout straight from GMEM; a CTA
may have one compute warpgroup. Its GPU tests pass, and the routed experts' ragged path runs on it by default from
``routed_experts.KernelConfig.mgpu_min_assignments`` on: the layer at 8192 tokens took 12.59 ms against the Triton
kernels' 14.81 (the transposed form of the twenty-eighth session: 20.6 ms), while at decode sizes it lost (T = 64:
2.85 against 2.34 ms). GPU parity with it on every step equals the Triton path's to the printed digits. It is the
first tensor-core kernel whose operand layouts we control, and the building block of issue 12's prefill path. Rates
of earlier forms (H200, jax 0.11.2; docs/benchmarks.md's measured bf16 ceiling is 790 TFLOP/s):
  * one expert's weights, F x K = 36864 x 5120 (the prototype of this kernel, 4 stages, one K chunk a step): 391
    TFLOP/s with 128 tokens a tile, 549 with 256; a dense 4608 x 5120 x 4096: 675 (XLA's bf16 dot of
    already-decoded weights: 769);
  * grouped at prefill 8192 (128-token tiles, 4 stages, 2 K chunks a step): 266 TFLOP/s of real work on the gate-up
    weights, 260 on the down weight; the Triton grouped GEMMs run at 236-239. ``tile_layout`` pads each expert to
    whole 128-row tiles (a third of the work here).

Why the weights are wgmma's A operand: wgmma takes A from registers, so the MXFP4 weights are decoded there (codes
-> bf16 times the block scale) and the tokens are the B operand, read by TMA into shared memory; the accumulator is
[F, tokens], written out transposed. The weights are read in their stored layout, as uint32 words of 8 codes
(``routed_experts.pack_words``, a bitcast): in each 64-wide K step a warpgroup loads a [64, 8] word tile in the
WGMMA layout, so thread (row r, lane q) holds words 2q and 2q + 1 of rows r and r + 8, and each word decodes to
bf16 pairs with two masks and two shifts (``bf16_pairs``' bit trick on whole words, not per code). A word's nibbles
are not the K positions wgmma's fragment gives that thread, so the activations take the matching order instead:
``permute_k`` (one gather, which the grouped path pays anyway to sort tokens by expert). One thread's codes of a K
step all fall in one 32-wide scale block (lanes 0-1 the first, 2-3 the second), so its scale is one select.

Letters: E experts, F output features (weight rows), K input features, H = K / 2 packed bytes, W = K / 8 words,
B = K / 32 scale blocks, R token rows, I tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from dijax.kernels import lowering_without_gpu, quant

K_CHUNK = 64  # K of one [64, 64] bf16 A fragment (one decode, one wgmma)
# The decoded weights are e2m1 * 2^(s - 127 - SCALE_SHIFT) (bf16, exact and normal for ue8m0 bytes s in
# SCALE_RANGE); the fp32 accumulator is multiplied back by 2^SCALE_SHIFT. routed_experts' Triton grouped GEMM
# takes the same shift and range (routed_experts.GEMM_SCALE_RANGE is this), so the engine's check covers both.
SCALE_SHIFT = 32
SCALE_RANGE = (SCALE_SHIFT + 2, 128 + SCALE_SHIFT)
ROWS_PER_WG = 64  # wgmma's M
ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)  # one value a row of a WGMMA-layout tile
COL_LAYOUT = plgpu.Layout.WGMMA.reduce(0)  # one value a column of a WGMMA-layout tile
WARPGROUPS = (1, 2)  # compute warpgroups a CTA may have (each its own 64 weight rows), plus one issuing the TMA copies


def permute_k(x_RK: jax.Array) -> jax.Array:
    """The activations' K order the kernel's fragments expect: in each 64-wide chunk, position
    16j + 8h + 2q + e holds input feature 16q + 8h + 4e + j (j, q < 4; h, e < 2). [..., K] -> [..., K]."""
    *lead, k = x_RK.shape
    x = x_RK.reshape(*lead, k // K_CHUNK, 4, 2, 2, 4)  # chunk, q, h, e, j
    n = len(lead)
    x = jnp.moveaxis(x, (n + 1, n + 2, n + 3, n + 4), (n + 3, n + 2, n + 4, n + 1))  # chunk, j, h, q, e
    return x.reshape(*lead, k)


def grouped_gemm_t_reference(w_EFW: jax.Array, s_EFB: jax.Array, x_TK: jax.Array, tiles_I3: jax.Array,
                             rows_R: jax.Array | None = None, *, sizes: tuple[int, ...] = (128,), stages: int = 4,
                             chunks: int = 2, warpgroups: int = 2, overlap: bool = False,
                             interpret: bool = False) -> jax.Array:
    """bf16 y_RF [R, F]: each tile (expert e, first row r, rows n) of ``tiles_I3`` int32 [I, 3] multiplies rows
    [r, r + n) of x_RK = x_TK[rows_R] (x_TK itself when ``rows_R`` is None; natural K order) by expert e's MXFP4
    weight (uint32 words w_EFW [E, F, K/8], nibble j of word w the code of k = 8w + j, as
    ``routed_experts.pack_words`` gives them; ue8m0 s_EFB [E, F, K/32]): x_rows @ W.T. Tiles with e < 0 are unused;
    n is one of ``sizes``; rows no tile covers are zeros. ``stages``, ``chunks``, ``warpgroups``, ``overlap`` and
    ``interpret`` are the kernel's and change nothing here."""
    del stages, chunks, warpgroups, overlap, interpret
    x_RK = x_TK if rows_R is None else x_TK[rows_R]
    n_rows, n_max = x_RK.shape[0], max(sizes)
    e_I, row_I, size_I = tiles_I3[:, 0], tiles_I3[:, 1], tiles_I3[:, 2]
    w = w_EFW[jnp.maximum(e_I, 0)]
    w_IFH = lax.bitcast_convert_type(w, jnp.uint8).reshape(*w.shape[:-1], -1)
    w_IFK = quant.dequant_fp4_weight(w_IFH, s_EFB[jnp.maximum(e_I, 0)])
    r_IN = row_I[:, None] + jnp.arange(n_max)[None, :]
    used_IN = (jnp.arange(n_max)[None, :] < size_I[:, None]) & (e_I[:, None] >= 0)
    x_INK = jnp.where(used_IN[..., None], x_RK[jnp.clip(r_IN, 0, n_rows - 1)], 0)
    y_INF = jnp.einsum("ifk,ink->inf", w_IFK, x_INK, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    y_RF = jnp.zeros((n_rows, w_EFW.shape[1]), jnp.bfloat16)
    return y_RF.at[jnp.where(used_IN, r_IN, n_rows)].set(y_INF, mode="drop")


def shape_error(f: int, k: int, sizes: tuple[int, ...], chunks: int, warpgroups: int = 2) -> str | None:
    """Why the kernel cannot take F = ``f`` weight rows, K = ``k``, tile ``sizes``, ``chunks`` and ``warpgroups``
    (None when it can)."""
    if not sizes or any(n % 8 or not 8 <= n <= 256 for n in sizes):
        return f"grouped_gemm_t: tile sizes must be multiples of 8 in [8, 256] (wgmma's N), got {sizes}"
    if chunks not in (1, 2):
        return f"grouped_gemm_t: chunks must be 1 or 2, got {chunks}"
    if warpgroups not in WARPGROUPS:
        return f"grouped_gemm_t: warpgroups must be one of {WARPGROUPS}, got {warpgroups}"
    if f % (warpgroups * ROWS_PER_WG) or k % (chunks * K_CHUNK):
        return (f"grouped_gemm_t: F {f} must be a multiple of {warpgroups * ROWS_PER_WG} and K {k} of "
                f"{chunks * K_CHUNK} ({chunks} chunks of {K_CHUNK})")
    return None


def available() -> bool:
    """Whether the step's device can run the kernel: the default device is a GPU of compute capability 9.x (wgmma),
    or the step is lowered for one (``dijax.kernels.lowering_for_gpu``)."""
    if lowering_without_gpu():
        return True
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")


def grouped_gemm_t_mgpu(w_EFW: jax.Array, s_EFB: jax.Array, x_TK: jax.Array, tiles_I3: jax.Array,
                        rows_R: jax.Array | None = None, *, sizes: tuple[int, ...] = (128,), stages: int = 4,
                        chunks: int = 2, warpgroups: int = 2, overlap: bool = False,
                        interpret: bool = False) -> jax.Array:
    """``grouped_gemm_t_reference`` as one Mosaic GPU kernel (a GPU of compute capability 9.0). Rows no tile covers
    are left unwritten. ``shape_error`` lists the sizes it takes; exact for ue8m0 bytes in ``SCALE_RANGE``.
    ``sizes``: the tile row counts (wgmma's N), one compiled pipeline each; ``stages``: pipeline depth (fewer where
    the larger tiles' shared memory needs it: ``_stages``); ``chunks``: 64-wide K chunks a pipeline step (1 or 2:
    with 2, the decode of the second overlaps the first's wgmma); ``warpgroups``: compute warpgroups a CTA, each
    its own 64 weight rows (1 gives twice the CTAs, for grids too small to fill the GPU: decode); ``overlap``: a
    step leaves its last wgmma running into the next step's decode (its inputs released a step later; needs two
    stages; ptxas reports no serialisation of the register operand, tools/mgpu_build.py); ``interpret``: run in
    the Mosaic GPU interpreter (``interpret_operand``).

    The wrapper permutes x's K (``permute_k``) before gathering its rows (a pass over T rows, not R). The scales
    are read in their stored layout, one word a row a step (``scale_words``, a bitcast) straight from GMEM by the
    compute warpgroups, each step's a step ahead (carried through the pipeline; thirty-fourth session, on an H100:
    the layer at T = 1 / 16 / 64 7 / 4.5 / 1 % faster, prefill 8192 the same to 0.02 %). A TMA copy cannot take
    them (at K = 2304 a row's 72 bytes break TMA's 16-byte stride rule), and transposing them was a pass over every
    expert's scales a call, most of a decode step's bytes.
    """
    f, k = w_EFW.shape[1], 8 * w_EFW.shape[2]
    sizes = tuple(sorted(set(sizes)))
    error = shape_error(f, k, sizes, chunks, warpgroups)
    if error:
        raise ValueError(error)
    if x_TK.shape[-1] != k or tiles_I3.ndim != 2 or tiles_I3.shape[1] != 3:
        raise ValueError(f"grouped_gemm_t: x must be [rows, K = {k}] and tiles [I, 3], got x {x_TK.shape}, "
                         f"tiles {tiles_I3.shape}")
    x_RK = permute_k(x_TK) if rows_R is None else permute_k(x_TK)[rows_R]
    return _call(w_EFW, scale_words(s_EFB, chunks), x_RK, tiles_I3.astype(jnp.int32), sizes=sizes, stages=stages,
                 chunks=chunks, warpgroups=warpgroups, overlap=overlap, interpret=interpret)


def scale_words(s_EFB: jax.Array, chunks: int) -> jax.Array:
    """The ue8m0 scales as one word a row a pipeline step, in their stored layout (a bitcast, no pass over them):
    uint8 [E, F, K/32] -> uint16 [E, F, K/64] (chunks 1) or uint32 [E, F, K/128] (chunks 2); byte j of step s's
    word is block 2 * chunks * s + j."""
    e, f, b = s_EFB.shape
    dtype = {1: jnp.uint16, 2: jnp.uint32}[chunks]
    return lax.bitcast_convert_type(s_EFB.reshape(e, f, b // (2 * chunks), 2 * chunks), dtype)


SMEM_BYTES = 227 * 1024  # an H100 / H200 block's shared memory


def pipeline_depth(stages: int, per_stage: int, staging: int) -> int:
    """``stages``, or fewer where that many stages of ``per_stage`` bytes of shared memory would not fit beside an
    output staging tile of ``staging`` bytes and the pipeline's barriers (Mosaic GPU checks at lowering)."""
    return max(1, min(stages, (SMEM_BYTES - staging - 4096) // per_stage))


def _stages(n: int, n_max: int, chunks: int, stages: int, warpgroups: int) -> int:
    """Pipeline depth for tiles of ``n`` rows: a stage holds the tile's x rows and every compute warpgroup's
    words; the bf16 staging tile has ``n_max`` rows."""
    per_stage = n * chunks * K_CHUNK * 2 + warpgroups * ROWS_PER_WG * chunks * (K_CHUNK // 8) * 4
    return pipeline_depth(stages, per_stage, warpgroups * n_max * ROWS_PER_WG * 2)


@functools.partial(jax.jit, static_argnames=("sizes", "stages", "chunks", "warpgroups", "overlap", "interpret"))
def _call(w_EFW, s_EFS, x_RK, tiles_I3, *, sizes: tuple[int, ...], stages: int, chunks: int, warpgroups: int,
          overlap: bool, interpret: bool):
    f, k = w_EFW.shape[1], w_EFW.shape[2] * 8
    cta_rows = warpgroups * ROWS_PER_WG
    n_max = max(sizes)

    def kernel(tiles_ref, w_gmem, s_gmem, x_gmem, y_gmem, y_smem, a_smem=None):
        m, i = lax.axis_index("m"), lax.axis_index("i")
        e, n_rows = tiles_ref[i, 0], tiles_ref[i, 2]
        row0 = pl.multiple_of(tiles_ref[i, 1], 8)  # tile rows start on multiples of 8 (every size is one)

        steps = k // (chunks * K_CHUNK)

        def scales(step_index):
            """The compute warpgroup's rows' ue8m0 bytes of pipeline step ``step_index``, one word a row read
            straight from GMEM (L1 serves the later steps)."""
            wg = lax.axis_index("wg")
            return plgpu.load(s_gmem.at[e, pl.ds(m * cta_rows + wg * ROWS_PER_WG, ROWS_PER_WG), step_index],
                              layout=ROW_LAYOUT, optimized=False).astype(jnp.uint32)

        def step(indices, *refs):
            # this step's scale words came with the carry; the next step's load is issued now, so that no step's
            # decode waits for a load from GMEM (its latency lay on every step's path before)
            *w_smems, x_smem, (acc_ref, s_step) = refs
            s_next = scales(jnp.minimum(indices[0] + 1, steps - 1))
            wg = lax.axis_index("wg")
            rows = pl.ds(wg * ROWS_PER_WG, ROWS_PER_WG)
            for c, w_smem in enumerate(w_smems):  # issue each chunk's wgmma, then decode the next one
                words = plgpu.load(w_smem.at[rows], layout=plgpu.Layout.WGMMA)
                s_lo, s_hi = (lax.shift_right_logical(s_step, np.uint32(8 * (2 * c + b))) & np.uint32(0xFF)
                              for b in range(2))
                s_lo, s_hi = s_lo.astype(jnp.uint16), s_hi.astype(jnp.uint16)
                a = (_decode(words, s_lo, s_hi) if a_smem is None
                     else interpret_operand(a_smem.at[wg, c], _decode_values(words, s_lo, s_hi)))
                plgpu.wgmma(acc_ref, a, x_smem.at[:, pl.ds(c * K_CHUNK, K_CHUNK)].T)
            plgpu.wgmma_wait(1 if overlap else 0)  # overlap: the last chunk's wgmma runs into the next step
            return acc_ref, s_next

        def run_tile(tile_n: int):
            def epilogue(run_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((ROWS_PER_WG, tile_n), jnp.float32))
                def _(acc_ref):
                    run_pipeline((acc_ref, scales(0)))
                    plgpu.wgmma_wait(0)
                    wg = lax.axis_index("wg")
                    y_tile = y_smem.at[wg, pl.ds(0, tile_n)]
                    y_tile.T[...] = (acc_ref[...] * np.float32(2.0 ** SCALE_SHIFT)).astype(jnp.bfloat16)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(y_tile, y_gmem.at[pl.ds(row0, tile_n),
                                                              pl.ds(m * cta_rows + wg * ROWS_PER_WG, ROWS_PER_WG)])
                    plgpu.wait_smem_to_gmem(0)

            spec = plgpu.BlockSpec
            words_spec = [spec((cta_rows, K_CHUNK // 8), lambda s, c=c: (0, chunks * s + c),
                               transforms=(plgpu.TilingTransform((8, 8)), plgpu.SwizzleTransform(32)),
                               delay_release=int(overlap))
                          for c in range(chunks)]
            pipeline = plgpu.emit_pipeline_warp_specialized(
                step, grid=(steps,), memory_registers=40, wg_axis="wg",
                num_compute_wgs=warpgroups,
                max_concurrent_steps=max(_stages(tile_n, n_max, chunks, stages, warpgroups), 1 + int(overlap)),
                compute_context=epilogue,
                in_specs=[*words_spec,
                          spec((tile_n, chunks * K_CHUNK), lambda s: (0, s),
                               transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)),
                               delay_release=int(overlap))])
            words = w_gmem.at[e, pl.ds(m * cta_rows, cta_rows)]
            pipeline(*([words] * chunks), x_gmem.at[pl.ds(row0, tile_n)])

        for tile_n in sizes:
            pl.when((e >= 0) & (n_rows == tile_n))(functools.partial(run_tile, tile_n))

    run = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((x_RK.shape[0], f), jnp.bfloat16),
        grid=(f // cta_rows, tiles_I3.shape[0]), grid_names=("m", "i"), num_threads=warpgroups + 1,
        thread_name="wg", scratch_types=dict(y_smem=plgpu.SMEM((warpgroups, n_max, ROWS_PER_WG), jnp.bfloat16,
                                                        transforms=(plgpu.TilingTransform((8, 64)),
                                                                    plgpu.SwizzleTransform(128))),
                                             **interpret_scratch(interpret, warpgroups, chunks)),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    return run(tiles_I3, w_EFW, s_EFS, x_RK)


def interpret_scratch(interpret: bool, warpgroups: int, chunks: int) -> dict:
    """Interpret mode's extra scratch: a decoded A tile per compute warpgroup and K chunk (the Mosaic GPU
    interpreter takes wgmma's A operand from shared memory only, and runs no ``inline_mgpu``); none on the GPU."""
    return {"a_smem": plgpu.SMEM((warpgroups, chunks, ROWS_PER_WG, K_CHUNK), jnp.bfloat16)} if interpret else {}


def interpret_operand(a_ref, a_values: jax.Array):
    """Interpret mode's A operand: the decoded tile (logical values, ``_decode``'s) stored to ``a_ref``."""
    a_ref[...] = a_values
    return a_ref


def e2m1_values(codes: jax.Array) -> jax.Array:
    """e2m1 codes (int32, any shape) -> float32 values by arithmetic (a kernel can capture no table)."""
    e, m = (codes >> 1) & 3, (codes & 1).astype(jnp.float32)
    magnitude = jnp.where(e == 0, 0.5 * m, jnp.exp2((e - 1).astype(jnp.float32)) * (1 + 0.5 * m))
    return jnp.where(codes >= 8, -magnitude, magnitude)


def _decode_values(words, s_lo, s_hi):
    """``_decode``'s tile from logical arrays (interpret mode): words uint32 [64, 8], the rows' two scale bytes ->
    bf16 [64, 64]: the codes in natural order (code 8w + j is nibble j of word w, block k // 32) times
    2^(s - 127 - SCALE_SHIFT), then put in ``permute_k``'s order, as the fragment holds them."""
    nibble = lax.broadcasted_iota(jnp.uint32, (ROWS_PER_WG, 8, 8), 2) * jnp.uint32(4)
    codes = ((words[:, :, None] >> nibble) & jnp.uint32(15)).reshape(ROWS_PER_WG, K_CHUNK).astype(jnp.int32)
    first = lax.broadcasted_iota(jnp.int32, (ROWS_PER_WG, K_CHUNK), 1) < 32
    s = jnp.where(first, s_lo[:, None], s_hi[:, None]).astype(jnp.float32)
    return permute_k(e2m1_values(codes) * jnp.exp2(s - (127 + SCALE_SHIFT))).astype(jnp.bfloat16)


@plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, ROW_LAYOUT, ROW_LAYOUT),
                   return_type=plgpu.ShapeDtypeStruct((64, 64), jnp.bfloat16, layout=plgpu.Layout.WGMMA))
def _decode(ctx, words, s_lo, s_hi):
    """The register-level decode (Mosaic GPU's own arrays): words uint32 [64, 8] in the WGMMA layout and the rows'
    two ue8m0 bytes of this K step (uint16 [64] each) -> bf16 [64, 64] in the WGMMA layout, in ``permute_k``'s
    K order."""
    del ctx
    i32, bf16 = ir.IntegerType.get_signless(32), ir.BF16Type.get()
    layout = mgpu.WGMMA_LAYOUT
    lane_q = arith.remui(mgpu.utils.thread_idx(), arith.constant(i32, 4))
    first_block = arith.cmpi(arith.CmpIPredicate.ult, lane_q, arith.constant(i32, 2))
    # 2^(s - 1 - SCALE_SHIFT) as bf16: times a decoded code (e2m1 * 2^-126) it is e2m1 * 2^(s - 127 - SCALE_SHIFT)
    lo, hi = (((s + (126 - SCALE_SHIFT)) << 7).bitcast(bf16).broadcast_in_dim((64, 16), (0,), layout)
              for s in (s_lo, s_hi))
    scale = np.empty(lo.registers.shape, dtype=object)
    for idx, reg in np.ndenumerate(lo.registers):
        scale[idx] = arith.select(first_block, reg, hi.registers[idx])
    out = np.empty(layout.registers_shape((64, 64)), dtype=object)
    const = lambda reg, v: vector.broadcast(reg.type, arith.constant(i32, v))
    for j in range(4):  # nibbles j and j + 4 of each word: columns 16j .. 16j + 15 of the fragment
        regs = np.empty(layout.registers_shape((64, 16)), dtype=object)
        for idx, reg in np.ndenumerate(words.registers):  # vector<2 x i32>: the thread's words 2q and 2q + 1
            v = arith.shrui(reg, const(reg, 4 * j)) if j else reg
            bits = arith.ori(arith.shli(arith.andi(v, const(reg, 0x00070007)), const(reg, 6)),
                             arith.shli(arith.andi(v, const(reg, 0x00080008)), const(reg, 12)))
            pairs = vector.bitcast(ir.VectorType.get([4], bf16), bits)
            for h in range(2):  # word 2q + h -> the fragment's column tile h (columns 8h + 2q, 8h + 2q + 1)
                regs[(idx[0], h, *idx[2:])] = vector.extract_strided_slice(
                    ir.VectorType.get([2], bf16), pairs, [2 * h], [2], [1])
        tile = mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)
        tile = tile * mgpu.FragmentedArray(_registers=scale, _layout=layout, _is_signed=None)
        for idx, reg in np.ndenumerate(tile.registers):
            out[(idx[0], 2 * j + idx[1], *idx[2:])] = reg
    return mgpu.FragmentedArray(_registers=out, _layout=layout, _is_signed=None)
