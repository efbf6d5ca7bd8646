"""Random weights: the host recipe (``random_params``) and the device-drawn codes for benchmarks (``random_codes``)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dijax.config import ModelConfig
from dijax.io.loader import ASSETS, load
from dijax.model import param_map
from dijax.model.param_map import Deferred, checkpoint_tree
from dijax.io.checkpoint import params_from_tensors
from dijax.io import random_init
from dijax.io.random_init import random_bytes, random_codes, random_codes_params, random_params
from dijax.model.step import SeqChunk
from dijax.runtime.model_runner import ModelRunner

pytestmark = pytest.mark.cost(35)  # CI seconds, a scheduling hint (tests/conftest.py)


def test_random_codes_match_the_recipe_layout_and_give_finite_logits():
    cfg = ModelConfig.from_file(os.path.join(ASSETS, "config.json"))
    codes, recipe = random_codes_params(cfg, seed=3), random_params(cfg, seed=3)
    assert jax.tree.structure(codes) == jax.tree.structure(recipe)
    for a, b in zip(jax.tree.leaves(codes), jax.tree.leaves(recipe)):
        assert a.shape == b.shape and a.dtype == b.dtype
    for x in jax.tree.leaves(codes):  # no NaN code anywhere (fp8 codes keep the exponent field below 8)
        assert bool(jnp.isfinite(x.astype(jnp.float32)).all())
    w = np.asarray(checkpoint_tree(cfg, codes)["layers"][0]["attn"]["wq_a"]["weight"].astype(jnp.float32))
    assert np.abs(w).max() < 2 and w.std() > 0.1  # random codes, not zeros
    assert not np.array_equal(np.asarray(random_codes_params(cfg, seed=4)["embed"]["weight"][...]),
                              np.asarray(codes["embed"]["weight"][...]))

    _, _, consts, _ = load(None)
    runner = ModelRunner(cfg, codes, consts, num_blocks=4, num_slots=2, block_size=16, max_model_len=32,
                         max_num_seqs=2, max_num_batched_tokens=32)
    logits, _ = runner.forward([SeqChunk(slot=0, block_table=[0, 1], start=0, tokens=list(range(5, 25))),
                                SeqChunk(slot=1, block_table=[2], start=0, tokens=[7, 8, 9])])
    logits_RV = np.concatenate(logits)
    assert logits_RV.shape == (2, cfg.vocab_size) and np.isfinite(logits_RV).all()
    assert float(np.std(logits_RV)) > 0


def test_random_bytes_are_uniform_bytes_of_the_shape():
    key = jax.random.key(0)
    for shape in [(64, 256), (3, 33, 31)]:  # words viewed as bytes; an odd last dimension drawn byte-wise
        got = np.asarray(random_bytes(key, shape))
        assert got.shape == shape and got.dtype == np.uint8
        assert len(np.unique(got)) > 100 and abs(got.mean() - 127.5) < 10
    np.testing.assert_array_equal(random_bytes(key, (4, 8)), random_bytes(key, (4, 8)))
    assert not np.array_equal(random_bytes(key, (4, 8)), random_bytes(jax.random.key(1), (4, 8)))


def test_large_random_bytes_are_drawn_in_slices(monkeypatch):
    """Past ``_BYTES_AT_ONCE`` the tensor is drawn slice by slice: the compiled draw's temporaries are a few
    slices' (35 MB here), not several times the tensor's (a real-size expert stack, 384 x 2304 x 2560 bytes: 6.8 GB
    of temporaries for its 2.3 GB drawn whole); the slices are uniform and differ (a key each), and the draw is
    deterministic."""
    shape = (384, 2304, 2560)
    temp = random_bytes.lower(jax.random.key(0), shape).compile().memory_analysis().temp_size_in_bytes
    assert temp <= 16 * np.prod(shape[1:]), temp
    monkeypatch.setattr(random_init, "_BYTES_AT_ONCE", 64)
    got = np.asarray(random_bytes(jax.random.key(2), (5, 16, 12)))  # a shape drawn nowhere else: traced here
    assert got.shape == (5, 16, 12) and abs(got.mean() - 127.5) < 12
    assert all(not np.array_equal(got[0], got[e]) for e in range(1, 5))
    np.testing.assert_array_equal(got, random_bytes(jax.random.key(2), (5, 16, 12)))


def test_random_codes_are_drawn_one_at_a_time_as_they_are_placed(monkeypatch):
    """The device never holds the drawn tensors beside the parameters (an H100 ran out of memory drawing flash-slice
    when every tensor was drawn before the first was placed and the stacked parameters were filled from them): at
    every tensor made and every layer written into a stacked parameter, the live device arrays are at most the
    parameters' bytes and one tensor's. The accelerator's path (layers written into their stacked buffers on the
    device) is taken on this CPU; the values equal the CPU path's."""
    cfg = ModelConfig.from_file(os.path.join(ASSETS, "config.json"))
    monkeypatch.setattr(param_map.jax, "default_backend", lambda: "gpu")
    before = sum(a.nbytes for a in jax.live_arrays())  # other tests' arrays in this process
    live, made = [], []

    def watched(item):
        name, deferred = item
        assert isinstance(deferred, Deferred), name

        def make():
            live.append(sum(a.nbytes for a in jax.live_arrays()))
            made.append(name)
            return deferred.make()
        return name, deferred._replace(make=make)

    def watch(module, name):
        def watched_call(*args, **kwargs):
            live.append(sum(a.nbytes for a in jax.live_arrays()))
            return call(*args, **kwargs)
        call = getattr(module, name)
        monkeypatch.setattr(module, name, watched_call)
    watch(param_map, "_write_donated")
    watch(param_map.jax, "device_put")

    state = params_from_tensors(cfg, map(watched, random_codes(cfg, seed=3)))
    params = sum(x.nbytes for x in jax.tree.leaves(state))
    largest = max(np.prod(d.shape) * d.dtype.itemsize for _, d in random_codes(cfg, seed=3))
    assert len(made) == len(set(made)) == len(list(random_codes(cfg, seed=3)))  # each made once
    assert max(live) - before <= params + largest, (max(live) - before, params, largest)
    want = random_codes_params(cfg, seed=3)  # the same values whichever path placed them
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_random_codes_compile_one_program_a_kind_and_shape(monkeypatch):
    """Each dense tensor is drawn by one jitted program keyed on its layer-free name and shape, so the layers share
    their compilations (eager draws compiled every operation for every shape: flash-slice's load on a fresh H100
    took 151 s, thirty-sixth session); the tensors drawn that way still differ from layer to layer."""
    cfg = ModelConfig.from_file(os.path.join(ASSETS, "config.json"))
    kinds = []
    traced = random_init._dense_codes
    monkeypatch.setattr(random_init, "_dense_codes", lambda kind, *a: kinds.append(kind) or traced(kind, *a))
    traced.clear_cache()
    drawn = {name: np.asarray(d.make()) for name, d in random_codes(cfg, seed=5) if d.dtype != np.uint8}
    dense = [n for n in drawn if n.startswith("layers.") and n.endswith("attn_norm.weight")]
    assert len(dense) == cfg.n_layers and "layers.L.attn_norm.weight" in kinds
    assert all(not k.startswith("layers.") or k.startswith("layers.L.") for k in kinds)
    assert traced._cache_size() < len(kinds)  # layers of one shape and kind share a compilation
    assert not np.array_equal(drawn[dense[0]], drawn[dense[1]])  # each layer its own key
