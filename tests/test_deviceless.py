"""tools/deviceless.py's pieces that need no CUDA plugin: the step's bucket is the one the engine's runner takes
for the same sequences, the target description names the card and compute capability 9.0, and the tiny step
lowered for CUDA in its GPU form has no loop outside its kernels. (The compile itself needs the CUDA plugin, which
CI does not install; the tool's docstring says how it was checked against the GPU.)"""

from __future__ import annotations

import jax
import pytest

from dijax.model.step import CacheSpec, init_cache
from tools.bench import load_model, step_runner
from tools.deviceless import TARGETS, lower_step, model_config, step_bucket, target_config

pytestmark = pytest.mark.cost(15)  # CI seconds, a scheduling hint (tests/conftest.py)


@pytest.mark.parametrize("lengths", [[(255, 1)], [(255, 1)] * 3, [(0, 40)], [(100, 5), (7, 20)]])
def test_the_bucket_is_the_runners(lengths):
    cfg, params, consts = load_model("tiny", 0)
    runner, _, inputs, _, _ = step_runner(cfg, params, consts, lengths, block_size=16, kernels="off")
    shapes = inputs[0].shapes  # StepBatch order: tokens_T first, block_table_SB ninth
    tokens, rows, width, num_blocks, slots = step_bucket(lengths, 16)
    assert (tokens, rows, width) == (shapes[0][0], *shapes[8])
    cache = jax.eval_shape(lambda: init_cache(cfg, CacheSpec(num_blocks=num_blocks, num_slots=slots, block_size=16)))
    assert jax.tree.map(lambda a: a.shape, cache) == jax.tree.map(lambda a: a.shape, runner.cache)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_the_target_is_a_compute_capability_9_card(target):
    text = target_config(target)
    assert f'device_description_str: "{TARGETS[target]["name"]}"' in text
    assert "cuda_compute_capability { major: 9 minor: 0 }" in text
    assert f"device_memory_size: {TARGETS[target]['memory']}" in text


@pytest.mark.parametrize("lengths", [[(256, 1)], [(256, 1)] * 64, [(0, 256)]],
                         ids=["decode1", "decode64", "prefill256"])
def test_the_tiny_step_lowered_for_a_gpu_has_no_loop(lengths):
    # outside its kernels, a loop in the step is kernels of its own every trip on the GPU (a binary search in the
    # routed experts' tile layout was 200 of the tiny decode step's 901 launches at batch 64: docs/benchmarks.md,
    # thirty-third session); the tiny model has no stacked layers, so its step has no loop by design either
    assert "stablehlo.while" not in lower_step(model_config("tiny"), "on", lengths, 16).as_text()
