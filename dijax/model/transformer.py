"""The DeepSeek-V4.1 text model as Flax NNX modules, and the step as one pure function of (params, cache, batch):
``forward_step``.

embed -> C streams -> [Engram] -> blocks (hyper-connected attention and MoE) -> collapse -> norm -> fp32 head.

``Transformer`` holds the parameters (module paths follow the checkpoint names, dijax.model.param_map). Its
blocks are grouped as dijax.model.plan cuts the backbone: one ``Stage`` per planned stage, holding one ``Block``
per run of its period, with parameters stacked over (period repeat, layer in run). A stage runs its repeats under
``lax.scan`` and a run its layers under ``lax.scan``, so the step compiles one body per distinct block, not one
per layer. The big weights (``IN_PLACE``: the fp8 linears' and routed experts') are not sliced per layer: a layer
hands its kernels ``LayerSlice``s of the whole stack (dijax.kernels.stacked), because a slice that feeds a kernel
or an inner scan is a copy. The cache is updated functionally and returned (the caller donates it, so XLA updates
it in place).

``forward_step(params, ...)`` takes the model's ``nnx.State``; the graph definition comes from the config
(``graphdef``, computed once per config) and ``nnx.merge`` runs inside the trace.

Letters: T tokens, C hc copies, D model dim, R logit rows, V vocab, N top-k entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dijax.config import LayerRole, ModelConfig
from dijax.kernels.options import REFERENCE
from dijax.kernels.stacked import of_layer
from dijax.model import engram as engram_lib
from dijax.model import hc
from dijax.model.attention import Attention, Geometry, geometry
from dijax.model.engram import Engram
from dijax.model.hc import HyperConnection
from dijax.model.layers import IN_PLACE, Embed, QuantLinear, RMSNorm
from dijax.model.moe import MoE
from dijax.model.plan import StagePlan, plan_layers
from dijax.model.step import StepBatch


def _engram_rows(consts: dict, cfg: ModelConfig, batch: StepBatch, g: Geometry, history: jax.Array):
    """Hash rows of every Engram layer [E][T, J] and the updated per-slot id history."""
    n = cfg.engram_max_ngram_size
    ring = n - 1
    t = g.pos_T.shape[0]
    ids_T = consts["token_map"][batch.tokens_T]
    ids_T = jnp.where(batch.valid_T, ids_T, engram_lib.DEAD)
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


# the kernel options attention() takes
ATTENTION_OPTIONS = ("topk_impl", "sparse_attn_impl", "linear_impl", "indexer_impl", "latents_impl")


@dataclass(frozen=True)
class StepContext:
    """What every block of one step reads besides its own parameters and cache (built once per step)."""

    geometry: Geometry
    engram_rows: list | None  # per Engram layer, int32 [T, J] table rows
    kernel_options: dict


class Block(nnx.Module):
    """One backbone layer built from its ``LayerRole``: optional ``engram``, then ``hc_attn`` / ``attn_norm`` /
    ``attn`` and ``hc_ffn`` / ``ffn_norm`` / ``ffn`` (checkpoint ``layers.L.*``; ``hc_attn_fn`` is ``hc_attn.fn``).

    stack: leading (period, layer) sizes when the block stands for several stacked layers.
    """

    def __init__(self, cfg: ModelConfig, role: LayerRole, stack: tuple[int, ...] = ()):
        self.role = role
        if role.engram:
            self.engram = Engram(cfg, cfg.engram_num_embeddings[role.engram_index], stack)
        hc_args = (cfg.dim, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps, stack)
        self.hc_attn = HyperConnection(*hc_args)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, "embed", stack)
        self.attn = Attention(cfg, role, stack)
        self.hc_ffn = HyperConnection(*hc_args)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, "embed", stack)
        self.ffn = MoE(cfg, stack)

    def __call__(self, x_TCD: jax.Array, pre_TC: jax.Array, ctx: StepContext, cache: dict, shared: dict,
                 inject_TN: jax.Array | None) -> tuple[jax.Array, jax.Array, dict, dict]:
        """One layer. x_TCD bf16 [T, C, D]; pre_TC float32: the collapse weights for the attention input.

        cache and shared: as ``attention`` takes them. Returns (x_TCD, the next layer's pre_TC, cache updates,
        shared).
        """
        role = self.role
        if role.engram:
            x_TCD = self.engram(x_TCD, ctx.engram_rows[role.engram_index], ctx.geometry.valid_T,
                                ctx.kernel_options["linear_impl"])
        residual = x_TCD
        a_pre, a_post, a_comb = self.hc_attn(x_TCD, ctx.kernel_options["sinkhorn_impl"])
        y = self.attn_norm.of_streams(x_TCD, pre_TC, ctx.kernel_options["collapse_impl"])
        attn_options = {k: ctx.kernel_options[k] for k in ATTENTION_OPTIONS}
        y, updates, shared = self.attn(y, ctx.geometry, cache, shared, inject_TN, **attn_options)
        x_TCD = hc.post(y, residual, a_post, a_comb)
        residual = x_TCD
        f_pre, f_post, f_comb = self.hc_ffn(x_TCD, ctx.kernel_options["sinkhorn_impl"])
        y, y_act = self.ffn_norm.of_streams(x_TCD, a_pre, ctx.kernel_options["collapse_impl"], quantized=True)
        y = self.ffn(y, ctx.geometry.valid_T, x_act_TD=y_act, impl=ctx.kernel_options["moe_impl"],
                     linear_impl=ctx.kernel_options["linear_impl"], router_impl=ctx.kernel_options["router_impl"])
        x_TCD = hc.post(y, residual, f_post, f_comb)
        return x_TCD, f_pre, updates, shared


class Stage(nnx.Module):
    """The blocks of one planned stage (dijax.model.plan): ``blocks[r]`` is run ``r`` of the period, its
    parameters stacked [repeats, run length, ...]."""

    def __init__(self, cfg: ModelConfig, plan: StagePlan):
        self.plan = plan
        blocks = []
        for r in range(plan.num_runs):
            role = cfg.roles[plan.layers[0][r][0]]
            blocks.append(Block(cfg, role, plan.stack(r)))
        self.blocks = nnx.List(blocks)


def _cache_view(role: LayerRole, own: dict, refs: dict) -> dict:
    """The cache dict ``attention`` reads for ``role`` (keys are the role's layer ids): its own entries plus the
    compressed KV and index keys it reads from its sources (``refs``: {'ckv'|'ik': {layer: array}})."""
    key = str(role.layer)
    view: dict = {"window": {role.layer: own["window"]}, "ckv": {}, "ik": {}, "tail_kv": {}, "tail_score": {}}
    for kind in ("ckv", "ik", "tail_kv", "tail_score"):
        if kind in own:
            view[kind][key] = own[kind]
    if role.compressed and not role.kv_source:
        view["ckv"][str(role.kv_from)] = refs["ckv"][role.kv_from]
    if role.index_source and not role.owns_index_keys:
        view["ik"][str(role.index_keys_from)] = refs["ik"][role.index_keys_from]
    return view


def _own_updates(own: dict, updates: dict) -> dict:
    """A layer's cache entries after ``attention``'s updates."""
    new = dict(own)
    for kind, (_, value) in updates.items():
        if kind == "tail":
            new["tail_kv"], new["tail_score"] = value
        else:
            new[kind] = value
    return new


def _layer_block(block_def, in_place: nnx.State, sliced: nnx.State, index: jax.Array) -> Block:
    """The block of one stacked layer: its ``IN_PLACE`` parameters as ``LayerSlice``s of their [period, layer]
    stacks at flat ``index`` (period i, layer j of a run of L: i * L + j), the rest this layer's slices."""
    views = jax.tree.map(lambda a: of_layer(a, index, a.ndim - 2), in_place)
    return nnx.merge(block_def, views, sliced)


def _run_layer(block: Block, role: LayerRole, ctx: StepContext, x_TCD, pre_TC, own: dict, refs: dict, inject_TN):
    """One layer of a run: returns (x_TCD, pre_TC, its new cache entries, {'topk', 'candidates'} it published)."""
    shared = {"topk": dict(refs["topk"]), "candidates": refs["candidates"]}
    x_TCD, pre_TC, updates, shared = block(x_TCD, pre_TC, ctx, _cache_view(role, own, refs), shared, inject_TN)
    published = {"topk": shared["topk"].get(role.layer) if role.index_source else None,
                 "candidates": shared["candidates"] if role.candidate_source else None}
    return x_TCD, pre_TC, _own_updates(own, updates), published


def _scan(body, carry, cache_stack, xs, length: int):
    """``body(carry, cache_i, xs_i) -> (carry, cache_i, out_i)`` over ``length`` stacked layers, in order.

    The stacked cache rides in the carry and each step writes its slice back in place (a scan output would be a
    second copy of every cache). One layer is called directly on static slices (no loop).
    """
    if length == 1:
        carry, cache_0, out = body(carry, jax.tree.map(lambda a: a[0], cache_stack), jax.tree.map(lambda a: a[0], xs))
        cache_stack = jax.tree.map(lambda a, v: a.at[0].set(v), cache_stack, cache_0)
        return carry, cache_stack, jax.tree.map(lambda v: v[None], out)

    def step(state, xs_i):
        carry, cache_stack = state
        i, xs_i = xs_i
        cache_i = jax.tree.map(lambda a: a[i], cache_stack)
        carry, cache_i, out = body(carry, cache_i, xs_i)
        cache_stack = jax.tree.map(lambda a, v: a.at[i].set(v), cache_stack, cache_i)
        return (carry, cache_stack), out

    (carry, cache_stack), outs = jax.lax.scan(step, (carry, cache_stack), (jnp.arange(length), xs))
    return carry, cache_stack, outs


def _run_stage(cfg: ModelConfig, stage: Stage, ctx: StepContext, x_TCD, pre_TC, stage_cache: list,
               published: dict, inject_topk: dict | None):
    """Run one stage: its repeats in order, each running the period's runs in order.

    published: {'ckv', 'ik', 'topk': {layer: array}, 'candidates'} from earlier stages (read for references that
    leave the period). Returns (x_TCD, pre_TC, new stage cache, what the stage publishes, in the same form).
    """
    plan = stage.plan
    splits = [nnx.split(block, IN_PLACE, ...) for block in stage.blocks]  # (graphdef, in place, sliced)
    templates = [cfg.roles[plan.layers[0][r][0]] for r in range(plan.num_runs)]
    sources = [r for r, role in enumerate(templates) if role.index_source]
    injects = {}
    if inject_topk is not None:
        for r in sources:
            layers = [plan.layers[i][r][0] for i in range(plan.repeats)]
            present = [layer in inject_topk for layer in layers]
            if any(present) and not all(present):
                raise ValueError(f"inject_topk must give all or none of layers {layers} (they run as one scanned "
                                 f"stage), got {sorted(layer for layer in layers if layer in inject_topk)}")
            if all(present):
                injects[r] = jnp.stack([jnp.asarray(inject_topk[layer]) for layer in layers])

    def period(carry, period_cache, xs_i):
        x_TCD, pre_TC = carry
        states_i, injects_i, i = xs_i
        refs = {"ckv": dict(published["ckv"]), "ik": dict(published["ik"]), "topk": dict(published["topk"]),
                "candidates": published["candidates"]}
        new_cache, out_topk = [], {}
        for r, role in enumerate(templates):
            block_def, in_place, _ = splits[r]
            length = plan.run_length(r)

            def layer(carry, own, xs_j, role=role, block_def=block_def, in_place=in_place, length=length, r=r):
                x_TCD, pre_TC = carry
                state, j = xs_j
                block = _layer_block(block_def, in_place, state, i * length + j)
                x_TCD, pre_TC, own, pub = _run_layer(block, role, ctx, x_TCD, pre_TC, own, refs, injects_i.get(r))
                return (x_TCD, pre_TC), own, pub

            (x_TCD, pre_TC), run_cache, pubs = _scan(layer, (x_TCD, pre_TC), period_cache[r],
                                                     (states_i[r], jnp.arange(length)), length)
            new_cache.append(run_cache)
            # a source is alone in its run: publish its entries for the rest of the period
            if role.kv_source:
                refs["ckv"][role.layer] = run_cache["ckv"][0]
            if role.owns_index_keys:
                refs["ik"][role.layer] = run_cache["ik"][0]
            if role.index_source:
                refs["topk"][role.layer] = out_topk[r] = pubs["topk"][0]
            if role.candidate_source and pubs["candidates"] is not None:  # None when its selection is injected
                refs["candidates"] = pubs["candidates"][0]
        return (x_TCD, pre_TC), new_cache, (out_topk, refs["candidates"] if any(
            t.candidate_source for t in templates) else None)

    states = [split[2] for split in splits]
    (x_TCD, pre_TC), stage_cache, (topk, candidates) = _scan(period, (x_TCD, pre_TC), stage_cache,
                                                             (states, injects, jnp.arange(plan.repeats)),
                                                             plan.repeats)
    out = {"ckv": {}, "ik": {}, "topk": {}, "candidates": None if candidates is None else candidates[0]}
    for i in range(plan.repeats):
        for r, role in enumerate(templates):
            layer = plan.layers[i][r][0]
            if role.kv_source:
                out["ckv"][layer] = stage_cache[r]["ckv"][i, 0]
            if role.owns_index_keys:
                out["ik"][layer] = stage_cache[r]["ik"][i, 0]
            if role.index_source:
                out["topk"][layer] = topk[r][i]
    return x_TCD, pre_TC, stage_cache, out


class Transformer(nnx.Module):
    """The V4.1 text model: ``embed``, the backbone ``stages`` (see the module docstring), ``norm``, ``head``.

    Parameters have their global shapes (every expert, every Engram row); under expert parallelism they are
    global arrays sharded by their logical axes (dijax.parallel). fold: stack and scan repeated layers (False: one
    stage per layer, the plain loop).
    """

    def __init__(self, cfg: ModelConfig, fold: bool = True):
        self.cfg = cfg
        self.plan = plan_layers(cfg, fold)
        self.embed = Embed(cfg.vocab_size, cfg.dim)
        self.stages = nnx.List([Stage(cfg, plan) for plan in self.plan])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, "embed")
        self.head = QuantLinear(cfg.dim, cfg.vocab_size, "bf16", ("vocab", "embed"), upcast=True)

    def __call__(self, cache: dict, batch: StepBatch, consts: dict, inject_topk: dict | None = None,
                 **kernel_options) -> tuple[jax.Array, dict, dict[int, jax.Array]]:
        """One ragged step; arguments and results as ``forward_step``."""
        cfg = self.cfg
        num_slots, window = cache["stages"][0][0]["window"].shape[2:4]
        g = geometry(batch, num_slots, window)
        new_cache: dict[str, Any] = {"stages": []}
        x_TD = self.embed(batch.tokens_T)
        x_TCD = jnp.broadcast_to(x_TD[:, None, :], (x_TD.shape[0], cfg.hc_mult, cfg.dim))
        pre_TC = jnp.zeros((x_TD.shape[0], cfg.hc_mult), jnp.float32).at[:, 0].set(1.0)
        engram_rows = None
        if cfg.engram_layer_ids:
            engram_rows, new_cache["engram_hist"] = _engram_rows(consts, cfg, batch, g, cache["engram_hist"])
        ctx = StepContext(geometry=g, engram_rows=engram_rows,
                          kernel_options=dict(REFERENCE, **kernel_options))
        published: dict = {"ckv": {}, "ik": {}, "topk": {}, "candidates": None}
        for stage, stage_cache in zip(self.stages, cache["stages"]):
            x_TCD, pre_TC, stage_cache, out = _run_stage(cfg, stage, ctx, x_TCD, pre_TC, stage_cache, published,
                                                         inject_topk)
            new_cache["stages"].append(stage_cache)
            for kind in ("ckv", "ik", "topk"):
                published[kind].update(out[kind])
            if out["candidates"] is not None:
                published["candidates"] = out["candidates"]
        rows = batch.logit_rows_R
        h = self.norm.of_streams(x_TCD[rows], pre_TC[rows], ctx.kernel_options["collapse_impl"])
        return self.head(h), new_cache, published["topk"]


