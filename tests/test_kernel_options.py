"""The engine's one kernel option (dijax.kernels.kernel_options) and its place in the step's jit key."""

from __future__ import annotations

import jax
import pytest

from dijax.kernels import AUTO_ON_GPU, FAST, REFERENCE, interpret_mode, kernel_options, lowering_for_gpu


def test_choices():
    assert kernel_options("off", "gpu") == REFERENCE
    assert kernel_options("on", "gpu") == FAST
    assert kernel_options("auto", "cpu") == REFERENCE
    assert kernel_options("auto", "gpu") == dict(REFERENCE, **AUTO_ON_GPU)
    assert set(FAST) == set(REFERENCE)


def test_every_gpu_checked_kernel_is_automatic_on_a_gpu():
    # each joined 'auto' after its GPU test and a GPU parity run with it (the router last, twenty-third session)
    assert kernel_options("auto", "gpu") == FAST
    assert FAST["topk_impl"] == "pallas" and FAST["router_impl"] == "pallas"


def test_bad_choices_name_the_field():
    with pytest.raises(ValueError, match=r"kernels must be one of \('auto', 'on', 'off'\), got 'pallas'"):
        kernel_options("pallas", "gpu")
    with pytest.raises(ValueError, match="kernels='on' needs a GPU"):
        kernel_options("on", "cpu")


def test_lowering_for_gpu_switches_interpretation_off_only_within():
    on_cpu = jax.default_backend() != "gpu"
    assert interpret_mode() is on_cpu and interpret_mode(True) and not interpret_mode(False)
    with pytest.raises(RuntimeError):
        with lowering_for_gpu():
            assert not interpret_mode() and interpret_mode(True)
            raise RuntimeError("restored on the way out")
    assert interpret_mode() is on_cpu
