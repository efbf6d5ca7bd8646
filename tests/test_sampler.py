"""Device sampling: greedy ties, top-k / top-p limits, and noise keyed only by (seed, output position)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dijax.runtime.sampler import sample


def _sample(logits, temperature=1.0, top_k=0, top_p=1.0, seeds=None, positions=None):
    r = logits.shape[0]
    seeds = np.arange(r, dtype=np.uint32) if seeds is None else np.asarray(seeds, np.uint32)
    positions = np.zeros(r, np.int32) if positions is None else np.asarray(positions, np.int32)
    return np.asarray(sample(jnp.asarray(logits, jnp.float32), jnp.full(r, temperature, jnp.float32),
                             jnp.full(r, top_k, jnp.int32), jnp.full(r, top_p, jnp.float32), jnp.asarray(seeds),
                             jnp.asarray(positions)))


def test_greedy_takes_the_lowest_index_among_ties():
    logits = np.array([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0]], np.float32)
    assert _sample(logits, temperature=0.0).tolist() == [1, 0]


def test_noise_depends_only_on_seed_and_position():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1, (6, 64)).astype(np.float32)
    seeds, positions = np.arange(6) * 7 + 1, np.arange(6) % 3
    full = _sample(logits, seeds=seeds, positions=positions)
    reverse = _sample(logits[::-1], seeds=seeds[::-1], positions=positions[::-1])[::-1]
    single = np.array([_sample(logits[i:i + 1], seeds=seeds[i:i + 1], positions=positions[i:i + 1])[0]
                       for i in range(6)])
    assert np.array_equal(full, reverse) and np.array_equal(full, single)
    # and it does change with the position: a flat distribution is not sampled to one token
    flat = np.zeros((64, 32), np.float32)
    drawn = _sample(flat, seeds=np.full(64, 5), positions=np.arange(64))
    assert len(set(drawn.tolist())) > 10


def test_top_k_and_top_p_restrict_the_support():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 1, (1, 50)).astype(np.float32)
    order = np.argsort(-logits[0])
    for position in range(40):
        assert _sample(logits, top_k=3, positions=[position])[0] in order[:3]
        assert _sample(logits, top_k=1, positions=[position])[0] == order[0]
        assert _sample(logits, top_p=1e-6, positions=[position])[0] == order[0]
    probs = np.exp(logits[0] - logits[0].max()); probs /= probs.sum()
    nucleus = order[:np.searchsorted(np.cumsum(probs[order]), 0.5) + 1]
    drawn = {_sample(logits, top_p=0.5, positions=[p])[0] for p in range(200)}
    assert drawn <= set(nucleus.tolist()) and len(drawn) > 1