@lru_cache(maxsize=16)
def graphdef(cfg: ModelConfig, fold: bool = True) -> nnx.GraphDef:
    """The model's graph definition for ``cfg`` (no arrays: built from abstract shapes), computed once per config.

    It does not depend on how many experts or Engram rows a device holds, so one graph serves partial loads.
    """
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, fold=fold)))[0]


def abstract_state(cfg: ModelConfig, fold: bool = True) -> nnx.State:
    """The model's parameters as ``ShapeDtypeStruct`` leaves (with their metadata), allocating nothing."""
    return nnx.state(nnx.eval_shape(lambda: Transformer(cfg, fold)))


def forward_step(params: nnx.State, cache: dict, batch: StepBatch, consts: dict, cfg: ModelConfig,
                 inject_topk: dict[int, jax.Array] | None = None, **kernel_options
                 ) -> tuple[jax.Array, dict, dict[int, jax.Array]]:
    """Run one ragged step.

    params: the ``Transformer``'s ``nnx.State`` (dijax.model.param_map builds it from a checkpoint); cache: see
    dijax.model.step (``init_cache``); consts: Engram device arrays (``EngramTables.step_consts()``), may be empty
    without Engram; inject_topk: optional {index-source layer: int32 [T, N] compressed positions} overriding that
    layer's selection (a test seam; layers of one scanned stage are given all or none). kernel_options (static):
    ``moe_impl``, ``topk_impl``, ``sparse_attn_impl``, ``sinkhorn_impl``, ``linear_impl``, ``indexer_impl``,
    ``router_impl``, ``latents_impl``, ``collapse_impl`` ('reference' by default, see dijax.kernels.options).

    Returns (logits_RV float32 for ``batch.logit_rows_R``, the new cache, {index-source layer: selected
    compressed positions int32 [T, N], ascending, -1 padded}).
    """
    model = nnx.merge(graphdef(cfg), params)
    return model(cache, batch, consts, inject_topk, **kernel_options)
