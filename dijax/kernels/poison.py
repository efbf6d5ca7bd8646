"""Poisoned kernel outputs, for the tests: a ``pl.pallas_call`` whose output starts NaN-filled, so that an element no
program writes shows up (a kernel's output buffer otherwise starts as whatever the memory held).

The NaN buffer goes in as one more input aliased to the output; the kernel never sees it: it gets the refs it
always gets.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl


def pallas_call(kernel, *args, out_shape: jax.ShapeDtypeStruct, poison: bool, **kwargs) -> jax.Array:
    """``pl.pallas_call(kernel, out_shape=out_shape, **kwargs)(*args)`` (one output); with ``poison`` the output
    starts NaN-filled. ``in_specs``, when given, get the output's ``out_specs`` for the NaN input."""
    if not poison:
        return pl.pallas_call(kernel, out_shape=out_shape, **kwargs)(*args)

    def poisoned(*refs):
        kernel(*refs[:-2], refs[-1])  # refs[-2] is the NaN input: the same buffer as the output, refs[-1]

    if "in_specs" in kwargs:
        kwargs["in_specs"] = [*kwargs["in_specs"], kwargs["out_specs"]]
    return pl.pallas_call(poisoned, out_shape=out_shape, input_output_aliases={len(args): 0}, **kwargs)(
        *args, jnp.full(out_shape.shape, np.nan, out_shape.dtype))
