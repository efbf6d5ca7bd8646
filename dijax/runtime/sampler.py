"""Sampling on device: greedy, temperature, top-k, top-p, with noise keyed only by (request seed, output position).

The noise of a row is ``gumbel(fold_in(key(seed), position))``: it does not depend on the batch row, the batch
size or any global RNG history, so a recomputed (preempted) request draws the same tokens (DESIGN.md promise 3).

Letters: R rows to sample, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _one(logits_V, temperature, top_k, top_p, seed, position):
    greedy = jnp.argmax(logits_V).astype(jnp.int32)  # lowest index wins ties
    scaled = logits_V.astype(jnp.float32) / jnp.maximum(temperature, 1e-5)
    ordered = jnp.sort(scaled)[::-1]
    kth = ordered[jnp.clip(top_k - 1, 0, logits_V.shape[0] - 1)]
    scaled = jnp.where((top_k > 0) & (scaled < kth), -jnp.inf, scaled)
    probs_sorted = jax.nn.softmax(jnp.sort(scaled)[::-1])
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    keep_sorted = (jnp.cumsum(probs_sorted) - probs_sorted) < top_p
    threshold = jnp.min(jnp.where(keep_sorted, jnp.sort(scaled)[::-1], jnp.inf))
    scaled = jnp.where(scaled < threshold, -jnp.inf, scaled)
    key = jax.random.fold_in(jax.random.key(seed), position)
    noisy = scaled + jax.random.gumbel(key, scaled.shape, jnp.float32)
    sampled = jnp.argmax(noisy).astype(jnp.int32)
    return jnp.where(temperature == 0, greedy, sampled)


@jax.jit
def sample(logits_RV: jax.Array, temperature_R: jax.Array, top_k_R: jax.Array, top_p_R: jax.Array,
           seed_R: jax.Array, position_R: jax.Array) -> jax.Array:
    """One token per row. temperature float32 (0 = greedy), top_k int32 (0 = off), top_p float32 in (0, 1],
    seed uint32, position int32 (index of the token in the request's output). -> int32 [R]."""
    return jax.vmap(_one)(logits_RV, temperature_R, top_k_R, top_p_R, seed_R, position_R)
