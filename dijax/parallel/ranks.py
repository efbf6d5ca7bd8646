"""Attention data parallelism: every device of the mesh is an attention rank that holds and computes only its own
sequences, while the routed experts and Engram rows stay split over the mesh's ``ep`` axis.

There are ``dp * ep`` ranks (all devices of dijax.parallel.mesh.make_mesh's mesh); rank r is the mesh's device r in
row-major order, so its ``ep`` index is r mod ep and its ``dp`` index r // ep. A per-rank array carries a leading
rank axis [R, ...] split over both mesh axes (``RANKS``): each device holds only its rank's block (its own KV blocks
and state slots, its own tokens). The model step runs once per rank under one ``jax.shard_map`` (``over_ranks``):
attention, indexer, compressor and cache writes are local to the rank, and only the MoE and the Engram lookup talk
to other ranks (dijax.parallel.moe / engram, the rank-local token layout: all_gather over ``ep``, run the local
experts / rows, psum_scatter back).

On one device (no mesh) there is no rank axis at all: the runner takes today's one-device path unchanged.

Letters: R attention ranks (the leading axis of per-rank arrays).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

RANK_AXES = ("dp", "ep")
RANKS = PartitionSpec(RANK_AXES)
"""The placement of a per-rank array: its leading rank axis split over every device of the mesh."""


def num_ranks(mesh: Mesh | None) -> int:
    """Attention ranks on ``mesh``: its device count (1 without a mesh)."""
    return 1 if mesh is None else mesh.devices.size


def stack_ranks(make, mesh: Mesh):
    """``make()`` (a pytree of arrays, e.g. an empty cache) with a leading rank axis [R, ...] on ``mesh``, each
    device holding only its rank's copy: built on the devices by one jitted broadcast, never whole on one device."""
    r = num_ranks(mesh)
    return jax.jit(lambda: jax.tree.map(lambda a: jnp.broadcast_to(a, (r,) + a.shape), make()),
                   out_shardings=NamedSharding(mesh, RANKS))()


def over_ranks(fn, mesh: Mesh, in_specs: tuple):
    """``fn`` run once per rank under one ``jax.shard_map`` over ``mesh``.

    ``in_specs``: one per positional argument of ``fn``: ``RANKS`` for an argument whose leaves carry the leading
    rank axis (``fn`` gets its rank's block without that axis), else the argument's own placement (``P()`` for a
    replicated one, dijax.parallel.mesh.param_specs for the parameters: each device its experts and Engram rows).
    Every output leaf of ``fn`` gets the rank axis back: the result is global [R, ...], placed as ``RANKS``.
    """
    split = [isinstance(spec, PartitionSpec) and spec == RANKS for spec in in_specs]

    def per_rank(*args):
        args = [jax.tree.map(lambda a: a[0], arg) if s else arg for arg, s in zip(args, split)]
        return jax.tree.map(lambda a: a[None], fn(*args))

    # check_vma off: the kernel seam (jnp and Pallas) is not annotated for the varying-manual-axes type check
    return jax.shard_map(per_rank, mesh=mesh, in_specs=tuple(in_specs), out_specs=RANKS, check_vma=False)
