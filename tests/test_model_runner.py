"""The runner's bucket plan: the block-table width follows the step's longest sequence, not max_model_len, and
padding tokens are routed to no expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import dijax.model.moe as moe_module
from dijax.io.loader import load
from dijax.model.moe import moe
from dijax.model.param_map import checkpoint_tree
from dijax.runtime.model_runner import width_bucket


def test_width_follows_the_context_not_the_capacity():
    assert [width_bucket(b, 8192) for b in (1, 2, 4, 5, 16, 17, 33)] == [1, 4, 4, 16, 16, 64, 64]
    assert width_bucket(30, 32) == 32 and width_bucket(3, 2) == 2  # capped by max_model_len's blocks
    # a 4k context in 128-token blocks: 32 blocks under max_model_len 4k, 64 (not 8192) under max_model_len 1M
    assert width_bucket(4096 // 128, 4096 // 128) == 32 and width_bucket(4096 // 128, 2 ** 20 // 128) == 64


def test_padding_tokens_reach_no_expert(monkeypatch):
    cfg, params, _, _ = load(None)
    layer = checkpoint_tree(cfg, params)["layers"][0]["ffn"]
    x_TD = jax.random.normal(jax.random.key(0), (6, cfg.dim), jnp.float32).astype(jnp.bfloat16)
    valid_T = jnp.array([True, True, True, False, False, False])
    seen = {}
    real = moe_module.routed_experts_ep

    def spy(experts, x, weights_TX, experts_TX, limit, **kw):
        seen["experts_TX"] = np.asarray(experts_TX)
        return real(experts, x, weights_TX, experts_TX, limit, **kw)

    monkeypatch.setattr(moe_module, "routed_experts_ep", spy)
    y_masked = moe(layer, x_TD, cfg, valid_T)
    assert (seen["experts_TX"][3:] == -1).all() and (seen["experts_TX"][:3] >= 0).all()
    y_all = moe(layer, x_TD, cfg)
    np.testing.assert_array_equal(np.asarray(y_masked[:3]), np.asarray(y_all[:3]))
