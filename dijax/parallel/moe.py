"""The routed experts under expert parallelism: each ``ep`` rank runs its own experts on every token of its group.

Each ``ep`` rank holds a contiguous range of ``E / ep`` experts (rank r: ids ``[r * E / ep, (r + 1) * E / ep)``).
A rank makes the expert ids local (id - offset; ids of other ranks become -1, which the kernels treat as padding:
zero output, no weights read) and runs the same ``routed_experts`` kernel on its experts, over the tokens of every
``ep`` rank. Two ways the tokens reach it (``token_layout``):

* ``replicated`` (a context mesh, called outside any ``shard_map``: the teacher-forced step, and the engine with
  attention data parallelism off): every rank already sees every token of the step; ``routed_experts_ep`` wraps
  its work in a ``jax.shard_map`` over ``ep`` and the combine is a ``psum``, after which every rank holds the
  result of every token.
* ``rank-local`` (inside the attention-DP step's ``shard_map``, which is manual over ``ep``,
  dijax.parallel.ranks): each rank holds only its own sequences' tokens and only its experts' slice of the
  weights. The tokens (bf16 x, the routing weights, the expert ids) are ``all_gather``ed over ``ep``, the local
  experts run on them, and the combine is a ``psum_scatter`` over ``ep`` (tiled): each rank receives the outputs of
  its own tokens only. With ``dp`` > 1 the gather and scatter stay inside the ``ep`` group of the rank.

Combining: every (token, slot) assignment belongs to exactly one rank, so the ranks' per-assignment outputs (bf16
values, zero on every other rank) are summed with ``psum`` / ``psum_scatter``: one non-zero term and zeros, which is
exact in any order. Each token's X outputs are then summed in fp32 in expert-id order, exactly as on one device, so
the result is bit-identical to one device for every ``ep`` and both layouts (measured with the reference kernels,
whose gathered and ragged paths agree bit for bit: the rank-local layout hands the kernel the ``ep`` group's tokens,
and the path is chosen from those; docs/scaling.md, "Bit-exactness"). The cheaper combine (each rank sums its slots,
then a ``psum`` / ``psum_scatter`` of the fp32 partial sums [T, D]) moves X / 2 times fewer bytes but re-associates
the fp32 sum ((y0 + y1) + (y2 + y3) instead of ((y0 + y1) + y2) + y3), so it is not bit-exact once a token's experts
span two ranks; it is kept (``combine='partial'``) for that comparison and for prefill-sized steps where the bytes
matter (docs/scaling.md).

Letters: T tokens, D model dim, X experts per token, A = T * X assignments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dijax.kernels.routed_experts import routed_experts, routed_path
from dijax.kernels.stacked import LayerSlice

COMBINES = ("exact", "partial")
LAYOUTS = ("replicated", "rank-local")


def expert_mesh():
    """The context mesh (``jax.set_mesh``) when it splits experts (an ``ep`` axis of size > 1), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "ep" not in mesh.axis_names or mesh.shape["ep"] == 1:
        return None
    return mesh


def token_layout(mesh) -> str:
    """How the tokens of a step sit on ``mesh`` (an ``expert_mesh``), one of ``LAYOUTS``: 'rank-local' inside a
    ``shard_map`` that is manual over ``ep`` (each rank its own tokens, parameters already split), else
    'replicated' (every rank every token, global parameters)."""
    return "rank-local" if "ep" in mesh.manual_axes else "replicated"


def local_experts(experts_TX: jax.Array, n_local: int) -> jax.Array:
    """This ``ep`` rank's view of the routing (inside ``shard_map``): ids of its experts minus its offset
    ``axis_index('ep') * n_local``, every other id (and padding -1) -> -1. int32 [T, X] -> int32 [T, X]."""
    local_TX = experts_TX - jax.lax.axis_index("ep") * n_local
    mine_TX = (experts_TX >= 0) & (local_TX >= 0) & (local_TX < n_local)
    return jnp.where(mine_TX, local_TX, -1)


