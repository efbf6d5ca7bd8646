"""Parity checker: run a fixture's cases teacher-forced and evaluate the checks its manifest lists.

A fixture folder (format of ../shared/parity) has a ``fixture.json`` naming its config, tokenizer, weight layouts,
cases file and checks. Each case ``case_<name>`` holds ``input_ids`` [B, L], ``prefill_logits`` [B, L, V],
``decode_logits`` [N, B, V], ``tokens`` / ``margins`` [B, N + 1] and, per index-source layer l, the selected
compressed positions ``topk_layer{l}_prefill`` [B, L, K] / ``topk_layer{l}_step{j}`` [B, K] with their
``topkbounds_*`` (k-th and (k+1)-th score). Every size is read from the files.

Checks:
  * ``tier1``: per-row relative logit error r = max|x - ref| / max|ref| (median / p90 / max over every prefill
    and decode row), the prefix check (every batch row's prefill positions < ``prefix_positions`` within
    ``prefix_max_r``: before the first rounding flip a correct port matches to fp32 noise, while one deliberate
    bug moves those rows by >= 7e-3), greedy tokens equal where the reference margin is large, and (when the
    manifest says so) index sets identical to the recorded ones;
  * ``tier1-injected``: the same with every index source's selection overridden by the recorded sets;
  * ``tier2-selection``: fraction of identical index sets over rows whose recorded bounds show a strict gap,
    leaving out tied rows and the reference's stale-index-key decode steps (parity README 6.1).

Manifests are read strictly: every numeric or boolean key of a check must be one the checker evaluates
(``EVALUATED_KEYS``), and a missing bound or an unknown key fails that check with a message naming the key; text
keys (``note``, ``bounds``, ``rows``, ``exclude``, ``r_definition``, ...) are documentation.

Usage: ``dijax parity FIXTURE_DIR [--layout reference|hf] [--weights PATH] [--chunk N]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from dataclasses import dataclass

import jax
import numpy as np

import dijax  # noqa: F401  (sets XLA flags before JAX starts)
from dijax.cli.options import add_model_options, apply_ep
from dijax.config import ModelConfig
from dijax.io.checkpoint import load_params, resolve_checkpoint
from dijax.io.safetensors import SafetensorsFile
from dijax.kernels.options import kernel_options
from dijax.kernels.scale_range import exact_kernels
from dijax.model.engram import EngramTables
from dijax.model.step import SeqChunk
from dijax.parallel.mesh import make_mesh
from dijax.runtime.model_runner import ModelRunner

# Keys each check kind evaluates (numbers and booleans; anything else numeric in a check is an error). Text-valued
# ``index_sets`` switches the tier-1 index-set comparison on.
EVALUATED_KEYS = {
    "tier1": {"inject_topk", "median_r", "p90_r", "max_r", "prefix_positions", "prefix_max_r",
              "tokens_equal_where_ref_margin_ge"},
    "tier2": {"inject_topk", "index_set_agreement_min"},
}
REQUIRED_KEYS = {"tier1": ("median_r", "p90_r", "max_r", "prefix_positions", "prefix_max_r"),
                 "tier2": ("index_set_agreement_min",)}
FLIP_R = 1e-4  # the first prefill position whose r exceeds this is printed as "first flip" (a diagnostic)

@dataclass
class CaseRun:
    """What the model produced for one case."""

    prefill_logits: np.ndarray  # [B, L, V]
    decode_logits: np.ndarray  # [N, B, V]
    prefill_topk: dict[int, np.ndarray]  # layer -> [B, L, K]
    decode_topk: dict[int, np.ndarray]  # layer -> [N, B, K]


class Fixture:
    """A parity fixture folder: manifest, config, tokenizer, weights and cases."""

    def __init__(self, folder: str, layout: str = "reference", weights: str | None = None):
        self.folder = folder
        manifest_path = os.path.join(folder, "fixture.json")
        if not os.path.exists(manifest_path):
            raise FileNotFoundError(f"{folder} has no fixture.json")
        try:
            with open(manifest_path) as f:
                self.manifest = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{manifest_path}: not valid JSON ({error})") from None
        if not isinstance(self.manifest, dict):
            raise ValueError(f"{manifest_path}: expected a JSON object, got {type(self.manifest).__name__}")
        for key in ("cases", "tokenizer", "weights", "checks"):
            if key not in self.manifest:
                raise ValueError(f"{manifest_path}: missing '{key}' (a fixture names its config, tokenizer, "
                                 f"weights, cases and checks; see ../shared/parity/README.md)")
        if not isinstance(self.manifest["checks"], list) or not self.manifest["checks"]:
            raise ValueError(f"{manifest_path}: 'checks' must be a non-empty list of checks")
        config = self.manifest.get("config") or self.manifest.get("inference_config")
        if config is None:
            raise ValueError(f"{manifest_path}: missing 'config' (or 'inference_config')")
        self.cfg = ModelConfig.from_file(self._path(config))
        layouts = self.manifest["weights"]
        if weights is None:
            if layout not in layouts:
                raise ValueError(f"--layout {layout!r}: the fixture offers {sorted(layouts)}")
            weights = self._path(layouts[layout])
        self.weights = resolve_checkpoint(weights)
        self.cases = SafetensorsFile(self._path(self.manifest["cases"]))
        self.case_names = sorted({n.split(".")[0] for n in self.cases.names()},
                                 key=lambda n: (len(n), n))
        self.tokenizer_path = self._path(self.manifest["tokenizer"])

    def _path(self, rel: str) -> str:
        return os.path.normpath(os.path.join(self.folder, rel))

    def tensor(self, case: str, name: str) -> np.ndarray:
        return np.asarray(self.cases.get(f"{case}.{name}"))

    def shape(self, case: str, name: str) -> tuple[int, ...]:
        """A case tensor's shape, from the file's header (nothing read)."""
        return tuple(self.cases.layout(f"{case}.{name}")[1])

    def has(self, case: str, name: str) -> bool:
        return f"{case}.{name}" in self.cases.header


def load_model(fixture: Fixture, mesh=None):
    """Params and Engram device constants for a fixture; with a ``mesh`` (expert parallelism) each device reads
    only its share of the checkpoint (dijax.io.checkpoint.load_params)."""
    params = load_params(fixture.cfg, fixture.weights, mesh=mesh)
    consts: dict = {}
    if fixture.cfg.engram_layer_ids:
        from tokenizers import Tokenizer

        tables = EngramTables.build(fixture.cfg, Tokenizer.from_file(fixture.tokenizer_path))
        consts = tables.step_consts()
    return params, consts


BLOCK_SIZE = 16  # the teacher-forced runs' cache blocks


def runner_sizes(fixture: Fixture, chunk: int | None) -> dict[str, int]:
    """``ModelRunner`` sizes of the teacher-forced runs of ``fixture``: one slot per batch row of every case and
    enough blocks for each to reach the longest case's end, whichever cases a run takes. One cache shape for every
    run of a fixture, so that its runs (any cases, any ``chunk``) share executables where their token buckets
    meet; the step's block-table width is always the longest case's."""
    shapes = [(fixture.shape(c, "input_ids"), fixture.shape(c, "decode_logits")[0]) for c in fixture.case_names]
    rows = sum(b for (b, _), _ in shapes)
    total = max(length + n + 1 for (_, length), n in shapes)
    tokens = sum(b * (length if chunk is None else min(chunk, length)) for (b, length), _ in shapes)
    return dict(num_blocks=rows * -(-total // BLOCK_SIZE), num_slots=rows, block_size=BLOCK_SIZE,
                max_model_len=total, max_num_seqs=rows, max_num_batched_tokens=max(tokens, rows))


def run_cases(fixture: Fixture, params: dict, consts: dict, cases: list[str], inject: bool, chunk: int | None,
              kernels: str = "auto") -> dict[str, CaseRun]:
    """Teacher-forced runs of ``cases`` through one ``ModelRunner.forward`` stream: every batch row of every case
    is a sequence of its own (slot s, blocks ``s * nb ..``), all of them prefilled together (their ``input_ids``,
    in chunks of ``chunk`` tokens if given: a sequence whose prompt is done sits out the later chunks), then all fed
    their recorded ``tokens[:, j]`` one decode step at a time (a case with fewer steps sits out the later ones).
    Sequences never see each other (the step is ragged: the batch's composition changes only fp32 summation
    order), so this is each case's run as the reference made it, in a few shared executables instead of a prefill
    and a decode executable per case. ``inject``: every index source's selection overridden by the recorded sets."""
    cfg = fixture.cfg
    sizes = runner_sizes(fixture, chunk)
    runner = ModelRunner(cfg, params, consts, kernels=kernels, **sizes)
    nb = sizes["num_blocks"] // sizes["num_slots"]
    layers = [r.layer for r in cfg.index_source_roles]
    ids = {case: fixture.tensor(case, "input_ids") for case in cases}
    tokens = {case: fixture.tensor(case, "tokens") for case in cases}
    steps = {case: fixture.shape(case, "decode_logits")[0] for case in cases}
    rows = [(case, i) for case in cases for i in range(ids[case].shape[0])]  # sequence s = rows[s], slot s

    recorded = functools.cache(fixture.tensor)  # the injected sets, read once per run

    def step(pieces: list[tuple[int, int, np.ndarray]], mode: str, injected: dict[int, list[np.ndarray]] | None):
        """One forward of the sequences in ``pieces`` (slot, start, token ids): per piece its logits and index sets."""
        chunks = [SeqChunk(slot=s, block_table=list(range(s * nb, s * nb + -(-(start + len(piece)) // BLOCK_SIZE))),
                           start=start, tokens=[int(t) for t in piece], logits=mode) for s, start, piece in pieces]
        inject_topk = None if injected is None else {l: np.concatenate(v) for l, v in injected.items()}
        return runner.forward(chunks, inject_topk)

    runs = {case: CaseRun(np.zeros((*ids[case].shape, cfg.vocab_size), np.float32),
                          np.zeros((steps[case], ids[case].shape[0], cfg.vocab_size), np.float32),
                          {l: np.full((*ids[case].shape, cfg.index_topk), -1, np.int32) for l in layers},
                          {l: np.full((steps[case], ids[case].shape[0], cfg.index_topk), -1, np.int32)
                           for l in layers}) for case in cases}
    longest = max(ids[case].shape[1] for case in cases)
    for start in range(0, longest, chunk or longest):
        live = [(s, case, i) for s, (case, i) in enumerate(rows) if start < ids[case].shape[1]]
        ends = [min(start + (chunk or ids[case].shape[1]), ids[case].shape[1]) for _, case, _ in live]
        injected = None
        if inject:
            injected = {l: [recorded(case, f"topk_layer{l}_prefill")[i, start:end]
                            for (_, case, i), end in zip(live, ends)] for l in layers}
        logits, topk = step([(s, start, ids[case][i, start:end]) for (s, case, i), end in zip(live, ends)], "all",
                            injected)
        for k, ((_, case, i), end) in enumerate(zip(live, ends)):
            runs[case].prefill_logits[i, start:end] = logits[k]
            for l in layers:
                runs[case].prefill_topk[l][i, start:end] = topk[l][k]
    for j in range(max(steps.values())):
        live = [(s, case, i) for s, (case, i) in enumerate(rows) if j < steps[case]]
        injected = None
        if inject:
            injected = {l: [recorded(case, f"topk_layer{l}_step{j}")[i:i + 1] for _, case, i in live]
                        for l in layers}
        logits, topk = step([(s, ids[case].shape[1] + j, tokens[case][i, j:j + 1]) for s, case, i in live], "last",
                            injected)
        for k, (_, case, i) in enumerate(live):
            runs[case].decode_logits[j, i] = logits[k][0]
            for l in layers:
                runs[case].decode_topk[l][j, i] = topk[l][k][0]
    return runs


def relative_errors(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per row: max|got - ref| / max|ref| over the last axis."""
    return np.abs(got - ref).max(-1) / np.maximum(np.abs(ref).max(-1), 1e-30)


def _sets_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise equality of the valid (>= 0) entries of two ascending, -1 padded index lists."""
    return np.all(np.where(a >= 0, a, -1) == np.where(b >= 0, b, -1), axis=-1)


def check_kind(check: dict) -> str | None:
    """'tier1' or 'tier2' from a check's name (``tier1-injected`` is a tier-1 check), None if unknown."""
    name = str(check.get("name", ""))
    return next((kind for kind in EVALUATED_KEYS if name.startswith(kind)), None)


def manifest_problems(check: dict) -> list[str]:
    """What makes a check unevaluable: an unknown kind, a missing bound, or a numeric / boolean key the checker does
    not evaluate (it would otherwise be silently ignored). Empty if the check is well-formed."""
    kind = check_kind(check)
    if kind is None:
        return [f"unknown check kind (known: {', '.join(EVALUATED_KEYS)})"]
    problems = [f"missing key '{key}'" for key in REQUIRED_KEYS[kind] if key not in check]
    for key, value in check.items():
        if isinstance(value, (bool, int, float)) and key not in EVALUATED_KEYS[kind]:
            problems.append(f"key '{key}' is not one the {kind} checker evaluates "
                            f"(evaluated: {', '.join(sorted(EVALUATED_KEYS[kind]))})")
    return problems


def evaluate(fixture: Fixture, check: dict, runs: dict[str, CaseRun], out) -> bool:
    """Evaluate one manifest check over all cases, printing figures; returns pass/fail."""
    name = check.get("name", "?")
    problems = manifest_problems(check)
    if problems:
        print(f"  {name}: {'; '.join(problems)} -> FAIL", file=out)
        return False
    if check_kind(check) == "tier1":
        return _evaluate_tier1(fixture, check, runs, out)
    return _evaluate_tier2(fixture, check, runs, out)


def prefix_figures(r_BL: np.ndarray, prefix_positions: int) -> tuple[float, tuple[int, int] | None]:
    """(worst r over every batch row's prefill positions < prefix_positions, (position, row) of the earliest prefill
    position whose r exceeds FLIP_R, or None). r_BL: per-row relative errors of the prefill logits [B, L]."""
    worst = float(r_BL[:, :prefix_positions].max())
    over = np.argwhere(r_BL > FLIP_R)
    first = None if over.size == 0 else min((int(p), int(b)) for b, p in over)
    return worst, first


def _prefix_line(worst: float, first: tuple[int, int] | None, check: dict) -> str:
    flip = f"position {first[0]} (row {first[1]})" if first else "none"
    verdict = "ok" if worst <= check["prefix_max_r"] else "FAIL"
    return (f"prefix (positions < {check['prefix_positions']}) worst r {worst:.3g} (<= {check['prefix_max_r']}) "
            f"{verdict}; first r > {FLIP_R:g} at {flip}")


def _evaluate_tier1(fixture: Fixture, check: dict, runs: dict[str, CaseRun], out) -> bool:
    name, threshold = check["name"], check.get("tokens_equal_where_ref_margin_ge", 0.25)
    all_r, ok_tokens, sets_ok, prefix_ok = [], True, True, True
    for case, run in runs.items():
        prefill_r = relative_errors(run.prefill_logits, fixture.tensor(case, "prefill_logits"))
        r = np.concatenate([prefill_r.ravel(),
                            relative_errors(run.decode_logits, fixture.tensor(case, "decode_logits")).ravel()])
        all_r.append(r)
        worst, first = prefix_figures(prefill_r, check["prefix_positions"])
        prefix_ok &= worst <= check["prefix_max_r"]
        tokens, margins = fixture.tensor(case, "tokens"), fixture.tensor(case, "margins")
        mine = np.concatenate([run.prefill_logits[:, -1:].argmax(-1),
                               run.decode_logits.argmax(-1).T], axis=1)[:, :tokens.shape[1]]
        big = margins >= threshold
        mismatched = int(np.sum((mine != tokens) & big))
        ok_tokens &= mismatched == 0
        differ = np.nonzero(np.any(mine != tokens, axis=0))[0]
        first_token = (f"first differing step {differ[0]} (ref margin there {margins[:, differ[0]].min():.4f})"
                       if len(differ) else "no differing step")
        line = (f"  {name} {case}: r median {np.median(r):.3g} p90 {np.percentile(r, 90):.3g} max {r.max():.3g}; "
                f"{_prefix_line(worst, first, check)}; tokens differing where margin >= {threshold}: {mismatched}; "
                f"{first_token}")
        if check.get("index_sets"):
            same, count = 0, 0
            for layer, got in run.prefill_topk.items():
                eq = _sets_equal(got, fixture.tensor(case, f"topk_layer{layer}_prefill"))
                same, count = same + int(eq.sum()), count + eq.size
                for j in range(run.decode_topk[layer].shape[0]):
                    eq = _sets_equal(run.decode_topk[layer][j], fixture.tensor(case, f"topk_layer{layer}_step{j}"))
                    same, count = same + int(eq.sum()), count + eq.size
            sets_ok &= same == count
            line += f"; identical index sets {same}/{count}"
        print(line, file=out)
    r = np.concatenate(all_r)
    med, p90, mx = float(np.median(r)), float(np.percentile(r, 90)), float(r.max())
    passed = (med <= check["median_r"] and p90 <= check["p90_r"] and mx <= check["max_r"] and ok_tokens and sets_ok
              and prefix_ok)
    print(f"  {name}: all rows ({r.size}): r median {med:.3g} (<= {check['median_r']}), p90 {p90:.3g} "
          f"(<= {check['p90_r']}), max {mx:.3g} (<= {check['max_r']}); prefix {'ok' if prefix_ok else 'FAIL'}; "
          f"tokens {'ok' if ok_tokens else 'DIFFER'}"
          f"{'; index sets ' + ('identical' if sets_ok else 'DIFFER') if check.get('index_sets') else ''}"
          f" -> {'PASS' if passed else 'FAIL'}", file=out)
    return passed


def _evaluate_tier2(fixture: Fixture, check: dict, runs: dict[str, CaseRun], out) -> bool:
    cfg = fixture.cfg
    stale_layers = {r.layer for r in cfg.index_source_roles if r.kv_source and r.ratio > 1}
    same_total = count_total = 0
    for case, run in runs.items():
        length = fixture.tensor(case, "input_ids").shape[1]
        same = count = 0
        for layer, got in run.prefill_topk.items():
            bounds = fixture.tensor(case, f"topkbounds_layer{layer}_prefill")
            strict = np.isnan(bounds[..., 1]) | (bounds[..., 0] > bounds[..., 1])
            eq = _sets_equal(got, fixture.tensor(case, f"topk_layer{layer}_prefill"))
            same, count = same + int(eq[strict].sum()), count + int(strict.sum())
            for j in range(run.decode_topk[layer].shape[0]):
                if layer in stale_layers and (length + j) % 2 == 0:
                    continue  # the reference reads a stale index-key cache here (README 6.1)
                bounds = fixture.tensor(case, f"topkbounds_layer{layer}_step{j}")
                strict = np.isnan(bounds[..., 1]) | (bounds[..., 0] > bounds[..., 1])
                eq = _sets_equal(run.decode_topk[layer][j], fixture.tensor(case, f"topk_layer{layer}_step{j}"))
                same, count = same + int(eq[strict].sum()), count + int(strict.sum())
        print(f"  {check['name']} {case}: identical index sets on strict-gap rows {same}/{count}", file=out)
        same_total, count_total = same_total + same, count_total + count
    frac = same_total / max(count_total, 1)
    passed = frac >= check["index_set_agreement_min"]
    print(f"  {check['name']}: agreement {same_total}/{count_total} = {frac:.4f} "
          f"(>= {check['index_set_agreement_min']}) -> {'PASS' if passed else 'FAIL'}", file=out)
    return passed


def run_engine(folder: str, layout: str = "reference", weights: str | None = None, zos: bool = True,
               max_num_batched_tokens: int = 256, block_size: int = 16, num_blocks: int | None = None,
               out=sys.stdout, kernels: str = "auto", ep: int = 1) -> bool:
    """Every prompt of every case through one engine at once (greedy), compared with the reference per request up
    to the first step where the reference's own top-2 margin is below the manifest's token tolerance.

    The prefix check rides along as ordinary requests: for every prompt and position p < ``prefix_positions``, a
    one-token request on the prompt's first p + 1 tokens, whose logits are the reference's prefill row p.
    """
    from dijax.runtime.llm_engine import LLMEngine
    from dijax.runtime.sampling_params import SamplingParams

    fixture = Fixture(folder, layout, weights)
    check = next((c for c in fixture.manifest["checks"] if check_kind(c) == "tier1"
                  and not c.get("inject_topk")), None)
    if check is None:
        raise ValueError(f"{folder}: --engine needs a tier1 check without index injection (e.g. tiny-nodrop)")
    problems = manifest_problems(check)
    if problems:
        print(f"  {check['name']}: {'; '.join(problems)} -> FAIL", file=out)
        print("parity: 0/1 checks passed", file=out)
        return False
    params, consts = load_model(fixture)
    from tokenizers import Tokenizer

    requests, prefix_requests = {}, {}
    for case in fixture.case_names:
        ids, tokens = fixture.tensor(case, "input_ids"), fixture.tensor(case, "tokens")
        for b in range(ids.shape[0]):
            requests[f"{case}/{b}"] = (case, b, [int(t) for t in ids[b]], tokens.shape[1])
            for p in range(min(check["prefix_positions"], ids.shape[1])):
                prefix_requests[f"{case}/{b}/prefix{p}"] = (case, b, p, [int(t) for t in ids[b, :p + 1]])
    max_len = max(len(p) + n for _, _, p, n in requests.values()) + 1
    engine = LLMEngine(loaded=(fixture.cfg, params, consts, Tokenizer.from_file(fixture.tokenizer_path)),
                       max_num_seqs=min(len(requests) + len(prefix_requests), max_num_batched_tokens),
                       max_num_batched_tokens=max_num_batched_tokens, block_size=block_size, num_blocks=num_blocks,
                       max_model_len=max_len, zos=zos, debug_logits=True, kernels=kernels, ep=ep)
    for rid, (_, _, prompt, n) in requests.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    for rid, (_, _, _, prompt) in prefix_requests.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step()})
    tol = check.get("tokens_equal_where_ref_margin_ge", 0.25)
    all_r, ok_tokens, compared, prefix_ok = [], True, 0, True
    for case in fixture.case_names:
        case_r, case_steps, mismatches = [], 0, 0
        prefill = fixture.tensor(case, "prefill_logits")
        for rid, (c, b, prompt, n) in requests.items():
            if c != case:
                continue
            ref_tokens, margins = fixture.tensor(case, "tokens")[b], fixture.tensor(case, "margins")[b]
            decode = fixture.tensor(case, "decode_logits")
            for j in range(n):
                if margins[j] < tol:
                    break  # past a reference near-tie both sides compare noise
                ref = prefill[b, -1] if j == 0 else decode[j - 1, b]
                case_r.append(float(relative_errors(engine.step_logits[rid][j], ref)))
                mismatches += int(outputs[rid].token_ids[j] != ref_tokens[j])
                case_steps += 1
                if outputs[rid].token_ids[j] != ref_tokens[j]:
                    break
        prefix_r_BP = np.zeros((prefill.shape[0], min(check["prefix_positions"], prefill.shape[1])), np.float32)
        for rid, (c, b, p, _) in prefix_requests.items():
            if c == case:
                prefix_r_BP[b, p] = relative_errors(engine.step_logits[rid][0], prefill[b, p])
        worst, first = prefix_figures(prefix_r_BP, check["prefix_positions"])
        prefix_ok &= worst <= check["prefix_max_r"]
        r = np.asarray(case_r)
        all_r.append(r)
        ok_tokens &= mismatches == 0
        compared += case_steps
        print(f"  engine {case}: {case_steps} steps compared; r median {np.median(r):.3g} p90 "
              f"{np.percentile(r, 90):.3g} max {r.max():.3g}; {_prefix_line(worst, first, check)}; "
              f"token mismatches {mismatches}", file=out)
    r = np.concatenate(all_r)
    med, p90, mx = float(np.median(r)), float(np.percentile(r, 90)), float(r.max())
    passed = (ok_tokens and prefix_ok and med <= check["median_r"] and p90 <= check["p90_r"]
              and mx <= check["max_r"])
    print(f"  engine: {compared} steps, r median {med:.3g} (<= {check['median_r']}), p90 {p90:.3g} "
          f"(<= {check['p90_r']}), max {mx:.3g} (<= {check['max_r']}); prefix {'ok' if prefix_ok else 'FAIL'}; "
          f"tokens {'ok' if ok_tokens else 'DIFFER'}; zos {'on' if zos else 'off'}; "
          f"preemptions {engine.num_preemptions} -> {'PASS' if passed else 'FAIL'}", file=out)
    print(f"parity: {int(passed)}/1 checks passed", file=out)
    return passed


def run_fixture(folder: str, layout: str = "reference", weights: str | None = None, chunk: int | None = None,
                out=sys.stdout, kernels: str = "auto", ep: int = 1) -> tuple[int, int]:
    """Run every check of a fixture; prints figures and the final ``parity: K/N checks passed`` line. ``ep`` > 1
    splits the routed experts over that many devices (dijax.parallel)."""
    if chunk is not None and chunk <= 0:
        raise ValueError(f"--chunk must be a positive number of tokens, got {chunk}")
    options = kernel_options(kernels, jax.default_backend())  # a bad choice fails before anything is loaded
    fixture = Fixture(folder, layout, weights)
    mesh = make_mesh(ep, fixture.cfg.n_routed_experts) if ep > 1 else None
    params, consts = load_model(fixture, mesh)
    options = exact_kernels(options, params)  # what the runners will use (scale_range)
    checks = fixture.manifest["checks"]
    print(f"parity: {fixture.manifest.get('name', folder)}: {len(fixture.case_names)} cases, "
          f"weights {fixture.weights}, prefill {'in chunks of ' + str(chunk) if chunk else 'in one step'}, "
          f"kernels {kernels} ({', '.join(f'{k}={v}' for k, v in sorted(options.items()))})", file=out)
    passed = 0
    runs_by_inject: dict[bool, dict[str, CaseRun]] = {}
    for check in checks:
        inject = bool(check.get("inject_topk", False))
        if inject not in runs_by_inject:  # the runner traces on the parameters' mesh itself
            runs_by_inject[inject] = run_cases(fixture, params, consts, fixture.case_names, inject, chunk, kernels)
        passed += evaluate(fixture, check, runs_by_inject[inject], out)
    print(f"parity: {passed}/{len(checks)} checks passed", file=out)
    return passed, len(checks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dijax parity", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("fixture", help="fixture folder (with fixture.json)")
    parser.add_argument("--layout", choices=("reference", "hf"), default="reference",
                        help="which of the fixture's weight layouts to load (default: reference)")
    parser.add_argument("--weights", help="load these weights instead of the fixture's (file or directory)")
    parser.add_argument("--chunk", type=int, help="prefill in chunks of N tokens")
    parser.add_argument("--engine", action="store_true",
                        help="run every prompt through the full engine (scheduler, runner, greedy sampler) at once")
    parser.add_argument("--zos", choices=("on", "off"), default="on", help="engine: zero-overhead scheduling")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256, help="engine: query tokens per step")
    parser.add_argument("--block-size", type=int, default=16, help="engine: tokens per KV block")
    parser.add_argument("--num-blocks", type=int, help="engine: KV blocks in the pool (small values force preemption)")
    add_model_options(parser)


def run(args: argparse.Namespace) -> int:
    apply_ep(args)  # before JAX initialises its backends
    if args.engine and args.chunk is not None:
        raise ValueError("--chunk prefills the teacher-forced run in chunks; with --engine the step's token budget "
                         "decides chunking: use --max-num-batched-tokens N")
    # where this run computes: a GPU run that fell back to the CPU shows here before anything else
    print(f"parity on {jax.default_backend()} ({jax.devices()[0].device_kind}), kernels {args.kernels}", flush=True)
    if args.engine:
        return 0 if run_engine(args.fixture, args.layout, args.weights, args.zos == "on",
                               args.max_num_batched_tokens, args.block_size, args.num_blocks,
                               kernels=args.kernels, ep=args.ep) else 1
    passed, total = run_fixture(args.fixture, args.layout, args.weights, args.chunk, kernels=args.kernels,
                                ep=args.ep)
    return 0 if passed == total else 1


if __name__ == "__main__":
    sys.exit(main())
