"""Manifold-constrained hyper-connections (v41_spec §8): the residual is C parallel streams.

Letters: T tokens, C hc copies, D model dim, M mix width (2 + C) * C.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dijax.kernels import sinkhorn
from dijax.kernels.numerics import large_step, sum_in_order
from dijax.model.layers import matmul_f32_weight, param


def mixes(x_TCD: jax.Array, fn_MX: jax.Array, scale_3: jax.Array, base_M: jax.Array, hc_mult: int, iters: int,
          hc_eps: float, norm_eps: float, sinkhorn_impl: str = "reference") -> tuple[jax.Array, jax.Array, jax.Array]:
    """``hc_mixes``: one RMS statistic over all C*D values of a token, one fp32 projection (in a ``large_step``
    ``matmul_f32_weight`` of the bf16 streams, equal up to fp32 rounding; else the fp32 GEMM, whose copy is small
    and which needs no kernels to split the weight), then the split into
    (pre [T, C], post [T, C], comb [T, C, C]) float32 (``dijax.kernels.sinkhorn.split``, by ``sinkhorn_impl``).
    With the Sinkhorn kernel, a step ``sinkhorn.fused_mixes`` takes runs all of it as ``sinkhorn.mixes_pallas``."""
    flat = x_TCD.reshape(x_TCD.shape[0], -1)
    if sinkhorn_impl == "pallas" and sinkhorn.fused_mixes(*flat.shape):
        return sinkhorn.mixes_pallas(flat, fn_MX, scale_3, base_M, hc_mult, iters, hc_eps, norm_eps)
    if flat.dtype == jnp.bfloat16 and large_step(flat.shape[0]):
        projection = matmul_f32_weight(flat, fn_MX)
    else:
        projection = sinkhorn.mixes_projection(flat, fn_MX)
    return sinkhorn.split(projection, scale_3, base_M, hc_mult, iters, hc_eps, sinkhorn.sum_squares(flat),
                          flat.shape[1], norm_eps, impl=sinkhorn_impl)


def post(y_TD: jax.Array, residual_TCD: jax.Array, post_TC: jax.Array, comb_TCC: jax.Array) -> jax.Array:
    """Expand a sublayer output: stream k = ``post[k] * y + sum_i comb[i, k] * residual[i]``. -> [T, C, D]."""
    terms = comb_TCC[..., None] * residual_TCD.astype(jnp.float32)[:, :, None, :]
    mixed = sum_in_order(terms, 1, front=sinkhorn.entry_major(y_TD.shape[0]))[:, 0]
    out = post_TC[..., None] * y_TD.astype(jnp.float32)[:, None, :] + mixed
    return out.astype(y_TD.dtype)


class HyperConnection(nnx.Module):
    """The mixing parameters of one sublayer's hyper-connection: fp32 ``fn`` [M, C * D], ``base`` [M], ``scale`` [3]
    (checkpoint ``hc_{attn,ffn}_{fn,base,scale}``)."""

    def __init__(self, dim: int, hc_mult: int, iters: int, hc_eps: float, norm_eps: float,
                 stack: tuple[int, ...] = ()):
        self.hc_mult, self.iters, self.hc_eps, self.norm_eps = hc_mult, iters, hc_eps, norm_eps
        mix = (2 + hc_mult) * hc_mult
        self.fn = param(stack, (mix, hc_mult * dim), jnp.float32, ("hc_mix", "streams_embed"))
        self.base = param(stack, (mix,), jnp.float32, ("hc_mix",))
        self.scale = param(stack, (3,), jnp.float32, ("hc_scale",))

    def __call__(self, x_TCD: jax.Array, sinkhorn_impl: str = "reference") -> tuple[jax.Array, jax.Array, jax.Array]:
        """(pre [T, C], post [T, C], comb [T, C, C]) float32 for the streams x_TCD (see ``mixes``)."""
        return mixes(x_TCD, self.fn[...], self.scale[...], self.base[...], self.hc_mult, self.iters, self.hc_eps,
                     self.norm_eps, sinkhorn_impl)
