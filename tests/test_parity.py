"""Parity against DeepSeek's official reference logits (tests/fixtures/parity, a byte-identical copy of
../shared/parity): tiny-nodrop's checks, the teacher-forced runner on tiny-nodrop (chunked prefill, ragged batches),
and the parity checker itself. Every bound comes from the fixtures' manifests. The tiny fixture's checks are in
tests/test_parity_tiny.py, the engine's (``--engine``) in tests/test_parity_engine.py: files of their own, so that
pytest-xdist runs them next to this one.

Every step shape is a whole-model compile on CPU (~20 s), the bulk of this file's time: every teacher-forced run of
a fixture has one cache shape (``parity.runner_sizes``), so the tests after the one-step run reuse its executables
where their token buckets meet (same process, same shapes), and the runner tests below take the same sizes."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from dijax.cli.parity import manifest_problems, prefix_figures, run_fixture
from tests.conftest import FIXTURE_COPY, SHARED_PARITY, parity_path

pytestmark = pytest.mark.cost(255)  # CI seconds, a scheduling hint (tests/conftest.py)


def manifest_check(fixture: str, name: str) -> dict:
    """The check called ``name`` in a fixture's manifest (its bounds are what the tests assert)."""
    with open(parity_path(fixture, "fixture.json")) as f:
        return next(c for c in json.load(f)["checks"] if c["name"] == name)


# (case, batch row) whose prefill position 1 is off by more than the manifest's prefix bound on this CPU although no
# routing near-tie is recorded there: r = 7.77e-3, the same before and after this session's refactors and under a
# one-ulp change of dijax's hc mixes (docs/parity.md). Issue 8 is marked blocked on it; every other row must pass.
KNOWN_PREFIX_MISSES = {("case_L150", 2)}


def _assert_tier1(fixture, check: dict, chunk: int | None, cases: tuple[str, ...] | None = None) -> None:
    """Every bound of a manifest tier-1 check over ``cases`` (default all), with the prefix check per (case, row)
    so that a documented miss cannot hide a new one."""
    from dijax.cli.parity import _sets_equal, load_model, relative_errors, run_cases

    params, consts = load_model(fixture)
    all_r, prefix_misses = [], set()
    runs = run_cases(fixture, params, consts, list(cases or fixture.case_names), bool(check.get("inject_topk")), chunk)
    for case, run in runs.items():
        prefill_r = relative_errors(run.prefill_logits, fixture.tensor(case, "prefill_logits"))
        all_r += [prefill_r.ravel(), relative_errors(run.decode_logits, fixture.tensor(case, "decode_logits")).ravel()]
        worst_B = prefill_r[:, :check["prefix_positions"]].max(axis=1)
        prefix_misses |= {(case, b) for b in np.nonzero(worst_B > check["prefix_max_r"])[0].tolist()}
        tokens, margins = fixture.tensor(case, "tokens"), fixture.tensor(case, "margins")
        mine = np.concatenate([run.prefill_logits[:, -1:].argmax(-1), run.decode_logits.argmax(-1).T], axis=1)
        confident = margins >= check["tokens_equal_where_ref_margin_ge"]
        assert not np.any((mine[:, :tokens.shape[1]] != tokens) & confident)
        if check.get("index_sets"):
            for layer, got in run.prefill_topk.items():
                assert _sets_equal(got, fixture.tensor(case, f"topk_layer{layer}_prefill")).all()
    r = np.concatenate(all_r)
    assert np.median(r) <= check["median_r"] and np.percentile(r, 90) <= check["p90_r"] and r.max() <= check["max_r"]
    assert prefix_misses <= KNOWN_PREFIX_MISSES, prefix_misses


@pytest.mark.slow
def test_tiny_nodrop_meets_its_manifest():
    from dijax.cli.parity import Fixture

    _assert_tier1(Fixture(parity_path("tiny-nodrop")), manifest_check("tiny-nodrop", "tier1"), chunk=None)


