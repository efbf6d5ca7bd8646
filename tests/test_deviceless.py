"""tools/deviceless.py's pieces that need no CUDA plugin: the step's bucket is the one the engine's runner takes
for the same sequences, and the target description names the card and compute capability 9.0. (The compile itself
needs the CUDA plugin, which CI does not install; the tool's docstring says how it was checked against the GPU.)"""

from __future__ import annotations

import jax
import pytest

from dijax.model.step import CacheSpec, init_cache
from tools.bench import load_model, step_runner
from tools.deviceless import TARGETS, step_bucket, target_config

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
