"""dijax/kernels/scale_range.py: weights whose scales leave a GPU kernel's exact range hand that op to its reference."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from dijax.kernels import fp8_linear, routed_experts
from dijax.kernels.options import FAST, REFERENCE
from dijax.kernels.scale_range import exact_kernels, out_of_range
from dijax.runtime import model_runner


def _params(linear_scale: int = 119, expert_scale: int = 119) -> dict:
    """A layer's worth of each kind: an fp8 linear [64, 96], MXFP4 experts [2, 64, 96], an fp8 table (one scale
    per row, no linear) and fp8 experts (the reference serves them), every scale byte 119 but the two given."""
    u8 = lambda shape, v: jnp.full(shape, v, jnp.uint8)  # noqa: E731
    fp8 = lambda shape: jnp.zeros(shape, jnp.float8_e4m3fn)  # noqa: E731
    return {"attn": {"wq_a": {"weight": fp8((64, 96)), "scale": u8((2, 3), 119).at[1, 2].set(linear_scale)}},
            "engram": {"embed": {"weight": fp8((64, 96)), "scale": u8((64, 3), 250)}},
            "ffn": {"experts": {"w1": {"weight": u8((2, 64, 48), 0),
                                       "scale": u8((2, 64, 3), 119).at[1, 5, 0].set(expert_scale)}},
                    "fp8_experts": {"experts": {"w2": {"weight": fp8((2, 64, 96)), "scale": u8((2, 2, 3), 0)}}}}}


def test_real_scales_are_in_range(tiny_nodrop):
    _, params, _ = tiny_nodrop
    assert out_of_range(params) == {}
    assert out_of_range(_params()) == {}
    assert exact_kernels(dict(FAST), _params()) == FAST


@pytest.mark.parametrize("edge", ["low", "high"])
def test_each_range_end_is_kept_and_the_byte_beyond_is_caught(edge):
    (lin_lo, lin_hi), (moe_lo, moe_hi) = fp8_linear.SCALE_RANGE, routed_experts.GEMM_SCALE_RANGE
    inside = (lin_lo, moe_lo) if edge == "low" else (lin_hi, moe_hi)
    assert out_of_range(_params(*inside)) == {}
    beyond = (lin_lo - 1, moe_lo - 1) if edge == "low" else (lin_hi + 1, moe_hi + 1)
    found = out_of_range(_params(*beyond))
    assert found == {"linear_impl": [f"attn/wq_a: scale bytes {min(119, beyond[0])}..{max(119, beyond[0])} "
                                     f"(exact: {lin_lo}..{lin_hi})"],
                     "moe_impl": [f"ffn/experts/w1: scale bytes {min(119, beyond[1])}..{max(119, beyond[1])} "
                                  f"(exact: {moe_lo}..{moe_hi})"]}


def test_only_the_op_that_leaves_its_range_is_handed_over():
    with pytest.warns(UserWarning, match=r"linear_impl: .*attn/wq_a: scale bytes 119\.\.200"):
        options = exact_kernels(dict(FAST), _params(linear_scale=200))
    assert options == dict(FAST, linear_impl="reference")
    with pytest.warns(UserWarning, match=r"moe_impl: .*ffn/experts/w1: scale bytes 3\.\.119"):
        options = exact_kernels(dict(FAST), _params(expert_scale=3))
    assert options == dict(FAST, moe_impl="reference")


def test_reference_options_read_nothing():
    class Unreadable(dict):  # a parameter tree that fails if anything looks inside
        def __getitem__(self, key):
            raise AssertionError("read")

        get = items = __getitem__

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert exact_kernels(dict(REFERENCE), Unreadable()) == REFERENCE


def test_the_engine_runner_applies_it(tiny_nodrop, monkeypatch):
    """A runner asked for every Pallas kernel, on weights with one fp8 scale out of range: the fp8 linear's op goes
    to the reference, every other kernel stays."""
    fixture, params, consts = tiny_nodrop
    wq_a = params["stages"][1]["blocks"][0]["attn"]["wq_a"]["scale"]
    saved = wq_a.get_value()
    monkeypatch.setattr(model_runner, "kernel_options", lambda kernels, platform: dict(FAST))
    wq_a.set_value(saved.at[(0,) * saved.ndim].set(np.uint8(200)))
    try:
        with pytest.warns(UserWarning, match="stages/1/blocks/0/attn/wq_a"):
            runner = model_runner.ModelRunner(fixture.cfg, params, consts, num_blocks=8, num_slots=2, block_size=16,
                                              max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32)
    finally:
        wq_a.set_value(saved)
    assert runner.kernel_options == dict(FAST, linear_impl="reference")
