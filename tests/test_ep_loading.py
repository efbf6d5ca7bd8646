"""Loading onto an expert-parallel mesh (4 CPU host devices): each device holds exactly its routed experts and
Engram rows, read for it alone, and the model's logits equal one device's bit for bit.

As in tests/test_expert_parallel.py the checks run in a subprocess started with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (this file run as a script, the checkpoint paths as its
arguments); it prints one JSON line of results that the tests assert on. What is checked there, on the tiny
parity checkpoint (E = 8 experts; Engram tables of 4062 and 4152 rows, so at ep = 4 the first one is padded to
4064):
  * ``load_params(mesh=...)`` at ep 2 and 4: every device's block of every parameter equals the matching slice of
    the one-device load, byte for byte; expert blocks hold the device's E / ep experts, Engram blocks their
    ceil(rows / ep) rows with zero rows past the table's end, everything else the whole tensor;
  * one step of two prompts (every position's logits) at ep 4 equals ep 1 exactly, the Engram lookups
    hitting rows of every device;
  * the Engram lookup alone (``parallel.engram.table_rows``) on every real row of the padded table equals the
    one-device gather; an unpadded table is a ValueError naming the row count;
  * ``loader.load(folder, ep=4)`` and ``LLMEngine(folder, ep=2)`` put the parameters on the mesh; ep not dividing
    n_routed_experts fails before any tensor is read.
The positioned reads the loader uses (``io.safetensors.TensorRef``) are checked in the pytest process itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from dijax.io.safetensors import SafetensorsFile, TensorRef

pytestmark = pytest.mark.cost(35)  # CI seconds, a scheduling hint (tests/conftest.py)

DEVICES = 4


@pytest.fixture(scope="module")
def results() -> dict:
    from tests.conftest import parity_path  # not at the top: the subprocess runs this file without the tests package

    args = [parity_path("tiny-nodrop", "config.json"), parity_path("tiny", "tokenizer.json"),
            parity_path("tiny", "reference", "model.safetensors")]
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        pytest.fail(f"ep-loading subprocess failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_each_device_holds_exactly_its_share(results):
    for ep in ("2", "4"):
        blocks = results["blocks"][ep]
        assert blocks["mismatches"] == [], ep
        assert blocks["experts_per_device"] == [[r * 8 // int(ep), (r + 1) * 8 // int(ep)] for r in range(int(ep))]
    # 4062 rows at ep 4: blocks of 1016 rows, the last one with two zero rows of padding
    assert results["blocks"]["4"]["engram_rows_per_device"] == [[0, 1016], [1016, 2032], [2032, 3048], [3048, 4062]]
    assert results["blocks"]["4"]["padded_rows"] == 4064
    assert results["blocks"]["2"]["engram_rows_per_device"] == [[0, 2031], [2031, 4062]]


def test_logits_equal_one_device(results):
    assert results["logits"]["4"] == {"equal": True, "max_abs": 0.0}
    assert results["engram_ranks_hit"] == [0, 1, 2, 3]


def test_engram_lookup_exact_and_padding_checked(results):
    assert results["lookup"]["equal"]
    assert "Engram table of 4062 rows cannot split over ep=4" in results["lookup"]["unpadded"]


def test_loader_and_engine_use_the_mesh(results):
    assert results["loader"] == {"mesh_ep": 4, "expert_spec": [None, None, "ep", None, None]}
    assert results["engine"] == {"mesh_ep": 2}
    assert "ep=4 must divide n_routed_experts=6" in results["errors"]["experts"]


def test_tensor_ref_reads_row_ranges():
    """In the pytest process: ``TensorRef`` rows equal the memory map's, and only contiguous ranges are read."""
    from tests.conftest import parity_path

    file = SafetensorsFile(parity_path("tiny", "reference", "model.safetensors"))
    for name in ("layers.1.engram.embed.weight", "layers.3.ffn.experts.5.w1.weight", "head.weight"):
        ref, mapped = TensorRef(file, name), file.get(name)
        assert (ref.shape, ref.dtype) == (mapped.shape, mapped.dtype)
        for rows in (slice(None), slice(3, 40), slice(10, 10), slice(-2, None)):
            assert np.array_equal(ref[rows].view(np.uint8), mapped[rows].view(np.uint8)), (name, rows)
    with pytest.raises(TypeError, match="contiguous row ranges"):
        ref[::2]
    with pytest.raises(ValueError, match="has no rows"):
        file.read("head.weight", 5, 4)


