"""The router's selection (dijax.kernels.router): the Pallas kernel, interpreted, against the reference: the same
experts (ties included) and the same weights bit for bit; the network sort; the dispatcher."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dijax.kernels import router

pytestmark = pytest.mark.cost(2)  # CI seconds, a scheduling hint (tests/conftest.py)


def _scores(t: int, e: int, seed: int) -> tuple[jax.Array, jax.Array]:
    """Non-negative scores (as sqrt(softplus) gives) and a selection-only bias."""
    key1, key2 = jax.random.split(jax.random.key(seed))
    scores = jnp.sqrt(jax.nn.softplus(jax.random.normal(key1, (t, e), jnp.float32) * 2))
    return scores, jax.random.normal(key2, (e,), jnp.float32) * 0.1


def _assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("t, e, x, normalize, config", [
    (1, 384, 6, True, router.RouterConfig()), (17, 384, 6, True, router.RouterConfig()),
    (17, 384, 6, True, router.RouterConfig(block_tokens=16, warps=4)),
    (40, 8, 2, True, router.RouterConfig(block_tokens=4, warps=2)), (5, 64, 6, False, router.RouterConfig()),
    (3, 10, 1, True, router.RouterConfig(block_tokens=2))])
def test_kernel_is_the_reference(t, e, x, normalize, config):
    """Token counts across blocks of several tilings, expert counts that are not powers of two, X = 1 (no
    renormalisation)."""
    scores, bias = _scores(t, e, seed=t + e)
    args = (scores, bias, x, normalize, 2.5)
    got = router.route_pallas(*args, interpret=True, config=config)
    _assert_same(got, router.route_reference(*args))
    experts = np.asarray(got[1])
    assert np.all(np.diff(experts, axis=1) > 0) and experts.min() >= 0 and experts.max() < e


@pytest.mark.parametrize("config", [router.RouterConfig(), router.RouterConfig(block_tokens=4, warps=2)])
def test_padding_tokens_route_to_no_expert(config):
    """``valid_T`` False: every expert id -1 (the routed experts read nothing for the token); the other tokens and
    every weight as without the mask."""
    scores, bias = _scores(7, 64, seed=3)
    valid = jnp.array([True, False, True, True, False, False, True])
    args = (scores, bias, 6, True, 2.5)
    got = router.route_pallas(*args, valid, interpret=True, config=config)
    _assert_same(got, router.route_reference(*args, valid))
    unmasked = router.route_reference(*args)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(unmasked[0]))
    experts = np.asarray(got[1])
    assert np.all(experts[~np.asarray(valid)] == -1)
    np.testing.assert_array_equal(experts[np.asarray(valid)], np.asarray(unmasked[1])[np.asarray(valid)])


def test_ties_pick_the_lowest_ids_as_top_k_does():
    """Equal selection keys: lax.top_k takes the lower index first, and so does the kernel; the weights come from
    the unbiased scores, not the keys."""
    scores = jnp.array([[1.0, 3.0, 3.0, 2.0, 3.0, 0.5, 3.0, 1.0],
                        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], jnp.float32)
    bias = jnp.array([0.5, 0, 0, 1.0, 0, 0, 0, 0], jnp.float32)  # key of expert 3 is 3.0 too, of expert 0 1.5
    got = router.route_pallas(scores, bias, 3, True, 1.0, interpret=True)
    _assert_same(got, router.route_reference(scores, bias, 3, True, 1.0))
    np.testing.assert_array_equal(np.asarray(got[1]), [[1, 2, 3], [0, 1, 3]])  # row 1: bias breaks the tie


def test_no_tokens_and_the_dispatcher():
    weights, experts = router.route_pallas(jnp.zeros((0, 16)), jnp.zeros(16), 4, True, 1.0, interpret=True)
    assert weights.shape == (0, 4) and experts.shape == (0, 4) and experts.dtype == jnp.int32
    scores, bias = _scores(4, 16, seed=0)
    _assert_same(router.route(scores, bias, 4, True, 1.0, impl="pallas"),
                 router.route(scores, bias, 4, True, 1.0, impl="reference"))
    with pytest.raises(ValueError, match="router impl must be one of"):
        router.route(scores, bias, 4, True, 1.0, impl="triton")


def test_bad_tilings_are_refused():
    with pytest.raises(ValueError, match="block_tokens must be a power of two"):
        router.RouterConfig(block_tokens=3)
    with pytest.raises(ValueError, match="warps must be one of"):
        router.RouterConfig(warps=3)


@pytest.mark.parametrize("width", [1, 2, 5, 6, 8])
def test_ascending_is_a_sort_of_each_row(width):
    """The gate's sorting network orders each row as ``jnp.sort`` does: distinct ids (the top-k's case), repeated
    ids and the int32 extremes."""
    rng = np.random.default_rng(width)
    distinct = np.stack([rng.permutation(384)[:width] for _ in range(64)]).astype(np.int32)
    repeated = rng.integers(0, 3, (64, width)).astype(np.int32)
    extremes = rng.choice(np.array([np.iinfo(np.int32).min, -1, 0, np.iinfo(np.int32).max], np.int32), (64, width))
    for ids in (distinct, repeated, extremes):
        np.testing.assert_array_equal(np.asarray(jax.jit(router.ascending)(ids)), np.sort(ids, axis=-1))
