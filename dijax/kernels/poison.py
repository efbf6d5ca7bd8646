"""Poisoned kernel outputs, for the tests: a ``pl.pallas_call`` whose outputs start NaN-filled, so that an element no
program writes shows up (a kernel's output buffer otherwise starts as whatever the memory held).

Each NaN buffer goes in as one more input aliased to its output; the kernel never sees them: it gets the refs it
always gets.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl


def pallas_call(kernel, *args, out_shape, poison: bool, **kwargs) -> jax.Array | tuple[jax.Array, ...]:
    """``pl.pallas_call(kernel, out_shape=out_shape, **kwargs)(*args)`` (one output, or a tuple of them); with
    ``poison`` every output starts NaN-filled. ``in_specs``, when given, get the outputs' ``out_specs`` for the NaN
    inputs."""
    if not poison:
        return pl.pallas_call(kernel, out_shape=out_shape, **kwargs)(*args)
    shapes = out_shape if isinstance(out_shape, tuple) else (out_shape,)

    def poisoned(*refs):  # refs: args, the NaN inputs (the outputs' buffers), the outputs
        kernel(*refs[:len(args)], *refs[len(args) + len(shapes):])

    if "in_specs" in kwargs:
        specs = kwargs["out_specs"] if isinstance(out_shape, tuple) else (kwargs["out_specs"],)
        kwargs["in_specs"] = [*kwargs["in_specs"], *specs]
    aliases = {len(args) + i: i for i in range(len(shapes))}
    return pl.pallas_call(poisoned, out_shape=out_shape, input_output_aliases=aliases, **kwargs)(
        *args, *(jnp.full(s.shape, np.nan, s.dtype) for s in shapes))
