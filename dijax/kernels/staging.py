"""Staging of a step's per-call inputs: one copy into the step's own scratch memory before any other kernel reads it.

Why a copy: on the GPU, XLA records a compiled step's kernels into CUDA graphs (command buffers) once and replays
them; a kernel node holds raw device pointers. When an argument of the step arrives in a buffer at another address
than last time, XLA updates every recorded node that points into it before the replay (host work on the launch
path). A step's host inputs (the packed batch, the ZOS remap) are transferred into fresh buffers each call. With
one step at a time the allocator hands back the buffer the last step freed, so the addresses repeat; with ZOS the
previous step is still running and holds its inputs, the addresses alternate, and the dozens of nodes reading the
batch (positions, slots, block tables in every layer) get updated on every step. Staged, only the copy's node
points at the argument; everything else reads the copy, which lives in the step's scratch allocation.
(The mechanism is XLA's ``CommandBufferThunk``, read in its source; the copy being the argument's only reader is
checked on the GPU by tests/gpu/test_staging_gpu.py. With it the tiny engine's ZOS decode step came within 3 % of
the device-only step, docs/benchmarks.md, sixth session; that row does not separate staging from the other changes
made since the last ZOS row.)

``stage(x, impl=)``: 'reference' returns ``x`` (XLA elides any copy it could see through, and off the GPU there is
no graph to protect), 'pallas' copies it in a Triton-lowered ``pl.pallas_call`` XLA cannot elide.

Letters: N elements.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dijax.kernels import interpret_mode

IMPLS = ("reference", "pallas")
BLOCK = 128  # elements per program; arrays are staged in whole blocks (callers pad their packed inputs to it)


def stage_reference(x_N: jax.Array) -> jax.Array:
    """The staged array: ``x_N`` itself. [N] -> [N], same dtype."""
    return x_N


def _copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def stage_pallas(x_N: jax.Array, interpret: bool = False) -> jax.Array:
    """``x_N`` copied by a kernel into a buffer of the calling step's own. [N] -> [N]; N a multiple of ``BLOCK``, or
    a power of two below it."""
    (n,) = x_N.shape
    block = n if n < BLOCK else BLOCK
    if n % block or block & (block - 1):
        raise ValueError(f"staged arrays have a multiple of {BLOCK} elements or a power of two below it, got {n}")
    spec = pl.BlockSpec((block,), lambda i: (i,))
    return pl.pallas_call(_copy_kernel, grid=(n // block,), in_specs=[spec], out_specs=spec,
                          out_shape=jax.ShapeDtypeStruct(x_N.shape, x_N.dtype), interpret=interpret, name="stage",
                          compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1))(x_N)


def stage(x_N: jax.Array, *, impl: str = "reference") -> jax.Array:
    """Dispatch to the implementation ``impl`` (one of IMPLS). [N] -> [N]."""
    if impl == "reference":
        return stage_reference(x_N)
    if impl == "pallas":
        return stage_pallas(x_N, interpret=interpret_mode())
    raise ValueError(f"stage impl must be one of {IMPLS}, got {impl!r}")


def padded_size(n: int) -> int:
    """The staged length of an array of ``n`` elements: a power of two below ``BLOCK``, else whole blocks."""
    if n <= BLOCK:
        return max(1, 1 << (n - 1).bit_length())
    return -(-n // BLOCK) * BLOCK


def pad_for_staging(x_N: np.ndarray, fill: int = 0) -> np.ndarray:
    """A host (numpy) array padded at the end with ``fill`` to ``padded_size``. [N] -> [padded_size(N)]."""
    pad = padded_size(x_N.shape[0]) - x_N.shape[0]
    return np.pad(x_N, (0, pad), constant_values=fill) if pad else x_N
