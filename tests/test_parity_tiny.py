"""Parity of the ``tiny`` fixture (index_topk 8: top-k selection drops positions) against DeepSeek's reference
logits, with every bound from its manifest: ``tier1-injected`` (the recorded index sets injected) and
``tier2-selection`` (dijax's own selection).

A file of its own (not tests/test_parity.py, which holds tiny-nodrop's checks and the checker's tests) so that the
two fixtures' runs go to different pytest-xdist workers. ``dijax convert`` followed by ``dijax parity`` on its
output is here too.
"""

from __future__ import annotations

import io

import pytest

from tests.conftest import parity_path
from tests.test_parity import _assert_tier1, _one_case_fixture, manifest_check

pytestmark = pytest.mark.cost(115)  # CI seconds, a scheduling hint (tests/conftest.py)


@pytest.mark.slow
def test_tiny_meets_its_manifest_injected_and_selection():
    from dijax.cli.parity import Fixture, evaluate, load_model, run_cases

    fixture = Fixture(parity_path("tiny"))
    _assert_tier1(fixture, manifest_check("tiny", "tier1-injected"), chunk=None)
    params, consts = load_model(fixture)
    runs = run_cases(fixture, params, consts, fixture.case_names, False, None)
    out = io.StringIO()
    assert evaluate(fixture, manifest_check("tiny", "tier2-selection"), runs, out), out.getvalue()


def test_cli_convert_then_parity_on_the_result(tmp_path):
    from dijax.cli.main import main

    out = tmp_path / "converted"
    assert main(["convert", parity_path("tiny", "hf"), str(out)]) == 0
    assert main(["convert", parity_path("tiny", "hf"), str(out)]) == 2  # exists: a clear error, exit 2
    (tmp_path / "fx").mkdir()
    folder = _one_case_fixture(tmp_path / "fx", "tiny", "case_L5", [manifest_check("tiny", "tier1-injected")])
    assert main(["parity", folder, "--weights", str(out)]) == 0
