"""The engine step's per-call buffers (dijax.runtime.step_buffers): the staged inputs are the inputs, exactly, and
across a ZOS run every buffer the model step reads or writes (staged inputs, logits, cache) and the sampler's
arguments keep their addresses from one step of a bucket to the next, which is what spares the step's CUDA graphs
their update on a GPU. Host-side
addresses are what XLA:CPU hands out; on the GPU, tools/dispatch_probe.py times the effect."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from dijax.model.step import PackedBatch
from dijax.runtime.llm import LLM
from dijax.runtime.sampler import StepSampling, sampling_inputs
from dijax.runtime.sampling_params import SamplingParams
from dijax.runtime.step_buffers import StepBuffers

pytestmark = pytest.mark.cost(15)  # CI seconds, a scheduling hint (tests/conftest.py)


@pytest.mark.parametrize("ranks", [None, 3])
def test_staged_inputs_are_the_inputs_in_place(ranks):
    """``stage`` writes packed ++ remap ++ previous tokens (repeated on each rank's row) into one buffer per size
    and the sampler's arguments into another, both overwritten in place: a second call returns the second step's
    values at the first call's addresses."""
    rng = np.random.default_rng(0)
    lead = () if ranks is None else (ranks,)
    buffers = StepBuffers()
    addresses = []
    for i in range(2):
        batch = PackedBatch(rng.integers(-5, 100, lead + (37,)).astype(np.int32), ((37,),))
        remap_T = rng.integers(0, 4, lead + (8,)).astype(np.int32)
        prev_R = jax.device_put(rng.integers(0, 100, 4).astype(np.int32))
        columns = sampling_inputs([SimpleNamespace(params=SamplingParams(temperature=0.5 + i, top_k=3 + i),
                                                   seed=2**40 + i, output_position=9 + i)], 4)
        sampling = StepSampling.of(columns, "sample")
        staged, placed = buffers.stage(batch, remap_T, prev_R, sampling)
        addresses.append((staged.values_N.unsafe_buffer_pointer(), placed.packed_7R.unsafe_buffer_pointer()))
        assert placed.mode == "sample" and isinstance(placed.packed_7R, jax.Array)
        np.testing.assert_array_equal(np.asarray(placed.packed_7R), sampling.packed_7R)
        want = np.concatenate([batch.packed_N, remap_T, np.broadcast_to(np.asarray(prev_R), lead + (4,))], -1)
        np.testing.assert_array_equal(np.asarray(staged.values_N), want)
        last_row = (lambda a: a) if ranks is None else (lambda a: a[ranks - 1])  # what the last rank's step reads
        packed, remap, prev = jax.tree.map(last_row, staged).split()
        np.testing.assert_array_equal(packed.packed_N, last_row(batch.packed_N))
        np.testing.assert_array_equal(remap, last_row(remap_T))
        np.testing.assert_array_equal(prev, np.asarray(prev_R))
    assert addresses[0] == addresses[1]


def test_a_zos_run_keeps_every_step_buffer_in_place():
    """The tiny engine under ZOS (prefills, then decodes whose tokens come from the device): per bucket, the staged
    inputs, the sampler's arguments and the logits sit at one address every step, and so does the cache; the
    tokens are those of a run without ZOS."""
    prompts = ["The license", "Permission is hereby granted, free of charge"]
    work = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=7 + i, ignore_eos=True)
            for i in range(len(prompts))]
    llm = LLM(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, zos=True)
    runner = llm.engine.runner
    launch = runner.launch
    seen: dict[tuple, set[int]] = {}

    def watched(*args, **kwargs):
        handle = launch(*args, **kwargs)
        for kind, kept in (("inputs", runner.buffers._inputs), ("sampling", runner.buffers._sampling),
                           ("logits", runner.buffers._logits), ("tokens", runner.buffers._tokens)):
            for shape, array in kept.items():
                seen.setdefault((kind, shape), set()).add(array.unsafe_buffer_pointer())
        seen.setdefault(("cache",), set()).add(jax.tree.leaves(runner.cache)[0].unsafe_buffer_pointer())
        return handle

    runner.launch = watched
    outs = llm.generate(prompts, work, use_tqdm=False)
    assert len(seen) >= 6  # the cache, a prefill and a decode bucket's inputs, the sampling, the logits, the tokens
    assert all(len(addresses) == 1 for addresses in seen.values()), seen
    plain = LLM(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, zos=False)
    assert [o.token_ids for o in plain.generate(prompts, work, use_tqdm=False)] == [o.token_ids for o in outs]
