"""One layer's weight read in place from the stacked weights of several layers: ``LayerSlice``.

The model stacks the parameters of like layers and runs them under ``lax.scan`` (dijax.model.plan). Slicing a
layer's weight out of the stack inside the scan body is a copy whenever the slice feeds a custom call (every
Pallas kernel) or a loop (a scanned run inside a scanned period): XLA hands a kernel its own buffer. For the
real V4.1-Flash config that copied every layer's weights on every step (about 7 GB per layer of MXFP4 experts,
and 42 GB of temporaries for the largest period, docs/benchmarks.md, seventh session). A ``LayerSlice`` instead
carries the whole stack and the layer's index; a kernel reads the layer's rows through the index (an offset into
the flattened stack), and a jnp reference takes ``get()``, a dynamic slice XLA fuses into its consumer.

Letters: L the stacked layers flattened (period x layer), then the weight's own dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class LayerSlice:
    """Layer ``index`` of ``stack``: stack [*lead, *shape] with ``ndim`` trailing weight dims, index int32 scalar
    into the flattened leading dims (row-major: repeat i, layer j of a [R, L, ...] stack is i * L + j)."""

    stack: jax.Array
    index: jax.Array
    ndim: int = 0  # trailing dims of one layer's weight (static)

    @property
    def shape(self) -> tuple[int, ...]:
        """One layer's shape."""
        return tuple(self.stack.shape[self.stack.ndim - self.ndim:])

    @property
    def dtype(self):
        return self.stack.dtype

    def flat(self) -> jax.Array:
        """The stack with its leading dims flattened: [L, *shape]."""
        return self.stack.reshape(-1, *self.shape)

    def get(self) -> jax.Array:
        """The layer's weight [*shape] (a dynamic slice: a copy unless XLA fuses it into the consumer)."""
        return jax.lax.dynamic_index_in_dim(self.flat(), self.index, keepdims=False)


jax.tree_util.register_dataclass(LayerSlice, data_fields=["stack", "index"], meta_fields=["ndim"])


def of_layer(stack: jax.Array, index: jax.Array | int, ndim: int) -> LayerSlice:
    """``LayerSlice`` of ``stack``'s layer ``index`` (flat over the leading dims), whose weight has ``ndim`` dims."""
    return LayerSlice(stack, jnp.asarray(index, jnp.int32), ndim)


def materialize(weight: jax.Array | LayerSlice) -> jax.Array:
    """The layer's weight as an array (``get()``), or ``weight`` itself when it is one."""
    return weight.get() if isinstance(weight, LayerSlice) else weight


def offsets_fit(size: int, itemsize: int) -> bool:
    """Whether a Triton-lowered kernel can address every element of an array of ``size`` elements of ``itemsize``
    bytes: Pallas' Triton lowering computes offsets in int32 for arrays of at most 2^32 bytes and in int64 beyond,
    so 2^31 or more elements in at most 2^32 bytes (1-byte elements) would wrap."""
    return size < 2 ** 31 or size * itemsize > 2 ** 32


def in_place(weights: list[jax.Array | LayerSlice]) -> tuple[list[jax.Array], jax.Array]:
    """([stack [L, *shape] of each weight], index int32 []): the stacks a kernel reads one layer's ``weights``
    from through one index. ``LayerSlice``s (of one layer, so of one index) are read in place; plain weights, or any
    stack the kernel could not address (``offsets_fit``), make every weight a stack of one, sliced (a copy)."""
    if all(isinstance(w, LayerSlice) and offsets_fit(w.stack.size, w.dtype.itemsize) for w in weights):
        return [w.flat() for w in weights], weights[0].index
    return [materialize(w)[None] for w in weights], jnp.zeros((), jnp.int32)
