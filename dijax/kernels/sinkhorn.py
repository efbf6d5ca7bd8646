"""The Sinkhorn rounds of the hyper-connection mix (v41_spec §8): alternate row and column normalisation of each
token's C x C matrix, every division by (sum + eps), sums taken strictly left to right (the reference's order).

Two implementations behind ``sinkhorn(..., impl=)``:
  * ``"reference"``: jnp, a ``fori_loop`` over the rounds. On a GPU each round is its own kernel launch, so the
    (iters - 1) rounds x 2 sublayers x every layer dominate a small model's step (the tiny default: ~680 of its ~690
    kernels, measured on an H200, docs/benchmarks.md);
  * ``"pallas"``: one Triton-lowered Pallas kernel for all rounds. Each program holds BLOCK_T tokens; the C * C
    entries of a token live in C * C registers vectors (the matrix is transposed to [C * C, T] outside), so a row or
    column sum is C - 1 vector adds in the reference's order. Triton lowers ``x / y`` in float32 to the approximate
    ``div.full.f32``; the kernel divides with ``div.rn.f32`` (inline PTX), the correctly rounded division XLA and the
    reference use, so both implementations give the same bits. Interpret mode (CPU tests) divides with ``/``, which
    is IEEE-rounded there.

Letters: T tokens, C hc copies, K = C * C matrix entries.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dijax.kernels import interpret_mode
from dijax.kernels.numerics import divide, sum_in_order

BLOCK_T = 128
IMPLS = ("reference", "pallas")


def sinkhorn_reference(comb_TCC: jax.Array, rounds: int, eps: float) -> jax.Array:
    """``rounds`` rounds of (row, column) normalisation. comb_TCC: float32 [T, C, C] -> float32 [T, C, C]."""
    eps = np.float32(eps)

    def row_then_column(_, comb):
        comb = divide(comb, sum_in_order(comb, -1) + eps)
        return divide(comb, sum_in_order(comb, -2) + eps)

    return jax.lax.fori_loop(0, rounds, row_then_column, comb_TCC)


def _exact_divide(x: jax.Array, y: jax.Array) -> jax.Array:
    """Correctly rounded float32 division inside a Triton kernel (Triton's own ``/`` is ``div.full.f32``)."""
    [out] = pltriton.elementwise_inline_asm("div.rn.f32 $0, $1, $2;", args=[x, y], constraints="=r,r,r", pack=1,
                                            result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
    return out


def _sinkhorn_kernel(comb_ref, out_ref, *, c: int, rounds: int, eps: float, div):
    m = [[comb_ref[i * c + j, :] for j in range(c)] for i in range(c)]  # m[i][j]: [BLOCK_T] float32
    eps = np.float32(eps)
    for _ in range(rounds):
        for i in range(c):
            row = functools.reduce(lambda a, b: a + b, m[i]) + eps
            m[i] = [div(m[i][j], row) for j in range(c)]
        for j in range(c):
            column = functools.reduce(lambda a, b: a + b, [m[i][j] for i in range(c)]) + eps
            for i in range(c):
                m[i][j] = div(m[i][j], column)
    for i in range(c):
        for j in range(c):
            out_ref[i * c + j, :] = m[i][j]


@functools.partial(jax.jit, static_argnames=("rounds", "eps", "interpret"))
def sinkhorn_pallas(comb_TCC: jax.Array, rounds: int, eps: float, interpret: bool | None = None) -> jax.Array:
    """Same contract as ``sinkhorn_reference``, one kernel launch. comb_TCC: float32 [T, C, C]. ``interpret``: run
    the kernel interpreted (default: off a GPU). Jitted, as every kernel's entry point: a step makes this call twice
    per layer with one shape, and the jit cache traces and lowers the kernel once per step shape."""
    interpret = interpret_mode(interpret)
    t, c, _ = comb_TCC.shape
    k = c * c
    padded = -(-t // BLOCK_T) * BLOCK_T
    comb_KT = jnp.pad(comb_TCC.reshape(t, k).T, ((0, 0), (0, padded - t)), constant_values=1.0)
    kernel = functools.partial(_sinkhorn_kernel, c=c, rounds=rounds, eps=eps,
                               div=(lambda x, y: x / y) if interpret else _exact_divide)
    spec = pl.BlockSpec((k, BLOCK_T), lambda i: (0, i))
    out_KT = pl.pallas_call(kernel, grid=(padded // BLOCK_T,), in_specs=[spec], out_specs=spec,
                            out_shape=jax.ShapeDtypeStruct((k, padded), jnp.float32), interpret=interpret,
                            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))(comb_KT)
    return out_KT[:, :t].T.reshape(t, c, c)


def sinkhorn(comb_TCC: jax.Array, rounds: int, eps: float, *, impl: str = "reference") -> jax.Array:
    """Dispatch to the implementation ``impl`` (one of IMPLS). float32 [T, C, C] -> float32 [T, C, C]."""
    if impl == "reference":
        return sinkhorn_reference(comb_TCC, rounds, eps)
    if impl == "pallas":
        return sinkhorn_pallas(comb_TCC, rounds, eps)
    raise ValueError(f"sinkhorn impl must be one of {IMPLS}, got {impl!r}")
