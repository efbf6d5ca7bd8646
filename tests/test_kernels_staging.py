"""The staging copy (dijax.kernels.staging): the Pallas kernel (interpreted here) returns its input exactly, sizes are
padded to whole blocks on the host, the packed batch round-trips through the padding, the kernel lowers to Triton
for an H200, and the engine's model step lowered for an H200 reads its host inputs only through the copy.
tests/gpu/test_staging_gpu.py checks the same on the GPU after XLA's optimisations."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dijax.kernels import REFERENCE
from dijax.kernels.staging import BLOCK, pad_for_staging, padded_size, stage, stage_pallas
from dijax.model.step import CacheSpec, StepBatch, init_cache, pack_batch, unpack_batch
from dijax.runtime.model_runner import bucket_inputs, compiled_step


@pytest.mark.parametrize("n, dtype", [(1, np.int32), (8, np.int32), (BLOCK, np.int32), (3 * BLOCK, np.uint32)])
def test_copy_is_exact(n, dtype):
    x = np.random.default_rng(n).integers(0, 2**31 - 1, n).astype(dtype)
    if dtype == np.int32:
        x[::3] = -x[::3]
    got = np.asarray(stage_pallas(jnp.asarray(x), interpret=True))
    assert got.dtype == dtype and np.array_equal(got, x)
    assert np.array_equal(np.asarray(stage(jnp.asarray(x), impl="reference")), x)


def test_sizes_and_errors():
    assert [padded_size(n) for n in (1, 5, 8, 100, 128, 129, 300)] == [1, 8, 8, 128, 128, 256, 384]
    padded = pad_for_staging(np.arange(130, dtype=np.int32), fill=-7)
    assert padded.shape == (256,) and np.array_equal(padded[:130], np.arange(130)) and (padded[130:] == -7).all()
    with pytest.raises(ValueError, match="multiple of 128"):
        stage_pallas(jnp.zeros(200, jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="stage impl must be one of"):
        stage(jnp.zeros(8, jnp.int32), impl="xla")


def test_packed_batch_is_staged_size_and_round_trips():
    rng = np.random.default_rng(0)
    fields = {}
    for f in StepBatch.__dataclass_fields__.values():
        fields[f.name] = rng.integers(0, 50, (3, 5) if f.name == "block_table_SB" else 7).astype(np.int32)
    fields["valid_T"] = np.array([1, 1, 0, 1, 0, 0, 1], bool)
    packed = pack_batch(StepBatch(**fields))
    assert packed.packed_N.shape[0] == padded_size(packed.packed_N.shape[0])
    back = unpack_batch(jax.tree.map(jnp.asarray, packed))
    for name, value in fields.items():
        assert np.array_equal(np.asarray(getattr(back, name)), value), name


def test_lowers_for_an_h200(lower_for_cuda):
    text = lower_for_cuda(stage_pallas, jax.ShapeDtypeStruct((4 * BLOCK,), jnp.int32))
    assert "__gpu$xla.gpu.triton" in text and "stage" in text


def _uses(main: str, name: str) -> list[str]:
    """The lines of the StableHLO function body ``main`` that read the value ``name`` (e.g. '%arg7')."""
    body = main[main.index("{\n"):]
    return [line for line in body.splitlines() if re.search(rf"{re.escape(name)}\b", line)]


def test_engine_step_reads_its_host_inputs_only_through_the_copy(lower_for_cuda, monkeypatch, tiny_nodrop):
    """The engine's model step lowered for an H200 with staging on: the packed batch and the ZOS remap are each read
    by one Triton call (the copy) and by nothing else, so a later change that reads a field before the copy fails
    here, on the CPU, rather than as CUDA-graph updates on the GPU."""
    fixture, params, consts = tiny_nodrop
    cfg = fixture.cfg
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # stage() lowers the kernel instead of interpreting
    options = dict(REFERENCE, stage_impl="pallas")
    leaves, tree = jax.tree.flatten(params)
    step = compiled_step(cfg, tuple(sorted(options.items())), tree)
    tokens, seqs, width = 16, 2, 3  # a bucket no other test traces with these options
    batch, remap_T = bucket_inputs(tokens, seqs, width)
    cache = jax.eval_shape(lambda: init_cache(cfg, CacheSpec(num_blocks=8, num_slots=seqs, block_size=16)))
    args = (jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), leaves), cache, batch, consts,
            jax.ShapeDtypeStruct((seqs,), jnp.int32), remap_T)
    lower_for_cuda  # noqa: B018  (the fixture fakes the H200 the Triton lowering asks about)
    text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    main = text[text.index("func.func public @main("):]
    main = main[:main.index("\n  }\n")]
    signature = main[:main.index("{\n")]
    for length in (batch.packed_N.shape[0], tokens):
        [arg] = re.findall(rf"(%arg\d+): tensor<{length}xi32>", signature)
        uses = _uses(main, arg)
        assert len(uses) == 1 and "__gpu$xla.gpu.triton" in uses[0] and "stage" in uses[0], (length, uses)
