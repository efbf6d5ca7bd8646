"""The DeepSeek-V4.1 text model as one pure function of (params, cache, step batch): ``forward_step``.

embed -> C streams -> [Engram] -> blocks (hyper-connected attention and MoE) -> collapse -> norm -> fp32 head.
The cache is updated functionally and returned (the caller donates it, so XLA updates it in place).

Letters: T tokens, C hc copies, D model dim, R logit rows, V vocab, N top-k entries.
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Any

import jax
import jax.numpy as jnp

from dijax.config import ModelConfig
from dijax.model import engram as engram_lib
from dijax.model import hc
from dijax.model.attention import Geometry, attention, geometry
from dijax.model.layers import matmul_f32, rms_norm
from dijax.model.moe import moe
from dijax.model.step import StepBatch


def _engram_rows(consts: dict, cfg: ModelConfig, batch: StepBatch, g: Geometry, history: jax.Array):
    """Hash rows of every Engram layer [E][T, J] and the updated per-slot id history."""
    n = cfg.engram_max_ngram_size
    ring = n - 1
    t = g.pos_T.shape[0]
    ids_T = consts["token_map"][batch.tokens_T]
    ids_T = jnp.where(batch.engram_mask_T, ids_T, engram_lib.DEAD)
    cols = []
    for s in range(n):
        q = g.pos_T - s
        from_new = q >= g.start_T
        cols.append(jnp.where(from_new, ids_T[jnp.clip(g.token_T - s, 0, t - 1)],
                              history[g.slot_T, jnp.mod(q, ring)]))
    window_TG = engram_lib.ngram_window(jnp.stack(cols, axis=1), g.pos_T, consts["pad_id"])
    rows = [engram_lib.hash_rows(window_TG, consts, e) for e in range(len(cfg.engram_layer_ids))]
    keep = g.valid_T & (g.pos_T >= g.end_T - ring)
    flat = jnp.where(keep, g.slot_T * ring + g.pos_T % ring, history.size)
    new_history = history.reshape(-1).at[flat].set(ids_T, mode="drop").reshape(history.shape)
    return rows, new_history


def _apply_updates(cache: dict, updates: dict) -> None:
    for kind, (key, value) in updates.items():
        if kind == "window":
            cache["window"][key] = value
        elif kind == "tail":
            cache["tail_kv"][key], cache["tail_score"][key] = value
        else:
            cache[kind][key] = value


def forward_step(params: dict, cache: dict, batch: StepBatch, consts: dict, cfg: ModelConfig,
                 inject_topk: dict[int, jax.Array] | None = None) -> tuple[jax.Array, dict, dict[int, jax.Array]]:
    """Run one ragged step.

    params: checkpoint pytree (see dijax.io.checkpoint); cache: see dijax.model.step; consts: Engram device arrays
    (``EngramTables.device_arrays()`` plus ``pad_id``), may be empty without Engram; inject_topk: optional
    {index-source layer: int32 [T, N] compressed positions} overriding that layer's selection (a test seam).

    Returns (logits_RV float32 for ``batch.logit_rows_R``, the new cache, {index-source layer: selected
    compressed positions int32 [T, N], ascending, -1 padded}).
    """
    num_slots, window = cache["window"][0].shape[:2]
    g = geometry(batch, num_slots, window)
    new_cache: dict[str, Any] = {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
                                 for k, v in cache.items()}
    x_TD = params["embed"]["weight"][batch.tokens_T]
    x_TCD = jnp.broadcast_to(x_TD[:, None, :], (x_TD.shape[0], cfg.hc_mult, cfg.dim))
    pre_mix = jnp.zeros((x_TD.shape[0], cfg.hc_mult), jnp.float32).at[:, 0].set(1.0)
    engram_rows = None
    if cfg.engram_layer_ids:
        engram_rows, new_cache["engram_hist"] = _engram_rows(consts, cfg, batch, g, cache["engram_hist"])
    shared: dict = {"topk": {}, "candidates": None}
    mix = partial(hc.mixes, hc_mult=cfg.hc_mult, iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
                  norm_eps=cfg.norm_eps)
    for role in cfg.roles:
        lp = params["layers"][role.layer]
        if role.engram:
            x_TCD = engram_lib.engram(lp["engram"], x_TCD, engram_rows[role.engram_index],
                                      batch.engram_mask_T & g.valid_T, cfg.norm_eps)
        residual = x_TCD
        a_pre, a_post, a_comb = mix(x_TCD, lp["hc_attn_fn"], lp["hc_attn_scale"], lp["hc_attn_base"])
        y = rms_norm(hc.pre(x_TCD, pre_mix), lp["attn_norm"]["weight"], cfg.norm_eps)
        inject = None if inject_topk is None else inject_topk.get(role.layer)
        y, updates, shared = attention(lp["attn"], role, cfg, y, g, new_cache, shared, inject)
        _apply_updates(new_cache, updates)
        x_TCD = hc.post(y, residual, a_post, a_comb)
        residual = x_TCD
        f_pre, f_post, f_comb = mix(x_TCD, lp["hc_ffn_fn"], lp["hc_ffn_scale"], lp["hc_ffn_base"])
        y = rms_norm(hc.pre(x_TCD, a_pre), lp["ffn_norm"]["weight"], cfg.norm_eps)
        x_TCD = hc.post(moe(lp["ffn"], y, cfg), residual, f_post, f_comb)
        pre_mix = f_pre
    rows = batch.logit_rows_R
    h = rms_norm(hc.pre(x_TCD[rows], pre_mix[rows]), params["norm"]["weight"], cfg.norm_eps)
    logits = matmul_f32(h.astype(jnp.float32), params["head"]["weight"])
    return logits, new_cache, shared["topk"]


@lru_cache(maxsize=8)
def make_step_fn(cfg: ModelConfig):
    """``jit(forward_step)`` with the cache donated: step(params, cache, batch, consts, inject_topk).

    Cached per config, so every driver or runner of one model shares its compiled executables.
    """
    def step(params, cache, batch, consts, inject_topk=None):
        return forward_step(params, cache, batch, consts, cfg, inject_topk)

    return jax.jit(step, donate_argnums=(1,))