def _model_folder(folder: str, config: str, tokenizer: str, weights: str, n_experts: int | None = None) -> str:
    os.makedirs(folder)
    with open(config) as f:
        cfg = json.load(f)
    if n_experts is not None:
        cfg["text_config"]["n_routed_experts"] = n_experts
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    shutil.copy(tokenizer, os.path.join(folder, "tokenizer.json"))
    os.symlink(os.path.abspath(weights), os.path.join(folder, "model.safetensors"))
    return folder


def _run_checks(config: str, tokenizer_path: str, weights: str) -> dict:
    """The subprocess side (4 host devices). Returns the results the tests above assert on."""
    import tempfile

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tokenizers import Tokenizer

    import dijax  # noqa: F401  (sets XLA flags before JAX starts)
    from dijax.config import ModelConfig
    from dijax.io.checkpoint import load_params
    from dijax.io.loader import load
    from dijax.model.engram import EngramTables, hash_rows, ngram_window
    from dijax.model.step import CacheSpec, SeqChunk, build_step, init_cache
    from dijax.model.transformer import forward_step
    from dijax.parallel.engram import table_rows
    from dijax.parallel.mesh import make_mesh, mesh_context, params_mesh
    from dijax.runtime.llm_engine import LLMEngine

    cfg = ModelConfig.from_file(config)
    consts = EngramTables.build(cfg, Tokenizer.from_file(tokenizer_path)).step_consts()
    one = load_params(cfg, weights)
    one_flat = {path: np.asarray(var.get_value()) for path, var in nnx.to_flat_state(one)}
    engram_path = next(p for p in one_flat if p[-3:] == ("engram", "embed", "weight"))  # layer 1: 4062 rows
    expert_path = next(p for p in one_flat if p[-3:] == ("experts", "w1", "weight"))

    loaded, blocks = {}, {}
    for ep in (2, 4):
        mesh = make_mesh(ep, cfg.n_routed_experts)
        loaded[ep] = load_params(cfg, weights, mesh=mesh)
        mismatches, shares = [], {}
        ep_rank = {device: r for (_, r), device in np.ndenumerate(mesh.devices)}
        for path, var in nnx.to_flat_state(loaded[ep]):
            value, full = var.get_value(), one_flat[path]
            padded = np.zeros(value.shape, full.dtype)
            padded[tuple(slice(0, n) for n in full.shape)] = full
            for shard in value.addressable_shards:
                if not np.array_equal(np.asarray(shard.data).view(np.uint8), padded[shard.index].view(np.uint8)):
                    mismatches.append(f"{path} on {shard.device}")
                if path in (engram_path, expert_path):
                    rows = shard.index[2].indices(value.shape[2])
                    shares.setdefault(path, {})[ep_rank[shard.device]] = [rows[0], min(rows[1], full.shape[2])]
        blocks[str(ep)] = {"mismatches": mismatches,
                           "experts_per_device": [shares[expert_path][r] for r in range(ep)],
                           "engram_rows_per_device": [shares[engram_path][r] for r in range(ep)],
                           "padded_rows": int(dict(nnx.to_flat_state(loaded[ep]))[engram_path].get_value().shape[2])}

    prompts = [[5, 17, 99, 3, 250, 7, 11, 40, 2, 9], [300, 1, 2, 3]]
    batch, rows = build_step([SeqChunk(slot=i, block_table=[i], start=0, tokens=p, logits="all")
                              for i, p in enumerate(prompts)], 16, 2, 1, 16)
    step = jax.jit(forward_step, static_argnums=(4,))

    def logits(params, mesh) -> np.ndarray:
        cache = init_cache(cfg, CacheSpec(num_blocks=2, num_slots=2, block_size=16))
        with mesh_context(mesh):
            out, _, _ = step(params, cache, batch, consts, cfg)
        return np.asarray(out)[np.concatenate(rows)]

    reference = logits(one, None)
    results_logits = {}
    for ep in (4,):  # ep 2's logits: tests/test_expert_parallel.py (each ep compiles the whole step)
        got = logits(loaded[ep], params_mesh(loaded[ep]))
        results_logits[str(ep)] = {"equal": bool(np.array_equal(got, reference)),
                                   "max_abs": float(np.max(np.abs(got - reference)))}

    # the ep = 4 ranks holding the rows that the first prompt looks up in the first Engram layer: ids_TG[:, s] is
    # the compressed id s positions back (positions before the prompt become pad ids in ngram_window)
    ids_TG = np.stack([np.asarray(consts["token_map"])[np.array([0] * s + prompts[0][:len(prompts[0]) - s])]
                       for s in range(cfg.engram_max_ngram_size)], axis=1)
    window_TG = ngram_window(jnp.asarray(ids_TG), jnp.arange(len(prompts[0])), consts["pad_id"])
    n_local = blocks["4"]["padded_rows"] // 4
    ranks_hit = sorted({int(r) // n_local for r in np.asarray(hash_rows(window_TG, consts, 0)).ravel()})

    table = {k: dict(nnx.to_flat_state(loaded[4]))[engram_path[:-1] + (k,)].get_value()[0, 0]
             for k in ("weight", "scale")}
    real = one_flat[engram_path].shape[2]
    rows_TJ = jnp.arange(real, dtype=jnp.int32).reshape(-1, 2)
    mesh4 = params_mesh(loaded[4])
    with mesh_context(mesh4):
        weight, scale = jax.jit(table_rows)(table, rows_TJ)
    one_scale = one_flat[engram_path[:-1] + ("scale",)][0, 0]
    lookup = {"equal": bool(np.array_equal(np.asarray(weight).view(np.uint8),
                                           one_flat[engram_path][0, 0][np.asarray(rows_TJ)].view(np.uint8))
                            and np.array_equal(np.asarray(scale), one_scale[np.asarray(rows_TJ)]))}
    try:
        with mesh_context(mesh4):
            table_rows({k: jnp.asarray(one_flat[engram_path[:-1] + (k,)][0, 0]) for k in ("weight", "scale")},
                       rows_TJ)
    except ValueError as error:
        lookup["unpadded"] = str(error)

    errors = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = _model_folder(os.path.join(tmp, "model"), config, tokenizer_path, weights)
        _, params, _, _ = load(folder, ep=4)
        w1 = dict(nnx.to_flat_state(params))[expert_path].get_value()
        loader = {"mesh_ep": params_mesh(params).shape["ep"], "expert_spec": list(w1.sharding.spec)}
        engine = LLMEngine(folder, ep=2, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32)
        engine_result = {"mesh_ep": params_mesh(engine.runner.params).shape["ep"]}
        bad = _model_folder(os.path.join(tmp, "six"), config, tokenizer_path, weights, n_experts=6)
        try:
            load(bad, ep=4)
        except ValueError as error:
            errors["experts"] = str(error)
    return {"blocks": blocks, "logits": results_logits, "engram_ranks_hit": ranks_hit, "lookup": lookup,
            "loader": loader, "engine": engine_result, "errors": errors}


if __name__ == "__main__":
    from dijax.parallel.mesh import force_host_devices

    force_host_devices(DEVICES)
    print(json.dumps(_run_checks(*sys.argv[1:])))
