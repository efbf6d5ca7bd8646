"""Weights read in place from a stack of layers (dijax.kernels.stacked): the kernels (interpret mode on CPU) and the
references give for a ``LayerSlice`` exactly what they give for the sliced-out layer, stacks a Triton kernel could
not address are sliced, and the scanned step no longer copies a layer's weights out of its stack."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dijax.kernels import fp8_linear as fl
from dijax.kernels import routed_experts as rx
from dijax.io.random_init import random_params
from dijax.kernels.stacked import LayerSlice, in_place, materialize, of_layer, offsets_fit
from dijax.model import param_map
from dijax.model.layers import IN_PLACE
from dijax.model.plan import plan_layers
from dijax.model.step import CacheSpec, init_cache, unpack_batch
from dijax.model.transformer import abstract_state, forward_step
from dijax.runtime.model_runner import bucket_inputs
from tests.test_kernels_fp8_linear import _weights
from tests.test_kernels_routed_experts import LIMIT, make_experts, make_routing, make_x
from tests.test_nnx_model import _repeating

pytestmark = pytest.mark.cost(40)  # CI seconds, a scheduling hint (tests/conftest.py)

LEAD = (2, 3)  # (period, layer) of the stacks
LAYER = 4  # period 1, layer 1: neither the first nor the last


def _stack(make, *args) -> tuple:
    """One independent random weight per stacked layer, stacked [2, 3, ...] (``make(seed, *args)``)."""
    layers = [make(seed, *args) for seed in range(int(np.prod(LEAD)))]
    return tuple(jnp.stack(parts).reshape(*LEAD, *parts[0].shape) for parts in zip(*layers))


def test_layer_slice_indexes_the_flattened_leading_dims():
    stack = jnp.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5)
    view = of_layer(stack, LAYER, 2)
    assert view.shape == (4, 5) and view.dtype == stack.dtype
    np.testing.assert_array_equal(materialize(view), stack[1, 1])
    [flat], index = in_place([view])
    assert flat.shape == (6, 4, 5) and int(index) == LAYER
    [flat], index = in_place([stack[1, 1]])  # a plain weight is a stack of one
    assert flat.shape == (1, 4, 5) and int(index) == 0
    # one plain weight among them: all are sliced, so that one index reads every one
    flats, index = in_place([view, stack[1, 1]])
    assert [f.shape for f in flats] == [(1, 4, 5)] * 2 and int(index) == 0
    np.testing.assert_array_equal(flats[0][0], stack[1, 1])
    # a pytree: it goes through jit and scans like the arrays it holds, its ndim static
    got = jax.jit(lambda v: materialize(v) + 0)(view)
    np.testing.assert_array_equal(got, stack[1, 1])


def test_stacks_a_kernel_could_not_address_are_sliced():
    assert offsets_fit(2 ** 31 - 1, 1) and not offsets_fit(2 ** 31, 1) and not offsets_fit(2 ** 32, 1)
    assert offsets_fit(2 ** 32 + 1, 1) and offsets_fit(2 ** 31, 4)  # past 2^32 bytes Pallas indexes in int64
    big = jax.ShapeDtypeStruct((3, 2 ** 30), jnp.uint8)  # 3 GiB of bytes: int32 offsets would wrap
    small = jax.ShapeDtypeStruct((3, 2 ** 29), jnp.uint8)  # 1.5 GiB: read in place
    [flat], index = jax.eval_shape(lambda s: in_place([of_layer(s, 2, 1)]), big)
    assert flat.shape == (1, 2 ** 30) and index.shape == ()
    [flat], _ = jax.eval_shape(lambda s: in_place([of_layer(s, 2, 1)]), small)
    assert flat.shape == (3, 2 ** 29)
    # read together with a stack that cannot be addressed, the small one is sliced too
    flats, _ = jax.eval_shape(lambda a, b: in_place([of_layer(a, 2, 1), of_layer(b, 2, 1)]), small, big)
    assert [f.shape for f in flats] == [(1, 2 ** 29), (1, 2 ** 30)]


@pytest.mark.parametrize("tokens", [3, 40])  # 40 > CONFIG.max_tokens: the reference serves it
def test_fp8_linear_of_a_stacked_layer(tokens):
    out_dim, in_dim = 64, 96
    weight, scale = _stack(lambda seed: _weights(out_dim, in_dim, seed)[:2])
    x = (jax.random.normal(jax.random.key(tokens), (tokens, in_dim), jnp.float32) * 3).astype(jnp.bfloat16)
    w_layer, s_layer = weight.reshape(-1, out_dim, in_dim)[LAYER], scale.reshape(-1, *scale.shape[2:])[LAYER]
    for impl in ("reference", "pallas"):
        got = fl.fp8_linear(x, of_layer(weight, LAYER, 2), of_layer(scale, LAYER, 2), impl=impl)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(fl.fp8_linear(x, w_layer, s_layer, impl=impl)))
    # the kernel really reads layer LAYER: another layer's weight gives another result
    other = fl.fp8_linear(x, of_layer(weight, LAYER - 1, 2), of_layer(scale, LAYER - 1, 2), impl="pallas")
    assert not np.array_equal(np.asarray(other), np.asarray(fl.fp8_linear(x, w_layer, s_layer, impl="pallas")))


@pytest.mark.parametrize("impl,path", [("reference", "gathered"), ("reference", "ragged"),
                                       ("pallas", "gathered"), ("pallas", "ragged")])
def test_routed_experts_of_a_stacked_layer(impl, path):
    n_experts, d, f = 8, 64, 64
    rng = np.random.default_rng(3)
    layers = [make_experts(rng, n_experts, d, f, (118, 130)) for _ in range(int(np.prod(LEAD)))]
    stacks = jax.tree.map(lambda *a: jnp.stack(a).reshape(*LEAD, *a[0].shape), *layers)
    views = jax.tree.map(lambda a: of_layer(a, LAYER, 3), stacks)
    assert isinstance(views["w1"]["weight"], LayerSlice)
    x_TD = make_x(rng, 5, d, 1.0)
    weights_TX, experts_TX = make_routing(rng, 5, n_experts, 3, pad_tokens=(2,), pad_slots=(4,))
    want = rx.routed_experts(layers[LAYER], x_TD, weights_TX, experts_TX, LIMIT, impl=impl, path=path)
    got = rx.routed_experts(views, x_TD, weights_TX, experts_TX, LIMIT, impl=impl, path=path)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    other = rx.routed_experts(layers[LAYER - 1], x_TD, weights_TX, experts_TX, LIMIT, impl=impl, path=path)
    assert not np.array_equal(np.asarray(other), np.asarray(want))


def _weight_reads(jaxpr) -> list[tuple[str, int]]:
    """(kernel name, leading dim of its packed weight operands) of every fp8-linear and routed-experts
    ``pallas_call`` in ``jaxpr`` and its sub-jaxprs (scan bodies, nested jits)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            name = str(eqn.params.get("name") or eqn.params.get("name_and_src_info")).split()[0]
            dims = {v.aval.shape[0] for v in eqn.invars
                    if v.aval.ndim == 3 and v.aval.dtype in (jnp.uint8, jnp.uint32)}
            if name.startswith(("fp8_linear", "routed")):
                assert len(dims) == 1, (name, dims)
                found.append((name, dims.pop()))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    found += _weight_reads(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    found += _weight_reads(sub)
    return found


def test_scanned_layers_hand_their_kernels_the_whole_stack():
    """In the stacked step every fp8 linear and routed-experts kernel gets its layer's whole [period x layer] stack
    (and reads the layer through an index): a weight sliced out of the stack per layer would be a copy on the GPU."""
    cfg = _repeating()
    stacks = {s.repeats * s.run_length(r) for s in plan_layers(cfg) for r in range(s.num_runs)}
    assert max(stacks) > 1
    params = abstract_state(cfg)
    cache = jax.eval_shape(lambda: init_cache(cfg, CacheSpec(num_blocks=8, num_slots=8, block_size=16)))
    batch = unpack_batch(bucket_inputs(8, 8, 2)[0])
    jaxpr = jax.make_jaxpr(lambda p, c, b: forward_step(p, c, b, {}, cfg, moe_impl="pallas", linear_impl="pallas"))(
        params, cache, batch)
    reads = _weight_reads(jaxpr.jaxpr)
    assert {name for name, _ in reads} == {"fp8_linear", "routed_gate_up_matvec", "routed_down_matvec"}
    assert {dim // (cfg.n_routed_experts if name.startswith("routed") else 1) for name, dim in reads} == stacks
    # the mark survives the way the engine gets its parameters (a checkpoint tree placed by param_map)
    loaded = param_map.state_from_tree(cfg, param_map.checkpoint_tree(cfg, random_params(cfg, seed=0)))

    def marked(state):
        return [path for path, v in nnx.to_flat_state(state) if IN_PLACE(path, v)]

    assert marked(loaded) == marked(params) and len(marked(params)) > 0


@pytest.mark.parametrize("tokens", [2, 9])  # a tile per assignment (6 of them), then fitted tiles (27)
def test_routed_experts_of_a_stacked_layer_on_fp4_wgmma(tokens, monkeypatch):
    """The 'mgpu' path reads a stacked layer's experts in place (expert ids offset into the flattened stack):
    fp4_wgmma's kernel in the Mosaic GPU interpreter, against the same layer's experts as plain arrays."""
    monkeypatch.setattr(rx, "_mgpu_takes", lambda *args: True)
    monkeypatch.setattr(rx.fp4_wgmma, "grouped_gemm_t_mgpu",
                        functools.partial(rx.fp4_wgmma.grouped_gemm_t_mgpu, interpret=True))
    monkeypatch.setattr(rx, "CONFIG", dataclasses.replace(rx.CONFIG, gemm_engine="mgpu", mgpu_warpgroups=1,
                                                             mgpu_min_assignments=0))
    rx._routed_experts_call.clear_cache()
    n_experts, d, f = 8, 128, 128
    rng = np.random.default_rng(4)
    layers = [make_experts(rng, n_experts, d, f, (118, 130)) for _ in range(int(np.prod(LEAD)))]
    stacks = jax.tree.map(lambda *a: jnp.stack(a).reshape(*LEAD, *a[0].shape), *layers)
    views = jax.tree.map(lambda a: of_layer(a, LAYER, 3), stacks)
    x_TD = make_x(rng, tokens, d, 1.0)
    weights_TX, experts_TX = make_routing(rng, tokens, n_experts, 3, pad_tokens=(1,))
    try:
        got = rx.routed_experts(views, x_TD, weights_TX, experts_TX, LIMIT, impl="pallas", path="ragged")
        plain = rx.routed_experts(layers[LAYER], x_TD, weights_TX, experts_TX, LIMIT, impl="pallas", path="ragged")
    finally:
        rx._routed_experts_call.clear_cache()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))
    want = rx.routed_experts(layers[LAYER], x_TD, weights_TX, experts_TX, LIMIT)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=4 * 2.0 ** -8 * np.abs(want).max())
