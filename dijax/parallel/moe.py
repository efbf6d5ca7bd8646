"""The routed experts under expert parallelism: ``jax.shard_map`` over the mesh's ``ep`` axis.

Each ``ep`` rank holds a contiguous range of ``E / ep`` experts (rank r: ids ``[r * E / ep, (r + 1) * E / ep)``)
and sees every token of the step (activations are replicated on one host, so the all-gather of tokens is free; see
docs/scaling.md for what an all-to-all dispatch would move instead). A rank makes the expert ids local (id - offset;
ids of other ranks become -1, which the kernels treat as padding: zero output, no weights read) and runs the same
``routed_experts`` kernel on its experts.

Combining: every (token, slot) assignment belongs to exactly one rank, so the ranks' per-assignment outputs
(bf16 values, zero on every other rank) are summed with ``psum``: one non-zero term and zeros, which is exact in any
order. Each token's X outputs are then summed in fp32 in expert-id order, exactly as on one device, so the result
is bit-identical to one device for every ``ep``. The cheaper combine (each rank sums its slots, then a ``psum`` of
the fp32 partial sums [T, D]) moves X / 2 times fewer bytes but re-associates the fp32 sum ((y0 + y1) + (y2 + y3)
instead of ((y0 + y1) + y2) + y3), so it is not bit-exact once a token's experts span two ranks; it is kept
(``combine='partial'``) for that comparison and for prefill-sized steps where the bytes matter (docs/scaling.md).

Letters: T tokens, D model dim, X experts per token, A = T * X assignments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dijax.kernels.routed_experts import routed_experts, routed_path

COMBINES = ("exact", "partial")


def expert_mesh():
    """The context mesh (``jax.set_mesh``) when it splits experts (an ``ep`` axis of size > 1), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "ep" not in mesh.axis_names or mesh.shape["ep"] == 1:
        return None
    return mesh


def local_experts(experts_TX: jax.Array, n_local: int) -> jax.Array:
    """This ``ep`` rank's view of the routing (inside ``shard_map``): ids of its experts minus its offset
    ``axis_index('ep') * n_local``, every other id (and padding -1) -> -1. int32 [T, X] -> int32 [T, X]."""
    local_TX = experts_TX - jax.lax.axis_index("ep") * n_local
    mine_TX = (experts_TX >= 0) & (local_TX >= 0) & (local_TX < n_local)
    return jnp.where(mine_TX, local_TX, -1)


def routed_experts_ep(experts: dict, x_TD: jax.Array, weights_TX: jax.Array, experts_TX: jax.Array, limit: float,
                      *, impl: str = "reference", combine: str = "exact") -> jax.Array:
    """``kernels.routed_experts`` with the experts split over the context mesh's ``ep`` axis. -> float32 [T, D].

    Arguments as ``routed_experts``; ``experts``' leaves are the global stacked [E, ...] arrays, placed with their
    expert axis on ``ep`` (dijax.parallel.mesh.place_params). Without an ``ep`` mesh this is ``routed_experts``.
    The kernel's path is the one a single device would take for all E experts (``routed_path``), so the per-
    assignment arithmetic is the same as on one device. ``combine`` (module docstring): 'exact' (bit-identical
    to one device) or 'partial' (X / 2 times fewer bytes, fp32 re-association).
    """
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
    mesh = expert_mesh()
    if mesh is None:
        return routed_experts(experts, x_TD, weights_TX, experts_TX, limit, impl=impl)
    n_experts = experts["w1"]["weight"].shape[0]
    ep = mesh.shape["ep"]
    if n_experts % ep:
        raise ValueError(f"n_routed_experts={n_experts} must be divisible by ep={ep}")
    t, n_per_token = experts_TX.shape
    path = routed_path(t * n_per_token, n_experts)

    def exact(experts_local: dict, x_TD, weights_TX, experts_TX):
        # one assignment per row: the kernel's "sum" over a single slot is that assignment's bf16 output, exactly
        local_A1 = local_experts(experts_TX, n_experts // ep).reshape(-1, 1)
        y_AD = routed_experts(experts_local, jnp.repeat(x_TD, n_per_token, axis=0), weights_TX.reshape(-1, 1),
                              local_A1, limit, impl=impl, path=path)
        return jax.lax.psum(y_AD.astype(jnp.bfloat16), "ep")

    def partial(experts_local: dict, x_TD, weights_TX, experts_TX):
        local_TX = local_experts(experts_TX, n_experts // ep)
        y_TD = routed_experts(experts_local, x_TD, weights_TX, local_TX, limit, impl=impl, path=path)
        return jax.lax.psum(y_TD, "ep")

    specs = (jax.tree.map(lambda _: P("ep"), experts), P(), P(), P())
    # check_vma off: the kernel seam (jnp and Pallas) is not annotated for the varying-manual-axes type check; the
    # psum makes the output replicated, as out_specs P() states
    y = jax.shard_map(exact if combine == "exact" else partial, mesh=mesh, in_specs=specs, out_specs=P(),
                      check_vma=False)(experts, x_TD, weights_TX, experts_TX)
    if combine == "partial":
        return y
    y_TXD = y.reshape(t, n_per_token, -1)
    total_TD = jnp.zeros((t, y_TXD.shape[-1]), jnp.float32)
    for i in range(n_per_token):  # expert-id order in fp32, as the kernels' own slot sum
        total_TD = total_TD + y_TXD[:, i].astype(jnp.float32)
    return total_TD