@pytest.mark.slow
@pytest.mark.parametrize("chunk, cases", [(7, ("case_L23", "case_L64")), (1, ("case_L23",)), (16, ("case_L23",))])
def test_tiny_nodrop_chunked_prefill_meets_its_manifest(chunk, cases):
    """Chunked prefill against the reference under the same manifest bounds: chunks of 7 on the cases they split
    (L5 is one chunk; L150, 22 chunks and a third of the fixture's work, is left to `dijax parity --chunk 7`,
    docs/parity.md), one token at a time (every prefill step decode-shaped) and 16 (chunks ending on block ends) on
    L23. Its decode steps are the one-step run's executable, already compiled in this process."""
    from dijax.cli.parity import Fixture

    _assert_tier1(Fixture(parity_path("tiny-nodrop")), manifest_check("tiny-nodrop", "tier1"), chunk=chunk,
                  cases=cases)


def test_chunked_prefill_state_is_carried(tiny_nodrop):
    """Continuing a prefill must read the window ring, compressor tail and Engram history of the slot: case L23's
    tokens 7..13 computed as the second chunk of 7 (run_cases) and as a fresh sequence give different logits. The
    fresh step takes the teacher-forced runs' sizes (``runner_sizes``), so it is the executable of the chunked
    run's first chunk."""
    from dijax.cli.parity import relative_errors, run_cases, runner_sizes
    from dijax.model.step import SeqChunk
    from dijax.runtime.model_runner import ModelRunner

    fixture, params, consts = tiny_nodrop
    ids = fixture.tensor("case_L23", "input_ids")
    continued = run_cases(fixture, params, consts, ["case_L23"], False, 7)["case_L23"].prefill_logits[:, 7:14]
    sizes = runner_sizes(fixture, 7)
    runner = ModelRunner(fixture.cfg, params, consts, **sizes)
    nb = sizes["num_blocks"] // sizes["num_slots"]
    alone, _ = runner.forward([SeqChunk(slot=i, block_table=[nb * i], start=0, tokens=[int(t) for t in ids[i, 7:14]],
                                        logits="all") for i in range(3)])
    r = relative_errors(np.stack(alone), continued)
    assert np.median(r) > 0.05, np.median(r)


