"""model.attention.attend_lists: the Pallas kernel's sources (in a large step the window rows as one, the lane where
the pool starts a token; else the reference's three) against the reference, over the same lists (window part of
width_T lanes, then the compressed part). ``large`` moves the large-step threshold below the tests' 5 tokens."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import dijax  # noqa: F401  (sets XLA flags before JAX starts)
from dijax.kernels.sparse_attn import sparse_attn, sparse_attn_pallas
from dijax.kernels import numerics
from dijax.model import attention
from dijax.model.attention import attend_lists

H, K, W = 16, 64, 16


def lists(seed: int, with_pool: bool):
    rng = np.random.default_rng(seed)
    t, ring, pool = 5, 2 * W, 90
    q = jnp.asarray(rng.standard_normal((t, H, K)), jnp.bfloat16)
    ring_RK, kv_TK, pool_NK = (jnp.asarray(rng.standard_normal((n, K)) * 2, jnp.bfloat16) for n in (ring, t, pool))
    width_T = np.array([3, W, W, 7, 0], np.int32)  # short prefills' windows, full windows, an empty one
    win = rng.integers(0, ring + t, (t, W)).astype(np.int32)
    # lanes from width_T on hold stale indices: attend_lists must not read them
    comp = (ring + t + rng.integers(0, pool, (t, 40))).astype(np.int32)
    comp[rng.random(comp.shape) < 0.3] = -1
    comp[2] = -1  # a query with window rows only
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    return (q, ring_RK, kv_TK, pool_NK if with_pool else None, jnp.asarray(win), jnp.asarray(width_T),
            jnp.asarray(comp) if with_pool else None, sink, K ** -0.5)


@pytest.fixture(params=[True, False], ids=["large", "small"])
def large(request, monkeypatch):
    if request.param:
        monkeypatch.setattr(numerics, "LARGE_STEP_TOKENS", 1)
    return request.param


@pytest.mark.parametrize("with_pool", [True, False])
def test_kernel_layout_attends_to_the_same_rows(with_pool, large):
    args = lists(seed=int(with_pool), with_pool=with_pool)
    want = np.asarray(attend_lists(*args, impl="reference"), np.float32)
    got = np.asarray(attend_lists(*args, impl="pallas"), np.float32)
    assert (got[4] == 0).all() == (not with_pool)  # no window rows, and no compressed rows without a pool
    np.testing.assert_allclose(got, want, atol=4e-3, rtol=2e-2)
    assert np.abs(got - want).mean() < 2e-3 * np.abs(want).mean()


@pytest.mark.parametrize("with_pool", [True, False])
def test_kernel_walks_the_reference_blocks(with_pool, large, monkeypatch):
    # the list the reference walks, written out lane by lane: the window part, then the compressed part. The kernel
    # over attend_lists' two sources gives the bits of the general walk over the three (the same 64-lane blocks,
    # so P is rounded against the same running maxima), and the lanes from width_T on are never read
    q, ring_RK, kv_TK, pool_NK, win, width_T, comp, sink, scale = lists(seed=5, with_pool=with_pool)
    win, width, comp = np.asarray(win), np.asarray(width_T), None if comp is None else np.asarray(comp)
    n = 0 if comp is None else comp.shape[1]
    idx = np.full((len(width), W + n), -1, np.int32)
    for t, w in enumerate(width):
        idx[t, :w] = win[t, :w]
        idx[t, w:w + n] = comp[t] if n else []
    sources = (ring_RK, kv_TK) + ((pool_NK,) if with_pool else ())
    general = np.asarray(sparse_attn_pallas(q, sources, jnp.asarray(idx), sink, scale), np.float32)
    stale = np.where(np.arange(W)[None, :] < width[:, None], win, 10 ** 6)  # out of range if ever read
    comp_idx = None if comp is None else jnp.asarray(comp)
    calls = []
    monkeypatch.setattr(attention, "sparse_attn", lambda q, srcs, *a, **kw: calls.append((len(srcs), kw)) or
                        sparse_attn(q, srcs, *a, **kw))
    got = attend_lists(q, ring_RK, kv_TK, pool_NK, jnp.asarray(stale), width_T, comp_idx, sink, scale, impl="pallas")
    np.testing.assert_array_equal(np.asarray(got, np.float32), general)
    [(num_sources, kwargs)] = calls  # one source for the window rows in a large step
    assert num_sources == len(sources) - large and ("first_T" in kwargs) == (large and with_pool)
