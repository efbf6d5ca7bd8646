"""Attention on the ragged paged step: window ring, compressor, indexer with two-level top-k, sparse attention.

Everything follows v41_spec §4-§5 and the reference's index-list layout (so the blocked online softmax of
``sparse_attn`` sees the same blocks): per query, the list is [window part | compressed part], where the window
part has width ``min(chunk, W)`` for a sequence prefilled from position 0 in this step (valid entries first, in
position order) and width ``W`` otherwise (the ring listed oldest first, unwritten slots first as -1), and the
compressed part lists the selected compressed positions in ascending order, -1 padded.

Letters: T tokens, S sequence rows, H heads, K head dim, W window, P compressed positions of a sequence,
I indexer heads, J indexer head dim, N top-k entries, L list length, Q q-lora rank, G output groups,
O o-lora rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dijax.config import LayerRole, ModelConfig
from dijax.kernels.sparse_attn import sparse_attn
from dijax.kernels import indexer, quant
from dijax.kernels.latents import latents
from dijax.kernels.topk import topk_ascending
from dijax.kernels.numerics import divide, einsum_bf16, large_step, rms_norm
from dijax.kernels.rope import rope, rope_frequencies
from dijax.model.layers import QuantLinear, RMSNorm, linear, linears, matmul_promoted, param, values
from dijax.model.step import StepBatch

NEG_INF = indexer.NEG_INF


@dataclass(frozen=True)
class Geometry:
    """Per-token facts of a step shared by every layer (computed once per step)."""

    pos_T: jax.Array
    seq_T: jax.Array
    valid_T: jax.Array
    slot_T: jax.Array
    start_T: jax.Array
    end_T: jax.Array
    token_T: jax.Array  # index of the token in T
    block_table_SB: jax.Array
    window_idx_TW: jax.Array  # indices into [ring rows (num_slots * W) | this step's new K rows (T)]
    window_width_T: jax.Array  # width of the window part of the reference index list
    ring_write_T: jax.Array  # flat ring row to write each token's K into (out of range = skip)
    num_ring_rows: int


def geometry(batch: StepBatch, num_slots: int, window: int) -> Geometry:
    """Derive the shared per-token quantities of a step from its batch."""
    pos, seq, valid = batch.positions_T, batch.seq_T, batch.valid_T
    t = pos.shape[0]
    slot, start = batch.slot_S[seq], batch.start_S[seq]
    qlen = batch.qlen_S[seq]
    end = start + qlen
    token = jnp.arange(t, dtype=jnp.int32)
    lane = jnp.arange(window, dtype=jnp.int32)[None, :]
    from_zero = (start == 0)[:, None]
    width = jnp.where(start == 0, jnp.minimum(qlen, window), window)
    # prefill layout: positions max(0, p-W+1)+l, left-aligned; ring layout: p-W+1+l, oldest first
    wpos = jnp.where(from_zero, jnp.maximum(pos[:, None] - window + 1, 0) + lane, pos[:, None] - window + 1 + lane)
    wvalid = jnp.where(from_zero, (wpos <= pos[:, None]) & (lane < width[:, None]), wpos >= 0)
    wvalid = wvalid & valid[:, None]
    num_ring = num_slots * window
    new_row = num_ring + token[:, None] - (pos[:, None] - wpos)
    ring_row = slot[:, None] * window + jnp.mod(wpos, window)
    window_idx = jnp.where(wvalid, jnp.where(wpos >= start[:, None], new_row, ring_row), -1)
    writes = valid & (pos >= end - window)
    ring_write = jnp.where(writes, slot * window + pos % window, num_ring)
    return Geometry(pos_T=pos, seq_T=seq, valid_T=valid, slot_T=slot, start_T=start, end_T=end, token_T=token,
                    block_table_SB=batch.block_table_SB, window_idx_TW=window_idx.astype(jnp.int32),
                    window_width_T=width, ring_write_T=ring_write, num_ring_rows=num_ring)


def _sequence_rows(block_table_SB: jax.Array, rows_per_block: int) -> jax.Array:
    """Flat pool rows of every compressed position of every sequence row: int32 [S, B * rows_per_block]."""
    s, b = block_table_SB.shape
    j = jnp.arange(b * rows_per_block, dtype=jnp.int32)
    return block_table_SB[:, j // rows_per_block] * rows_per_block + (j % rows_per_block)[None, :]


def compressor(p: dict, role: LayerRole, x_TD: jax.Array, g: Geometry, cache: dict, eps: float,
               linear_impl: str = "reference"):
    """Compress the step's tokens into latents (pre-RoPE) for the groups they complete.

    Returns (latent_TK bf16, emit_T bool, group_T int32, new tail (kv, score) or None). A token emits the latent of
    group ``p // r`` when ``(p + 1) % r == 0``; group members before the step come from the slot's tail state.
    """
    r = role.ratio
    if r == 1:
        return rms_norm(linear(x_TD, p["wkv"], linear_impl), p["norm"]["weight"], eps), g.valid_T, g.pos_T, None
    key = str(role.layer)
    tail_kv, tail_score = cache["tail_kv"][key], cache["tail_score"][key]
    # the reference holds these weights in fp32 (promoted at load); dijax stores bf16 (matmul_promoted)
    kv_TK = matmul_promoted(x_TD, p["wkv"]["weight"])
    score_TK = matmul_promoted(x_TD, p["wgate"]["weight"])
    t = x_TD.shape[0]
    members_kv, members_score = [], []
    for i in range(r):
        q = g.pos_T - (r - 1) + i
        new = jnp.clip(g.token_T - (r - 1 - i), 0, t - 1)
        from_new = (q >= g.start_T)[:, None]
        members_kv.append(jnp.where(from_new, kv_TK[new], tail_kv[g.slot_T, jnp.mod(q, r)]))
        members_score.append(jnp.where(from_new, score_TK[new], tail_score[g.slot_T, jnp.mod(q, r)]))
    kv_TRK, score_TRK = jnp.stack(members_kv, 1), jnp.stack(members_score, 1)
    weights = jnp.exp(score_TRK - jnp.max(score_TRK, axis=1, keepdims=True))
    weights = divide(weights, jnp.sum(weights, axis=1, keepdims=True))
    pooled = jnp.sum(kv_TRK * weights, axis=1).astype(jnp.bfloat16)
    latent = rms_norm(pooled, p["norm"]["weight"], eps)
    emit = g.valid_T & ((g.pos_T + 1) % r == 0)
    # the trailing partial group of each sequence waits in the slot for the next step
    keep = g.valid_T & (g.pos_T >= (g.end_T // r) * r)
    flat = jnp.where(keep, g.slot_T * r + g.pos_T % r, tail_kv.shape[0] * r)
    new_kv = tail_kv.reshape(-1, tail_kv.shape[-1]).at[flat].set(kv_TK, mode="drop").reshape(tail_kv.shape)
    new_score = tail_score.reshape(-1, tail_score.shape[-1]).at[flat].set(score_TK, mode="drop")
    return latent, emit, g.pos_T // r, (new_kv, new_score.reshape(tail_score.shape))


def _write_paged(pool_BPK: jax.Array, g: Geometry, group_T: jax.Array, emit_T: jax.Array,
                 values_TK: jax.Array) -> jax.Array:
    rows = pool_BPK.shape[1]
    block = jnp.take_along_axis(g.block_table_SB[g.seq_T], (group_T // rows)[:, None], axis=1)[:, 0]
    flat = jnp.where(emit_T, block * rows + group_T % rows, pool_BPK.shape[0] * rows)
    out = pool_BPK.reshape(-1, pool_BPK.shape[-1]).at[flat].set(values_TK.astype(pool_BPK.dtype), mode="drop")
    return out.reshape(pool_BPK.shape)


def select_candidate_blocks(score_TP: jax.Array, visible_T: jax.Array, topk_blocks: int,
                            block_size: int, *, impl: str = "reference") -> jax.Array:
    """Level one of the two-level top-k: the best ``topk_blocks`` blocks of ``block_size`` positions.

    score_TP: float32 masked scores (-inf unreachable). The block holding the newest visible position is pinned;
    picks with a -inf block score are dropped. ``impl`` picks the top-k implementation (``kernels.topk``; all give
    the same picks). Returns the picked block numbers int32 [T, min(topk_blocks, blocks)] in ascending order (the
    set is what counts: ``topk_ascending`` needs no sort), -1 where dropped (``candidate_mask`` turns them into a
    position mask): [T, topk_blocks] instead of a [T, P] mask is what a step publishes to the later index layers,
    whatever the context length.
    """
    t, width = score_TP.shape
    nb = -(-width // block_size)
    padded = jnp.pad(score_TP, ((0, 0), (0, nb * block_size - width)), constant_values=NEG_INF)
    block_max = jnp.max(padded.reshape(t, nb, block_size), axis=-1)
    last = jnp.floor_divide(visible_T - 1, block_size)
    block_max = jnp.where(jnp.arange(nb)[None, :] == last[:, None], jnp.inf, block_max)
    picks = topk_ascending(block_max, min(topk_blocks, nb), impl=impl)
    return jnp.where(jnp.take_along_axis(block_max, picks, axis=1) > NEG_INF, picks, -1).astype(jnp.int32)


def candidate_mask(picks_TK: jax.Array, width: int, block_size: int) -> jax.Array:
    """The positions of the picked candidate blocks (``select_candidate_blocks``' picks_TK, -1 = none) as a bool
    mask [T, width]."""
    t = picks_TK.shape[0]
    nb = -(-width // block_size)
    blocks_TK = jnp.where(picks_TK >= 0, picks_TK, nb)  # -1 lands in a spare column that is cut off
    kept = jnp.zeros((t, nb + 1), bool).at[jnp.arange(t)[:, None], blocks_TK].set(True)[:, :nb]
    return jnp.repeat(kept, block_size, axis=1)[:, :width]


INDEX_CHUNK_ELEMENTS = 2 ** 26  # elements one index-selection chunk may hold per [tokens, ...] array (256 MiB fp32)


def index_chunk(tokens: int, per_token: int) -> int:
    """Tokens per index-selection chunk (``index_select``): all ``tokens`` when ``tokens * per_token`` elements fit
    INDEX_CHUNK_ELEMENTS, else the largest power of two of tokens that does (at least one)."""
    if tokens * per_token <= INDEX_CHUNK_ELEMENTS:
        return tokens
    chunk = 1
    while 2 * chunk * per_token <= INDEX_CHUNK_ELEMENTS:
        chunk *= 2
    return chunk


def index_select(p: dict, role: LayerRole, cfg: ModelConfig, x_TD: jax.Array, qr_TQ: jax.Array,
                 keys_NJ: jax.Array, rows_SP: jax.Array, g: Geometry, visible_T: jax.Array, freqs: np.ndarray,
                 candidates_TK: jax.Array | None, *, linear_impl: str = "reference", indexer_impl: str = "reference",
                 topk_impl: str = "reference") -> tuple[jax.Array, jax.Array | None]:
    """An index source's selection: lightning-indexer scores in the reference's bf16 order over the paged key pool
    ``keys_NJ`` (pool row of each sequence position: ``rows_SP``), masked by the candidate blocks for a layer that
    uses them, then the top-k positions (``topk_positions``).

    The queries and head weights are computed here, the scores by ``kernels.indexer`` (``indexer_impl``). Every
    token's selection is its own, so the tokens run in chunks of ``index_chunk`` (a loop only when the step's
    largest per-token array would exceed INDEX_CHUNK_ELEMENTS: a long prefill chunk at a long context; that array
    is the [T, P] scores with the kernel, the reference's gathered keys and per-head scores, [T, P, J] and
    [T, I, P], without it): the selection never takes more memory than that, whatever the context.

    candidates_TK: the candidate source's picks (``select_candidate_blocks``), read when ``role.uses_candidates``.
    Returns (sel_TN int32 [T, index_topk], ascending, -1 padded; the candidate picks [T, Kb] when
    ``role.candidate_source``, else ``candidates_TK``).
    """
    t = x_TD.shape[0]
    n_heads, head_dim = cfg.index_n_heads, cfg.index_head_dim
    q_TIJ = linear(qr_TQ, p["wq_b"], linear_impl).reshape(t, n_heads, head_dim)
    q_TIJ = quant.fq4_pow2(rope(q_TIJ, g.pos_T, freqs), 32)
    w_TI = linear(x_TD, p["weights_proj"]).astype(jnp.float32) * np.float32(head_dim ** -0.5 * n_heads ** -0.5)
    width = rows_SP.shape[1]

    def select(q_CIJ, w_CI, seq_C, visible_C, cand_CK):
        score_CP = indexer.index_scores(q_CIJ, w_CI, keys_NJ, rows_SP, seq_C, visible_C, impl=indexer_impl)
        if role.candidate_source:
            cand_CK = select_candidate_blocks(score_CP, visible_C, cfg.candidate_topk_blocks,
                                              cfg.candidate_block_size, impl=topk_impl)
        elif role.uses_candidates:
            score_CP = jnp.where(candidate_mask(cand_CK, width, cfg.candidate_block_size), score_CP, NEG_INF)
        return topk_positions(score_CP, visible_C, cfg.index_topk, impl=topk_impl), cand_CK

    cand_TK = candidates_TK if role.uses_candidates else jnp.zeros((t, 0), jnp.int32)
    xs = (q_TIJ, w_TI.astype(jnp.bfloat16), g.seq_T, visible_T, cand_TK)
    chunk = index_chunk(t, width if indexer_impl == "pallas" else width * (head_dim + n_heads))
    if chunk == t:
        sel_TN, cand_TK = select(*xs)
    else:  # padded tokens see no position: their picks are all -1, and they are cut off after
        n = -(-t // chunk)

        def chunks(a):
            a = jnp.pad(a, [(0, n * chunk - t)] + [(0, 0)] * (a.ndim - 1))
            return a.reshape(n, chunk, *a.shape[1:])

        sel_TN, cand_TK = (a.reshape(n * chunk, -1)[:t] for a in jax.lax.map(lambda c: select(*c),
                                                                             tuple(chunks(a) for a in xs)))
    return sel_TN, (cand_TK if role.candidate_source else candidates_TK)


def topk_positions(score_TP: jax.Array, visible_T: jax.Array, k: int, *, impl: str = "reference") -> jax.Array:
    """Top-k compressed positions per query, ascending, -1 padded: int32 [T, k]. score_TP float32, -inf at every
    position >= visible_T (and wherever else a position is excluded); no NaN.

    The reference ranks a row's positions by ``lax.top_k`` (values descending, ties to the lower position), keeps the
    first ``min(index_topk, end // ratio)`` and drops the invisible ones. ``end`` is the sequence's end after this
    step, so that rank limit is at least ``min(k, visible)``; and every invisible position holds the lowest value
    and lies after every visible one, so the top ``min(k, visible)`` ranks are all visible. The limit therefore
    drops nothing the visibility test keeps: the result is the visible positions of the top-k set, which in
    position order come first (``topk_ascending``: no sort for the select and Pallas implementations, and none at
    all when the row has at most k positions). ``impl`` picks the top-k implementation (all give the same set).
    """
    t, width = score_TP.shape
    if width < k:  # every position is a pick (the reference pads the row with -inf to k; topk_ascending takes k = P)
        ordered = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (t, k))
    else:
        ordered = topk_ascending(score_TP, k, impl=impl)
    return jnp.where(ordered < visible_T[:, None], ordered, -1).astype(jnp.int32)


def attend_lists(q_THK: jax.Array, ring_RK: jax.Array, kv_TK: jax.Array, pool_NK: jax.Array | None,
                 win_idx_TW: jax.Array, width_T: jax.Array, comp_idx_TC: jax.Array | None, sink_H: jax.Array,
                 softmax_scale: float, *, impl: str = "reference") -> jax.Array:
    """Sparse attention of each query over its window rows and its compressed rows (v41_spec §4 steps 4-5).

    ring_RK: the window rings' rows before this step; kv_TK: this step's rows; pool_NK: the compressed rows (None in
    a layer without them). win_idx_TW: int32 indices into [ring | kv], read in lanes [0, width_T) only;
    comp_idx_TC: int32 indices into [ring | kv | pool] (-1 = none), or None. Returns bf16 [T, H, K].

    Each token's list is its window part in lanes [0, width_T) and its compressed part right after, the order in
    which DeepSeek's kernel walks them: the 64-lane blocks, whose running max P is rounded against, are the same
    for both implementations. In a large step (``numerics.large_step``: prefill) the Pallas kernel reads the window
    rows as one source ([ring | kv], one copy) and takes width_T as the lane where the pool starts
    (``sparse_attn_pallas``' ``first_T``), so the blocks on either side each read one source and their gathers
    pipeline (prefill 8192 1.4-1.5 % faster on the H200, twenty-sixth session). A smaller step reads the three
    sources as they are: the copy holds every slot's ring (num_slots x window rows a layer) whatever the batch, so
    at decode it can cost what it saves (batch 64 of 64 slots: -0.5 to -1.2 %).
    """
    window = win_idx_TW.shape[1]
    width = width_T[:, None]
    if comp_idx_TC is None:
        idx_TL = jnp.where(jnp.arange(window)[None, :] < width, win_idx_TW, -1)
    else:
        n = comp_idx_TC.shape[1]
        lane = jnp.arange(window + n)[None, :]
        win_part = jnp.take_along_axis(win_idx_TW, jnp.clip(lane, 0, window - 1), axis=1)
        comp_part = jnp.take_along_axis(comp_idx_TC, jnp.clip(lane - width, 0, n - 1), axis=1)
        idx_TL = jnp.where(lane < width, win_part, jnp.where(lane - width < n, comp_part, -1))
    if impl != "pallas" or not large_step(q_THK.shape[0]):
        sources = (ring_RK, kv_TK) if pool_NK is None else (ring_RK, kv_TK, pool_NK)
        return sparse_attn(q_THK, sources, idx_TL, sink_H, softmax_scale, impl=impl)
    window_WK = jnp.concatenate([ring_RK, kv_TK])
    if pool_NK is None:
        return sparse_attn(q_THK, (window_WK,), idx_TL, sink_H, softmax_scale, impl=impl)
    return sparse_attn(q_THK, (window_WK, pool_NK), idx_TL, sink_H, softmax_scale, impl=impl, first_T=width_T)


def attention(p: dict, role: LayerRole, cfg: ModelConfig, x_TD: jax.Array, g: Geometry, cache: dict,
              shared: dict, inject_TN: jax.Array | None, *, topk_impl: str = "reference",
              sparse_attn_impl: str = "reference", linear_impl: str = "reference", indexer_impl: str = "reference",
              latents_impl: str = "reference"):
    """One attention sublayer on the ragged step.

    x_TD: bf16 attention input (after attn_norm). ``cache`` holds the layer's arrays (updated copies are
    returned in the new cache dict); ``shared`` carries what sources publish to later layers in this step:
    {"topk": {layer: [T, N]}, "candidates": picked blocks [T, Kb]}. ``topk_impl`` ("reference" | "select" |
    "pallas") and ``sparse_attn_impl``, ``linear_impl`` (the fp8 linears) and ``indexer_impl`` (the index scores), each
    "reference" | "pallas", pick the kernel implementations (static): the top-k picks are identical, the attention
    output, the linears and the index scores agree to bf16 rounding (``kernels.sparse_attn``,
    ``kernels.fp8_linear``, ``kernels.indexer``); so do ``latents_impl``'s query latent and KV row after the first
    projections (``kernels.latents``).
    Returns (y_TD bf16, cache updates dict, shared).
    """
    t = x_TD.shape[0]
    eps = cfg.norm_eps
    key = str(role.layer)
    if role.compressed:
        freqs = rope_frequencies(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.original_seq_len, cfg.rope_factor,
                                 cfg.beta_fast, cfg.beta_slow)
    else:
        freqs = rope_frequencies(cfg.rope_head_dim, cfg.rope_theta, 0, cfg.rope_factor, cfg.beta_fast,
                                 cfg.beta_slow)
    [qkva] = linears(x_TD, [p["wq_a"], p["wkv"]], linear_impl, joined=True)  # one launch on the Pallas path
    qr, kv = latents(qkva, cfg.q_lora_rank, p["q_norm"]["weight"], p["kv_norm"]["weight"], g.pos_T, freqs, eps,
                     impl=latents_impl)
    q = rope(linear(qr, p["wq_b"], linear_impl).reshape(t, cfg.n_heads, cfg.head_dim), g.pos_T, freqs)

    ring = cache["window"][role.layer]
    ring_rows = ring.reshape(-1, cfg.head_dim)
    updates: dict = {"window": (role.layer, ring_rows.at[g.ring_write_T].set(kv, mode="drop").reshape(ring.shape))}
    pool = comp_idx = None

    if role.compressed:
        r = role.ratio
        if role.kv_source:
            latent, emit, group, tail = compressor(p["compressor"], role, x_TD, g, cache, eps, linear_impl)
            if tail is not None:
                updates["tail"] = (key, tail)
            if role.owns_index_keys:
                ip = p["indexer"]
                k_idx = rms_norm(linear(latent, ip["wk"]), ip["k_norm"]["weight"], eps)
                k_idx = quant.fq4_pow2(rope(k_idx, group * r, freqs), 32)
                updates["ik"] = (key, _write_paged(cache["ik"][key], g, group, emit, k_idx))
            latent = quant.fq4_e4m3(rope(latent, group * r, freqs), 16)
            updates["ckv"] = (key, _write_paged(cache["ckv"][key], g, group, emit, latent))
        kv_key = str(role.kv_from)
        ckv = updates["ckv"][1] if role.kv_source else cache["ckv"][kv_key]
        rows_per_block = ckv.shape[1]
        seq_rows_SP = _sequence_rows(g.block_table_SB, rows_per_block)
        visible = (g.pos_T + 1) // r
        if role.index_source:
            if inject_TN is not None:
                sel = inject_TN.astype(jnp.int32)
            else:
                ik_key = str(role.index_keys_from)
                ik = updates["ik"][1] if role.owns_index_keys else cache["ik"][ik_key]
                sel, shared["candidates"] = index_select(
                    p["indexer"], role, cfg, x_TD, qr, ik.reshape(-1, ik.shape[-1]), seq_rows_SP, g, visible, freqs,
                    shared["candidates"], linear_impl=linear_impl, indexer_impl=indexer_impl, topk_impl=topk_impl)
            shared["topk"][role.layer] = sel
        sel = shared["topk"][role.topk_from]
        flat = seq_rows_SP[g.seq_T[:, None], jnp.maximum(sel, 0)]  # [T, N] (no [T, P] copy of the rows)
        comp_idx = jnp.where(sel >= 0, g.num_ring_rows + t + flat, -1)
        pool = ckv.reshape(-1, cfg.head_dim)

    o = attend_lists(q, ring_rows, kv, pool, g.window_idx_TW, g.window_width_T, comp_idx, p["attn_sink"],
                     cfg.head_dim ** -0.5, impl=sparse_attn_impl)
    o = rope(o, g.pos_T, freqs, inverse=True)
    groups = cfg.o_groups
    wo_a = p["wo_a"]["weight"].reshape(groups, cfg.o_lora_rank, -1)
    u = einsum_bf16("tgd,grd->tgr", o.reshape(t, groups, -1), wo_a)
    return linear(u.reshape(t, -1), p["wo_b"], linear_impl), updates, shared


class Compressor(nnx.Module):
    """Parameters of a KV source's compressor (math: ``compressor``): bf16 ``wkv`` [K, D], for ratio > 1 also
    ``wgate`` [K, D] (both multiplied in fp32, as the reference's fp32 promotion does), ``norm`` [K]."""

    def __init__(self, cfg: ModelConfig, role: LayerRole, stack: tuple[int, ...] = ()):
        gated = role.ratio > 1
        self.wkv = QuantLinear(cfg.dim, cfg.head_dim, "bf16", ("head_dim", "embed"), stack, upcast=gated)
        if gated:
            self.wgate = QuantLinear(cfg.dim, cfg.head_dim, "bf16", ("head_dim", "embed"), stack, upcast=True)
        self.norm = RMSNorm(cfg.head_dim, cfg.norm_eps, "head_dim", stack)


class Indexer(nnx.Module):
    """Parameters of an index source's lightning indexer (math: ``index_scores``): fp8 ``wq_b`` [I * J, Q], bf16
    ``weights_proj`` [I, D]; a source that owns its index keys also has bf16 ``wk`` [J, K] and ``k_norm`` [J]."""

    def __init__(self, cfg: ModelConfig, role: LayerRole, stack: tuple[int, ...] = ()):
        i, j = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = QuantLinear(cfg.q_lora_rank, i * j, "fp8", ("index_heads_dim", "q_lora"), stack)
        self.weights_proj = QuantLinear(cfg.dim, i, "bf16", ("index_heads", "embed"), stack)
        if role.owns_index_keys:
            self.wk = QuantLinear(cfg.head_dim, j, "bf16", ("index_dim", "head_dim"), stack)
            self.k_norm = RMSNorm(j, cfg.norm_eps, "index_dim", stack)


class Attention(nnx.Module):
    """One attention sublayer (checkpoint ``attn``), its parts decided by the layer's role: fp8 ``wq_a``, ``wq_b``,
    ``wkv``, ``wo_b``; bf16 ``wo_a`` (held dequantised, as the converter writes it); bf16 ``q_norm``, ``kv_norm``;
    fp32 ``attn_sink`` [H]; a ``compressor`` on KV sources and an ``indexer`` on index sources."""

    def __init__(self, cfg: ModelConfig, role: LayerRole, stack: tuple[int, ...] = ()):
        self.cfg, self.role = cfg, role
        hk = cfg.n_heads * cfg.head_dim
        self.wq_a = QuantLinear(cfg.dim, cfg.q_lora_rank, "fp8", ("q_lora", "embed"), stack)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, "q_lora", stack)
        self.wq_b = QuantLinear(cfg.q_lora_rank, hk, "fp8", ("heads_dim", "q_lora"), stack)
        self.wkv = QuantLinear(cfg.dim, cfg.head_dim, "fp8", ("head_dim", "embed"), stack)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, "head_dim", stack)
        self.wo_a = QuantLinear(hk // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, "bf16", ("o_lora", "o_group_in"),
                                stack)
        self.wo_b = QuantLinear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, "fp8", ("embed", "o_lora"), stack)
        self.attn_sink = param(stack, (cfg.n_heads,), jnp.float32, ("heads",))
        if role.kv_source:
            self.compressor = Compressor(cfg, role, stack)
        if role.index_source:
            self.indexer = Indexer(cfg, role, stack)

    def __call__(self, x_TD: jax.Array, g: Geometry, cache: dict, shared: dict, inject_TN: jax.Array | None,
                 **kernel_options):
        """See ``attention`` (same arguments after the parameters, same results)."""
        return attention(values(self), self.role, self.cfg, x_TD, g, cache, shared, inject_TN, **kernel_options)