def test_batch_composition_does_not_change_a_sequence(tiny_nodrop):
    """The ragged step: three prompts of different lengths (23, 7 and 21 tokens of case L23) prefilled together, then
    each alone in another slot and other blocks (so with other padding): every token's logits agree to fp32
    summation-order noise, and exactly in the argmax where margins are large. Sizes as in
    test_chunked_prefill_state_is_carried (``runner_sizes``): the steps are the chunked runs' executables."""
    from dijax.cli.parity import runner_sizes
    from dijax.model.step import SeqChunk
    from dijax.runtime.model_runner import ModelRunner

    fixture, params, consts = tiny_nodrop
    ids = fixture.tensor("case_L23", "input_ids")
    prompts = [list(map(int, ids[0][:23])), list(map(int, ids[1][:7])), list(map(int, ids[2][:21]))]
    sizes = runner_sizes(fixture, 7)
    runner = ModelRunner(fixture.cfg, params, consts, **sizes)
    nb = sizes["num_blocks"] // sizes["num_slots"]

    def chunk(slot: int, prompt: list[int]) -> SeqChunk:
        return SeqChunk(slot=slot, block_table=list(range(nb * slot, nb * slot + -(-len(prompt) // 16))), start=0,
                        tokens=prompt, logits="all")

    joint, _ = runner.forward([chunk(i, p) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        (solo,), _ = runner.forward([chunk((i + 1) % 3, prompt)])
        r = np.abs(solo - joint[i]).max(-1) / np.abs(solo).max(-1)
        assert np.median(r) <= 1e-2 and r.max() <= 0.1, (i, np.median(r), r.max())
        top2 = np.sort(solo, -1)[:, -2:]
        big = top2[:, 1] - top2[:, 0] >= 0.25
        assert np.array_equal(solo.argmax(-1)[big], joint[i].argmax(-1)[big])


def _patch_f32(path: str, tensor: str, factor: float) -> None:
    """Multiply one F32 tensor of a safetensors file in place, through its header offsets (numpy's safetensors
    loader cannot read the file: it holds F8_E8M0 scales)."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        info = json.loads(f.read(n))[tensor]
        assert info["dtype"] == "F32", info
        begin, end = info["data_offsets"]
        f.seek(8 + n + begin)
        values = np.frombuffer(f.read(end - begin), np.float32) * np.float32(factor)
        f.seek(8 + n + begin)
        f.write(values.astype(np.float32).tobytes())


@pytest.mark.slow
def test_planted_bug_fails_the_prefix_check(tmp_path):
    """One hyper-connection scale off by 1 %: caught by the prefix check (the untouched fixture fails it only on the
    documented KNOWN_PREFIX_MISSES row: test_tiny_nodrop_meets_its_manifest). Run on case L5, whose rows the
    untouched fixture passes, as the checker tests below: one fixture shape, so their steps compile once."""
    cases = ("case_L5",)
    folder = _one_case_fixture(tmp_path, "tiny-nodrop", cases, [manifest_check("tiny-nodrop", "tier1")])
    with open(os.path.join(folder, "fixture.json")) as f:
        manifest = json.load(f)
    weights = str(tmp_path / "model.safetensors")
    shutil.copyfile(manifest["weights"]["reference"], weights)
    _patch_f32(weights, "layers.1.hc_attn_scale", 1.01)
    manifest["weights"] = {"reference": weights}
    with open(os.path.join(folder, "fixture.json"), "w") as f:
        json.dump(manifest, f)
    out = io.StringIO()
    passed, total = run_fixture(folder, out=out)
    text = out.getvalue()
    assert passed < total, text
    assert "prefix FAIL" in text and "-> FAIL" in text, text
    for case in cases:
        assert any(line.startswith(f"  tier1 {case}:") and "prefix" in line and ") FAIL;" in line
                   for line in text.splitlines()), case


def _sha256_listing(root: str) -> dict[str, str]:
    digests = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                digests["./" + os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return digests


def test_fixture_copy_is_identical_to_shared():
    """tests/fixtures/parity is a copy of ../shared/parity (the source), recorded in tests/fixtures/parity.sha256.
    The copy must match the record; where ../shared/parity exists, so must it (so the two are byte-identical). When
    the shared folder changes this fails until the copy is refreshed: `rm -r tests/fixtures/parity && cp -a
    ../shared/parity tests/fixtures/parity && (cd tests/fixtures/parity && find . -type f | sort | xargs sha256sum)
    > tests/fixtures/parity.sha256`."""
    with open(os.path.join(os.path.dirname(FIXTURE_COPY), "parity.sha256")) as f:
        recorded = {path: digest for digest, path in (line.split() for line in f if line.strip())}
    assert _sha256_listing(FIXTURE_COPY) == recorded
    if os.path.isdir(SHARED_PARITY):
        assert _sha256_listing(SHARED_PARITY) == recorded, f"{SHARED_PARITY} changed: refresh the copy"


def test_prefix_figures():
    r_BL = np.zeros((2, 6), np.float32)
    r_BL[1, 4] = 3e-4
    r_BL[0, 5] = 2e-4
    assert prefix_figures(r_BL, 2) == (0.0, (4, 1))
    r_BL[0, 1] = 8e-3
    worst, first = prefix_figures(r_BL, 2)
    assert worst == np.float32(8e-3) and first == (1, 0)
    assert prefix_figures(np.zeros((1, 3)), 2) == (0.0, None)


def test_manifest_problems_name_the_key():
    tier1 = manifest_check("tiny-nodrop", "tier1")
    assert manifest_problems(tier1) == []
    assert manifest_problems(manifest_check("tiny", "tier2-selection")) == []
    unknown = manifest_problems(dict(tier1, suffix_max_r=0.5))
    assert len(unknown) == 1 and "'suffix_max_r'" in unknown[0]
    assert manifest_problems(dict(tier1, strict=True))[0].startswith("key 'strict'")
    assert manifest_problems(dict(tier1, note="text keys are documentation", rows="all")) == []
    missing = {k: v for k, v in tier1.items() if k != "prefix_max_r"}
    assert manifest_problems(missing) == ["missing key 'prefix_max_r'"]
    assert "unknown check kind" in manifest_problems({"name": "tier3", "median_r": 0.1})[0]


def _one_case_fixture(tmp_path, source: str, case: str | tuple[str, ...], checks: list[dict]) -> str:
    """A fixture folder in the shared format holding one case (or a few), with its own manifest (absolute paths)."""
    cases_kept = (case,) if isinstance(case, str) else case
    src = parity_path(source)
    with open(os.path.join(src, "fixture.json")) as f:
        manifest = json.load(f)
    from dijax.io.safetensors import SafetensorsFile

    cases = SafetensorsFile(os.path.join(src, manifest["cases"]))
    tensors = {n: np.array(cases.get(n)) for n in cases.names() if n.split(".")[0] in cases_kept}
    save_file(tensors, str(tmp_path / "cases.safetensors"))
    for key in ("config", "inference_config", "tokenizer"):
        manifest[key] = os.path.normpath(os.path.join(src, manifest[key]))
    manifest["weights"] = {k: os.path.normpath(os.path.join(src, v)) for k, v in manifest["weights"].items()}
    manifest["cases"] = "cases.safetensors"
    manifest["checks"] = checks
    with open(tmp_path / "fixture.json", "w") as f:
        json.dump(manifest, f)
    return str(tmp_path)


def test_checker_reads_any_fixture_folder_and_reports(tmp_path):
    tier1 = manifest_check("tiny-nodrop", "tier1")
    impossible = dict(tier1, name="tier1-impossible", median_r=0.0, p90_r=0.0, max_r=0.0)
    unknown_key = dict(tier1, name="tier1-unknown-key", prefix_rows=3)
    folder = _one_case_fixture(tmp_path, "tiny-nodrop", "case_L5", [tier1, impossible, unknown_key])
    out = io.StringIO()
    passed, total = run_fixture(folder, out=out)
    text = out.getvalue()
    assert (passed, total) == (1, 3)
    assert "tier1 case_L5: r median" in text and "identical index sets 261/261" in text
    worst = float(text.split("prefix (positions < 2) worst r ")[1].split()[0])
    assert worst <= 1e-6  # before any rounding flip: fp32 noise (~2e-7 on this CPU)
    assert "tier1-impossible: all rows (87)" in text and "-> FAIL" in text
    assert "tier1-unknown-key: key 'prefix_rows' is not one the tier1 checker evaluates" in text
    assert text.strip().splitlines()[-1] == "parity: 1/3 checks passed"
    from dijax.cli.main import main

    assert main(["parity", folder]) == 1  # a failing check is exit status 1


def test_checker_chunked_and_cli_exit_codes(tmp_path):
    from dijax.cli.main import main

    folder = _one_case_fixture(tmp_path, "tiny-nodrop", "case_L5", [manifest_check("tiny-nodrop", "tier1")])
    assert main(["parity", folder, "--chunk", "2"]) == 0
    assert main(["parity", folder, "--layout", "hf"]) == 0
    assert main(["parity", folder, "--chunk", "0"]) == 2  # a clear error, not a crash
    assert main(["parity", folder, "--engine", "--chunk", "4"]) == 2  # not silently ignored
    assert main(["parity", str(tmp_path / "missing")]) == 2


def test_malformed_manifests_give_one_line_errors(tmp_path, capsys):
    from dijax.cli.main import main

    folder = _one_case_fixture(tmp_path, "tiny-nodrop", "case_L5", [manifest_check("tiny-nodrop", "tier1")])
    manifest = json.loads((tmp_path / "fixture.json").read_text())
    del manifest["cases"]
    (tmp_path / "fixture.json").write_text(json.dumps(manifest))
    assert main(["parity", folder]) == 2
    assert "missing 'cases'" in capsys.readouterr().err
    (tmp_path / "fixture.json").write_text("{not json")
    assert main(["parity", folder]) == 2
    assert "fixture.json: not valid JSON" in capsys.readouterr().err
