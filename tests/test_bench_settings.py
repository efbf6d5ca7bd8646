"""tools/bench.py ``--kernel-setting``: A/B runs of a kernel module's constant or CONFIG field set before the step
is traced, with a clear error naming the allowed settings for anything else; the floors' ceilings by device kind."""

from __future__ import annotations

import json

import pytest

from dijax.kernels import routed_experts, topk
from dijax.runtime import sampler
from tools.bench import apply_kernel_settings, current_settings
from tools.bench import main as bench_main
from tools.ceilings import ceilings

pytestmark = pytest.mark.cost(2)  # CI seconds, a scheduling hint (tests/conftest.py)


def test_sets_a_constant_and_a_config_field(monkeypatch):
    monkeypatch.setattr(topk, "SELECT_MIN_VALUES", topk.SELECT_MIN_VALUES)
    monkeypatch.setattr(routed_experts, "CONFIG", routed_experts.CONFIG)
    before = routed_experts.CONFIG
    monkeypatch.setattr(sampler, "SELECT_MIN_ROWS", sampler.SELECT_MIN_ROWS)
    applied = apply_kernel_settings(["topk.SELECT_MIN_VALUES=512", "routed_experts.CONFIG.gathered_max=64",
                                     "sampler.SELECT_MIN_ROWS=9"])
    assert applied == ["topk.SELECT_MIN_VALUES=512", "routed_experts.CONFIG.gathered_max=64",
                       "sampler.SELECT_MIN_ROWS=9"]
    assert sampler.SELECT_MIN_ROWS == 9
    assert topk.SELECT_MIN_VALUES == 512
    assert routed_experts.CONFIG.gathered_max == 64
    assert routed_experts.CONFIG.matvec_rows == before.matvec_rows  # the other fields stay


@pytest.mark.parametrize("setting, message", [
    ("topk.SELECT_MIN_VALUES", "must be MODULE.NAME=VALUE"),
    ("topk.SELECT_MIN_VALUES.x=1", "must be MODULE.NAME=VALUE"),
    ("nosuch.LIMIT=1", "no module nosuch in dijax.kernels, dijax.runtime"),
    ("topk.NO_SUCH=1", "not a setting of dijax.kernels.topk"),
    ("routed_experts.CONFIG.no_field=1", "gathered_max"),
    ("topk.SELECT_MIN_VALUES=True", "must be of type int"),
    ("topk.SELECT_MIN_VALUES=big", "needs a Python literal"),
])
def test_refuses_what_it_cannot_set(monkeypatch, setting, message):
    monkeypatch.setattr(topk, "SELECT_MIN_VALUES", topk.SELECT_MIN_VALUES)
    with pytest.raises(SystemExit, match=message):
        apply_kernel_settings([setting])
    assert topk.SELECT_MIN_VALUES == 1 << 16


def test_ceilings_follow_the_device_kind():
    """bench.py's and bench_kernels.py's floors use the ceilings measured on the device's kind (tools/ceilings.py),
    and a device of no measured kind gets the H200's with a source that says so."""
    h100, h200 = ceilings("NVIDIA H100 80GB HBM3"), ceilings("NVIDIA H200")
    assert (h100.bandwidth, h100.flops) == (3.0e12, 7.98e14) and "H100" in h100.source
    assert (h200.bandwidth, h200.flops) == (4.3e12, 7.9e14) and "H200" in h200.source
    other = ceilings("cpu")
    assert other[:2] == h200[:2] and "none measured for 'cpu'" in other.source


def test_current_settings_restore_what_a_variant_changed(monkeypatch):
    monkeypatch.setattr(sampler, "MANY_ROWS_FILTER", sampler.MANY_ROWS_FILTER)
    monkeypatch.setattr(routed_experts, "CONFIG", routed_experts.CONFIG)
    variant = ["sampler.MANY_ROWS_FILTER='select'", "routed_experts.CONFIG.gathered_max=64"]
    before = routed_experts.CONFIG
    restore = current_settings(variant)
    assert restore == ["sampler.MANY_ROWS_FILTER='pallas'", f"routed_experts.CONFIG.gathered_max={before.gathered_max}"]
    apply_kernel_settings(variant)
    assert sampler.MANY_ROWS_FILTER == "select" and routed_experts.CONFIG.gathered_max == 64
    apply_kernel_settings(restore)
    assert sampler.MANY_ROWS_FILTER == "pallas" and routed_experts.CONFIG == before


@pytest.mark.cost(40)
def test_variants_rerun_the_step_rows_on_the_loaded_model(monkeypatch, tmp_path, capsys):
    """``--variant``: the step rows again with the variant's settings on the model loaded once, alternating over
    ``--rounds``, labelled by variant; the base settings are back afterwards. A bad variant fails before loading."""
    monkeypatch.setattr(sampler, "SELECT_MIN_ROWS", sampler.SELECT_MIN_ROWS)
    out = tmp_path / "rows.json"
    argv = ["--decode-batch", "2", "--context", "8", "--prefill=", "--engine", "off", "--warmup", "0", "--iters", "1",
            "--variant", "sampler.SELECT_MIN_ROWS=1024", "--rounds", "2", "--json", str(out)]
    assert bench_main(argv) == 0
    cases = [row["case"] for row in json.loads(out.read_text())["rows"]]
    assert cases == ["decode B=2 ctx=8", "decode B=2 ctx=8 [sampler.SELECT_MIN_ROWS=1024]"] * 2
    assert sampler.SELECT_MIN_ROWS == 2
    with pytest.raises(SystemExit, match="not a setting of dijax.runtime.sampler"):
        bench_main(["--variant", "sampler.NO_SUCH=1", "--engine", "off"])
    capsys.readouterr()
