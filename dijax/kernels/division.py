"""Float32 arithmetic with the reference's rounding inside Triton-lowered Pallas kernels.

Triton lowers ``x / y`` in float32 to the approximate ``div.full.f32``; the reference (and XLA) divide with correct
rounding. PTX's ``div.rn.f32`` is correct: ``div_rn`` emits it as inline assembly (ptxas wraps it in a branch to a
slow path for operands outside its fast range, which serialises a warp where it is taken; dijax.kernels.sinkhorn
has a branch-free form for its many divisions). Interpreted kernels (CPU tests) divide with ``/``, which is
IEEE-rounded there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import triton as pltriton


def asm_f32(code: str, *args: jax.Array) -> jax.Array:
    """One float32 result per element from the PTX ``code`` ($0 the result, $1.. the float32 ``args``)."""
    [out] = pltriton.elementwise_inline_asm(code, args=list(args), constraints="=r" + ",r" * len(args), pack=1,
                                            result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)])
    return out


def div_rn(x: jax.Array, y: jax.Array, interpret: bool = False) -> jax.Array:
    """Correctly rounded float32 ``x / y`` inside a Triton kernel (``div.rn.f32``), x and y of one shape; in an
    interpreted kernel (``interpret``) ``/``, which is IEEE-rounded there."""
    return x / y if interpret else asm_f32("div.rn.f32 $0, $1, $2;", x, y)


def rms_factor_rn(squares: jax.Array, width: int, eps: float, interpret: bool = False) -> jax.Array:
    """``numerics.rms_factor`` inside a kernel (the mean a correctly rounded division, ``div.rn.f32``)."""
    mean = div_rn(squares, jnp.full(squares.shape, width, jnp.float32), interpret)
    return lax.rsqrt(mean + np.float32(eps))
