"""tools/host_probe.py times decode steps: with two requests decoding, every phase is measured on real decode steps
(an empty measurement would give NaN medians)."""

from __future__ import annotations

import math

import pytest

from tools.host_probe import PHASES, host_steps

pytestmark = pytest.mark.cost(10)  # CI seconds, a scheduling hint (tests/conftest.py)


def test_the_probe_times_every_phase_of_decode_steps():
    times = host_steps(batch=2, steps=6)
    assert set(times) == set(PHASES)
    assert all(math.isfinite(ms) and ms > 0 for ms in times.values()), times