def gather_tokens(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Inside a ``shard_map`` manual over ``ep``: each [T, ...] array concatenated over the ``ep`` ranks in rank
    order -> [ep * T, ...] (rank r's tokens at rows [r T, (r + 1) T))."""
    return tuple(jax.lax.all_gather(a, "ep", tiled=True) for a in arrays)


def scatter_tokens(y: jax.Array) -> jax.Array:
    """The inverse of ``gather_tokens`` for per-rank partial results: [ep * n, ...] summed over the ``ep`` ranks,
    rank r keeping rows [r n, (r + 1) n) -> [n, ...]."""
    return jax.lax.psum_scatter(y, "ep", scatter_dimension=0, tiled=True)


def sum_slots(y_AD: jax.Array, n_per_token: int) -> jax.Array:
    """Each token's X per-assignment outputs (bf16 [T * X, D], slot order) summed in fp32 in slot (expert-id)
    order, as the kernels' own slot sum. -> float32 [T, D]."""
    y_TXD = y_AD.reshape(-1, n_per_token, y_AD.shape[-1])
    total_TD = jnp.zeros((y_TXD.shape[0], y_TXD.shape[-1]), jnp.float32)
    for i in range(n_per_token):
        total_TD = total_TD + y_TXD[:, i].astype(jnp.float32)
    return total_TD


def expert_specs(experts: dict) -> dict:
    """``shard_map`` specs of the routed experts' leaves, their expert axis on ``ep``: [E, ...] arrays, or
    ``LayerSlice``s of a stack of layers (expert axis after the stack's leading axes; the layer index replicated)."""
    def spec(leaf):
        if isinstance(leaf, LayerSlice):
            return LayerSlice(P(*[None] * (leaf.stack.ndim - leaf.ndim), "ep"), P(), leaf.ndim)
        return P("ep")

    return jax.tree.map(spec, experts, is_leaf=lambda leaf: isinstance(leaf, LayerSlice))


def routed_experts_ep(experts: dict, x_TD: jax.Array, weights_TX: jax.Array, experts_TX: jax.Array, limit: float,
                      *, impl: str = "reference", combine: str = "exact") -> jax.Array:
    """``kernels.routed_experts`` with the experts split over the context mesh's ``ep`` axis. -> float32 [T, D].

    Arguments as ``routed_experts``. ``experts``' leaves: in the replicated layout (module
    docstring) the global stacked [E, ...] arrays, placed with their expert axis on ``ep``
    (dijax.parallel.mesh.place_params); in the rank-local layout this rank's [E / ep, ...] slice. Without an ``ep``
    mesh this is ``routed_experts``. The kernel's path is the one a single device would take for all E experts on
    the tokens the kernel sees (``routed_path``), so the per-assignment arithmetic is the same as on one device.
    ``combine`` (module docstring): 'exact' (bit-identical to one device) or 'partial' (X / 2 times fewer bytes, fp32
    re-association).
    """
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
    mesh = expert_mesh()
    if mesh is None:
        return routed_experts(experts, x_TD, weights_TX, experts_TX, limit, impl=impl)
    ep = mesh.shape["ep"]
    layout = token_layout(mesh)
    n_held = experts["w1"]["weight"].shape[0]
    n_experts = n_held * ep if layout == "rank-local" else n_held
    if n_experts % ep:
        raise ValueError(f"n_routed_experts={n_experts} must be divisible by ep={ep}")
    t, n_per_token = experts_TX.shape
    path = routed_path(t * n_per_token * (ep if layout == "rank-local" else 1), n_experts)

    def exact(experts_local: dict, x_TD, weights_TX, experts_TX):
        # one assignment per row: the kernel's "sum" over a single slot is that assignment's bf16 output, exactly
        local_A1 = local_experts(experts_TX, n_experts // ep).reshape(-1, 1)
        y_AD = routed_experts(experts_local, jnp.repeat(x_TD, n_per_token, axis=0), weights_TX.reshape(-1, 1),
                              local_A1, limit, impl=impl, path=path)
        return y_AD.astype(jnp.bfloat16)

    def partial(experts_local: dict, x_TD, weights_TX, experts_TX):
        local_TX = local_experts(experts_TX, n_experts // ep)
        return routed_experts(experts_local, x_TD, weights_TX, local_TX, limit, impl=impl, path=path)

    body = exact if combine == "exact" else partial
    if layout == "rank-local":
        y = scatter_tokens(body(experts, *gather_tokens(x_TD, weights_TX, experts_TX)))
    else:
        specs = (expert_specs(experts), P(), P(), P())
        # check_vma off: the kernel seam (jnp and Pallas) is not annotated for the varying-manual-axes type check;
        # the psum makes the output replicated, as out_specs P() states
        y = jax.shard_map(lambda *args: jax.lax.psum(body(*args), "ep"), mesh=mesh, in_specs=specs,
                          out_specs=P(), check_vma=False)(experts, x_TD, weights_TX, experts_TX)
    return y if combine == "partial" else sum_slots(y, n_per_token)
