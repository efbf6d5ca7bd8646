"""The engine's one kernel option (dijax.kernels.options.kernel_options, with overrides) and its place in the step's jit
key."""

from __future__ import annotations

import argparse

import jax
import pytest

from dijax.cli.options import add_model_options
from dijax.kernels import (collapse, fp4_wgmma, fp8_linear, indexer, interpret_mode, latents, lowering_for_gpu,
                           routed_experts, router, sinkhorn, sparse_attn, topk)
from dijax.kernels.options import AUTO_ON_GPU, FAST, OPTION_IMPLS, REFERENCE, kernel_options, parse_kernels
from dijax.runtime.model_runner import ModelRunner


def test_choices():
    assert kernel_options("off", "gpu") == REFERENCE
    assert kernel_options("on", "gpu") == FAST
    assert kernel_options("auto", "cpu") == REFERENCE
    assert kernel_options("auto", "gpu") == dict(REFERENCE, **AUTO_ON_GPU)
    assert set(FAST) == set(REFERENCE)


def test_every_gpu_checked_kernel_is_automatic_on_a_gpu():
    # each joined 'auto' after its GPU test and a GPU parity run with it (the latents and collapse kernels last,
    # fortieth session)
    assert kernel_options("auto", "gpu") == FAST
    assert FAST["topk_impl"] == "pallas" and FAST["router_impl"] == "pallas"


def test_bad_choices_name_the_field():
    with pytest.raises(ValueError, match=r"kernels must start with one of \('auto', 'on', 'off'\), got 'pallas'"):
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


def test_mosaic_kernels_are_available_when_lowering_for_an_sm90_gpu():
    # tools/deviceless.py compiles the step for an H100 on a CPU: the Mosaic GPU kernels are picked as there
    on_sm90 = fp4_wgmma.available()
    with lowering_for_gpu():
        assert fp4_wgmma.available()
    assert fp4_wgmma.available() is on_sm90


def test_overrides_after_the_choice():
    # a parity change bisected kernel by kernel: one Pallas kernel among the references (interpreted on a CPU), or
    # one reference among the fast kernels
    assert kernel_options("off,sparse_attn_impl=pallas", "cpu") == dict(REFERENCE, sparse_attn_impl="pallas")
    assert kernel_options("on,topk_impl=select,moe_impl=reference", "gpu") == dict(FAST, topk_impl="select",
                                                                                   moe_impl="reference")
    assert kernel_options("auto,router_impl=reference", "gpu") == dict(AUTO_ON_GPU, router_impl="reference")
    assert parse_kernels("auto") == ("auto", {})


@pytest.mark.parametrize("kernels,message", [
    ("off,sparse=pallas", r"option=impl with option one of \['collapse_impl'"),
    ("off,sparse_attn_impl", r"sparse_attn_impl must be one of \('reference', 'pallas'\), got ''"),
    ("off,topk_impl=triton", r"topk_impl must be one of \('reference', 'select', 'pallas'\), got 'triton'"),
    ("pallas,topk_impl=select", "kernels must start with one of"),
    ("on,topk_impl=select", "kernels='on' needs a GPU"),
])
def test_bad_overrides_name_the_part(kernels, message):
    with pytest.raises(ValueError, match=message):
        kernel_options(kernels, "cpu")


def test_each_option_takes_its_modules_implementations():
    """The options of REFERENCE, FAST and OPTION_IMPLS are one set, and each picks one of its module's IMPLS."""
    modules = {"moe_impl": routed_experts, "topk_impl": topk, "sparse_attn_impl": sparse_attn,
               "sinkhorn_impl": sinkhorn, "linear_impl": fp8_linear, "indexer_impl": indexer, "router_impl": router,
               "latents_impl": latents, "collapse_impl": collapse}
    assert set(REFERENCE) == set(FAST) == set(OPTION_IMPLS) == set(modules)
    for name, module in modules.items():
        assert OPTION_IMPLS[name] is module.IMPLS
        assert REFERENCE[name] in module.IMPLS and FAST[name] in module.IMPLS and AUTO_ON_GPU[name] in module.IMPLS


def test_the_cli_checks_kernels_before_anything_runs(capsys):
    parser = argparse.ArgumentParser(prog="dijax parity")
    add_model_options(parser)
    assert parser.parse_args(["--kernels", "off,sparse_attn_impl=pallas"]).kernels == "off,sparse_attn_impl=pallas"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kernels", "off,sparse_attn_impl=triton"])
    assert "sparse_attn_impl must be one of ('reference', 'pallas'), got 'triton'" in capsys.readouterr().err


def test_the_runner_takes_the_overrides(tiny_nodrop):
    fixture, params, consts = tiny_nodrop
    runner = ModelRunner(fixture.cfg, params, consts, num_blocks=8, num_slots=2, block_size=16, max_model_len=64,
                         max_num_seqs=2, max_num_batched_tokens=32, kernels="off,sparse_attn_impl=pallas")
    assert runner.kernel_options == dict(REFERENCE, sparse_attn_impl="pallas")
