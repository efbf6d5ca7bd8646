"""Which layers share one compiled body: runs of like layers, and stages that repeat a period of runs.

The released V4.1-Flash schedule (v41_spec §2) repeats itself: layers 2-7 and 8-13 are each a ratio-2 KV and index
source followed by five consumers of it; layers 24-27, 28-31, 32-35 and 36-39 are each an index source followed by
three consumers. A layer's body differs only by its role, and what it reads differs only by which source it reads,
so the backbone is cut into:

* runs: consecutive layers with the same role that read the same sources (consumers, window-only layers). A run's
  parameters and window rings are stacked over its layers and run under ``lax.scan``;
* stages: a period of runs repeated ``repeats`` times back to back, where each repeat reads its own sources
  (at the same offsets) or the same earlier layers. A stage's parameters and caches are stacked over its repeats
  and the period runs under ``lax.scan``.

Layers still run in order and each keeps its own cache entries (a slice of the stacked ones), so the step computes
exactly what the unrolled layer loop computes; compile time depends on the number of distinct bodies, not layers.
Engram layers (each with its own table) and the candidate source are never repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

from dijax.config import LayerRole, ModelConfig


@dataclass(frozen=True)
class StagePlan:
    """``layers[i][r]``: the layer ids of run ``r`` in repeat ``i`` of the stage's period (all repeats alike)."""

    layers: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def repeats(self) -> int:
        return len(self.layers)

    @property
    def num_runs(self) -> int:
        return len(self.layers[0])

    def run_length(self, r: int) -> int:
        return len(self.layers[0][r])

    def stack(self, r: int) -> tuple[int, int]:
        """Leading (repeat, layer) shape of run ``r``'s stacked parameters and window rings."""
        return self.repeats, self.run_length(r)


def _joins(run_last: LayerRole, role: LayerRole) -> bool:
    """Whether ``role`` can extend a run ending in ``run_last``: no source or Engram on either side, same reads."""
    for r in (run_last, role):
        if r.kv_source or r.index_source or r.engram:
            return False
    return (run_last.ratio, run_last.kv_from, run_last.topk_from) == (role.ratio, role.kv_from, role.topk_from)


def _runs(cfg: ModelConfig) -> list[tuple[int, ...]]:
    runs: list[list[int]] = []
    for role in cfg.roles:
        if runs and _joins(cfg.roles[runs[-1][-1]], role):
            runs[-1].append(role.layer)
        else:
            runs.append([role.layer])
    return [tuple(r) for r in runs]


def _describe(cfg: ModelConfig, runs: list[tuple[int, ...]], start: int) -> tuple:
    """The runs seen from a period beginning at layer ``start``: references inside it become offsets."""
    def ref(layer: int) -> tuple:
        if layer < 0:
            return ("none",)
        return ("in", layer - start) if layer >= start else ("out", layer)

    out = []
    for run in runs:
        role = cfg.roles[run[0]]
        out.append((len(run), run[0] - start, role.ratio, role.kv_source, role.index_source, role.owns_index_keys,
                    role.candidate_source, role.uses_candidates, role.layer if role.engram else -1,
                    ref(role.kv_from), ref(role.topk_from), ref(role.index_keys_from)))
    return tuple(out)


def plan_layers(cfg: ModelConfig, fold: bool = True) -> tuple[StagePlan, ...]:
    """Cut the backbone into stages (module docstring). ``fold=False`` gives one stage per layer, the plain
    unrolled loop (tests compare the two)."""
    if not fold:
        return tuple(StagePlan(layers=(((role.layer,),),)) for role in cfg.roles)
    runs = _runs(cfg)
    stages: list[StagePlan] = []
    i = 0
    while i < len(runs):
        best_q, best_reps, best_cover = 1, 1, 0
        for q in range(1, (len(runs) - i) // 2 + 1):
            period = _describe(cfg, runs[i:i + q], runs[i][0])
            reps = 1
            while i + (reps + 1) * q <= len(runs) and _describe(
                    cfg, runs[i + reps * q:i + (reps + 1) * q], runs[i + reps * q][0]) == period:
                reps += 1
            cover = sum(len(r) for r in runs[i:i + reps * q])
            if reps > 1 and cover > best_cover:
                best_q, best_reps, best_cover = q, reps, cover
        stages.append(StagePlan(layers=tuple(tuple(runs[i + k * best_q:i + (k + 1) * best_q])
                                         for k in range(best_reps))))
        i += best_q * best_reps
    return tuple(stages)
