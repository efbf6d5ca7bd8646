"""Expert parallelism on 4 CPU host devices: ep = 2 and 4 give the same logits as one device, bit for bit.

The pytest process has already initialised JAX with one host device, so the checks run in a subprocess started
with ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (this file run as a script); it prints one JSON line
of results that the tests assert on. What is checked there:
  * the tiny model (dijax.io.loader.load(None), E = 8, X = 2), one step of two prompts (10 and 4 tokens, every
    position's logits; the step's 16 tokens take the kernel's ragged path): ep = 2 and ep = 4 logits equal ep = 1
    (no mesh) exactly. One step per ep keeps the compile time (most of this file's ~3 minutes) down; the
    gathered path (decode-sized steps) is covered by the routed-experts check below;
  * the same step with attention data parallelism (dijax.parallel.ranks), the two prompts on ranks 1 and 2 of 4
    at ep = 4: logits equal ep = 1 exactly, and the ranks without a sequence keep a pristine cache (each rank holds
    and writes only its own pool). (The engine at ep = 2, a dp 2 x ep 2 mesh with two ep groups, and at ep = 4, both
    with attention data parallelism: tests/test_ep_engine.py);
  * the routed experts alone with X = 6 of the 8 experts (as V4.1-Flash's 6 of 384, so a token's experts span
    every rank), on the gathered (T = 1) and ragged (T = 24) paths, with replicated tokens, and with T = 24 split
    over the ranks (the rank-local layout of the attention-DP step): the 'exact' combine equals one device bit for
    bit; the 'partial' combine (psum of fp32 partial sums) re-associates the sum and is only within a few fp32
    ulps of the output's magnitude (stated bound PARTIAL_BOUND, relative to max |y|);
  * placement: routed-expert matrices split on ``ep``, the router, shared experts and dense weights replicated (the
    Engram tables' row split: tests/test_ep_loading.py);
  * errors: ep not dividing the device count, an expert count not divisible by ep, and a chunk's rank outside the
    ranks are ValueErrors naming them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from dijax.parallel.mesh import force_host_devices, make_mesh, params_mesh, partition_spec, place_params

pytestmark = pytest.mark.cost(120)  # CI seconds, a scheduling hint (tests/conftest.py)

DEVICES = 4
PARTIAL_BOUND = 1e-6  # |partial - exact| / max|exact|: fp32 re-association of six bf16 terms


def _subprocess_results() -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        pytest.fail(f"expert-parallel subprocess failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def results() -> dict:
    return _subprocess_results()


def test_model_logits_equal_one_device(results):
    assert results["devices"] == DEVICES
    for ep in ("2", "4"):
        assert results["model"][ep] == {"equal": True, "max_abs": 0.0}, ep


def test_attention_dp_logits_equal_one_device_and_ranks_hold_only_their_sequences(results):
    for ep, untouched in (("4", [0, 3]),):
        got = results["attention_dp"][ep]
        assert (got["equal"], got["max_abs"]) == (True, 0.0), ep
        assert got["untouched"] == untouched, ep
    assert "ranks must give each of the 2 chunks a rank in [0, 4), got [0, 4]" in results["errors"]["ranks"]


def test_routed_experts_exact_combine_bit_identical(results):
    for key, got in results["experts"].items():
        assert got["exact_equal"], key
        assert got["partial_rel"] <= PARTIAL_BOUND, key
    # the partial-sum combine is not bit-exact once a token's 6 experts span ranks (why 'exact' is the default)
    assert any(got["partial_rel"] > 0 for got in results["experts"].values())


def test_placement_splits_only_routed_experts(results):
    placed = results["placement"]
    assert placed["experts.w1.weight"] == [None, None, "ep", None, None]
    assert placed["gate.weight"] == [None, None, None, None]
    assert placed["gate.bias"] == [None, None, None]
    assert placed["shared_experts.w1.weight"] == [None, None, None, None]
    assert results["params_mesh"] == [True, True]  # the runner finds the mesh from the placed params


def test_errors_name_the_field(results):
    assert "ep=3 must divide the device count 4" in results["errors"]["devices"]
    assert "ep=4 must divide n_routed_experts=6" in results["errors"]["experts"]


def test_one_device_helpers():
    """In the pytest process (one device): no mesh leaves params untouched; ep=2 is a clear error."""
    params = {"w": 1}
    assert place_params(params, None) is params
    with pytest.raises(ValueError, match="ep=2 must divide the device count 1"):
        make_mesh(2)
    with pytest.raises(ValueError, match="ep must be a positive integer"):
        make_mesh(0)
    assert partition_spec(("period", "layer", "expert", "expert_out", "expert_in"))[2] == "ep"


@pytest.mark.parametrize("command", ["parity", "generate"])
def test_cli_rejects_bad_ep(command):
    """``--ep 0`` is refused before anything is loaded (and before the host device flag is touched)."""
    from dijax.cli import generate, parity

    module = {"parity": parity, "generate": generate}[command]
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    with pytest.raises(ValueError, match="--ep must be a positive number of devices, got 0"):
        module.run(parser.parse_args((["fixture"] if command == "parity" else []) + ["--ep", "0"]))


def test_force_host_devices_replaces_count(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--a=1 --xla_force_host_platform_device_count=2 --b")
    force_host_devices(8)
    assert os.environ["XLA_FLAGS"].split() == ["--a=1", "--b", "--xla_force_host_platform_device_count=8"]
    with pytest.raises(ValueError, match="host device count"):
        force_host_devices(0)


def _run_checks() -> dict:
    """The subprocess side (4 host devices). Returns the results the tests above assert on."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import dijax  # noqa: F401  (sets XLA flags before JAX starts)
    from dijax.io.loader import load
    from dijax.kernels.routed_experts import routed_experts
    from dijax.model.moe import gate
    from dijax.model.step import CacheSpec, SeqChunk, init_cache
    from dijax.parallel.moe import routed_experts_ep
    from dijax.runtime.model_runner import ModelRunner

    cfg, params, consts, _ = load(None)
    prompts = [[5, 17, 99, 3, 250, 7, 11, 40, 2, 9], [300, 1, 2, 3]]

    def model_logits(ep: int) -> list[np.ndarray]:
        mesh = make_mesh(ep, cfg.n_routed_experts) if ep > 1 else None
        runner = ModelRunner(cfg, place_params(params, mesh), consts, num_blocks=4, num_slots=2, block_size=16,
                             max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16)
        logits, _ = runner.forward([SeqChunk(slot=i, block_table=[2 * i], start=0, tokens=p, logits="all")
                                    for i, p in enumerate(prompts)])  # the runner traces on the params' mesh
        return [np.asarray(x, np.float32) for x in logits]

    one = model_logits(1)
    model = {}
    for ep in (2, 4):
        got = model_logits(ep)
        model[str(ep)] = {"equal": all(np.array_equal(a, b) for a, b in zip(one, got)),
                          "max_abs": max(float(np.max(np.abs(a - b))) for a, b in zip(one, got))}

    errors = {}
    attention_dp = {}
    fresh = jax.tree.leaves(init_cache(cfg, CacheSpec(num_blocks=4, num_slots=2, block_size=16)))
    for ep, ranks in ((4, [1, 2]),):
        runner = ModelRunner(cfg, place_params(params, make_mesh(ep, cfg.n_routed_experts)), consts, num_blocks=4,
                             num_slots=2, block_size=16, max_model_len=32, max_num_seqs=2,
                             max_num_batched_tokens=16, attention_dp=True)
        chunks = [SeqChunk(slot=i, block_table=[2 * i], start=0, tokens=p, logits="all")
                  for i, p in enumerate(prompts)]
        if ep == 4:
            try:
                runner.forward(chunks, ranks=[0, 4])
            except ValueError as error:
                errors["ranks"] = str(error)
        got = [np.asarray(x, np.float32) for x in runner.forward(chunks, ranks=ranks)[0]]
        leaves = [np.asarray(a) for a in jax.tree.leaves(runner.cache)]
        attention_dp[str(ep)] = {
            "equal": all(np.array_equal(a, b) for a, b in zip(one, got)),
            "max_abs": max(float(np.max(np.abs(a - b))) for a, b in zip(one, got)),
            "untouched": [r for r in range(runner.num_ranks)
                          if all(np.array_equal(a[r], b) for a, b in zip(leaves, fresh))]}

    layer = jax.tree.map(lambda a: a[0, 0], nnx.to_pure_dict(params)["stages"][2]["blocks"][0]["ffn"])
    experts_ref = layer["experts"]
    n_per_token = 6
    checks = {}
    for t in (1, 24):
        x_TD = (jax.random.normal(jax.random.key(t), (t, cfg.dim), jnp.float32) * 4).astype(jnp.bfloat16)
        weights_TX, experts_TX = gate(layer["gate"], x_TD, n_per_token, cfg)
        one_TD = np.asarray(routed_experts(experts_ref, x_TD, weights_TX, experts_TX, cfg.swiglu_limit))
        for ep in (2, 4):
            mesh = make_mesh(ep, cfg.n_routed_experts)
            experts = jax.tree.map(lambda a: jax.device_put(a, jax.NamedSharding(mesh, jax.P("ep"))),
                                   experts_ref)
            with jax.set_mesh(mesh):
                out = {combine: np.asarray(jax.jit(lambda e, x, w, i, c=combine: routed_experts_ep(
                    e, x, w, i, cfg.swiglu_limit, combine=c))(experts, x_TD, weights_TX, experts_TX))
                    for combine in ("exact", "partial")}
            checks[f"T{t}_ep{ep}"] = {
                "exact_equal": bool(np.array_equal(out["exact"], one_TD)),
                "partial_rel": float(np.max(np.abs(out["partial"] - one_TD)) / np.max(np.abs(one_TD)))}
            if t % ep:
                continue
            # the rank-local layout (inside a shard_map manual over ep, as in the attention-DP step): each rank
            # its T / ep tokens, all_gather in, psum_scatter out
            with jax.set_mesh(mesh):
                out = {combine: np.asarray(jax.jit(jax.shard_map(
                    lambda e, x, w, i, c=combine: routed_experts_ep(e, x, w, i, cfg.swiglu_limit, combine=c),
                    mesh=mesh, in_specs=jax.P("ep"), out_specs=jax.P("ep"), check_vma=False))(
                        experts, x_TD, weights_TX, experts_TX)) for combine in ("exact", "partial")}
            checks[f"T{t}_ep{ep}_rank_local"] = {
                "exact_equal": bool(np.array_equal(out["exact"], one_TD)),
                "partial_rel": float(np.max(np.abs(out["partial"] - one_TD)) / np.max(np.abs(one_TD)))}

    mesh = make_mesh(2, cfg.n_routed_experts)
    placed_all = place_params(params, mesh)
    placed = placed_all["stages"][2]["blocks"][0]["ffn"]
    placement = {name: list(leaf.get_value().sharding.spec) + [None] * (leaf.get_value().ndim -
                                                                        len(leaf.get_value().sharding.spec))
                 for name, leaf in (("experts.w1.weight", placed["experts"]["w1"]["weight"]),
                                    ("gate.weight", placed["gate"]["weight"]), ("gate.bias", placed["gate"]["bias"]),
                                    ("shared_experts.w1.weight", placed["shared_experts"]["w1"]["weight"]))}
    for key, args in (("devices", (3,)), ("experts", (4, 6))):
        try:
            make_mesh(*args)
        except ValueError as error:
            errors[key] = str(error)
    return {"devices": jax.device_count(), "model": model, "attention_dp": attention_dp, "experts": checks,
            "placement": placement,
            "errors": errors, "params_mesh": [params_mesh(placed_all) is mesh, params_mesh(params) is None]}


if __name__ == "__main__":
    force_host_devices(DEVICES)
    print(json.dumps(_run_checks()))
