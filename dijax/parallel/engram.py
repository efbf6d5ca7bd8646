"""Engram table lookups under expert parallelism: the tables split by rows over the mesh's ``ep`` axis.

Each ``ep`` rank holds a contiguous block of n = rows / ep rows (rank r: global rows ``[r * n, (r + 1) * n)``). A
table's row count need not divide by ep: placement pads it with zero rows up to a multiple of ep (ceil-split,
dijax.parallel.mesh.padded_shape), so the last ranks hold the padding. Hash rows never address it: they are below
the real row count by construction (``EngramTables.from_token_map`` checks that each layer's primes sum to it).

Each rank gathers the rows it holds (global id minus its offset) and zeros for every other row, then the fp8
codes and scale bytes, as uint8, are summed over ``ep``. Each looked-up row is non-zero on exactly one rank and
integer sums are exact, so every rank ends with the bytes one device would have gathered: bit-identical for every
ep (summing dequantised rows in floating point instead would turn a -0.0 into +0.0). The tokens reach the ranks as
for the routed experts (dijax.parallel.moe, ``token_layout``): replicated (a ``shard_map`` over ``ep`` here, the
sum a ``psum``), or rank-local inside the attention-DP step (the row ids ``all_gather``ed over ``ep``, the sum a
``psum_scatter`` that leaves each rank its own tokens' rows).

Letters: T tokens, J hash columns, W row width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dijax.parallel.moe import expert_mesh, gather_tokens, scatter_tokens, token_layout


def table_rows(table: dict, rows_TJ: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The rows ``rows_TJ`` (int32 [T, J], global row ids) of an Engram table {'weight': e4m3 [rows, W],
    'scale': uint8 [rows, W / 32]}: (e4m3 [T, J, W], uint8 [T, J, W / 32]).

    With an ``ep`` context mesh (``jax.set_mesh``, as for the routed experts) the table is split by rows over
    ``ep`` and looked up as the module docstring describes (in the rank-local layout ``table`` is this rank's
    [rows / ep, ...] slice); without one this is a plain gather.
    """
    mesh = expert_mesh()
    if mesh is None:
        return table["weight"][rows_TJ], table["scale"][rows_TJ]
    if token_layout(mesh) == "rank-local":
        codes_TJW, scale = (scatter_tokens(a) for a in local_rows(table["weight"], table["scale"],
                                                                 *gather_tokens(rows_TJ)))
        return jax.lax.bitcast_convert_type(codes_TJW, table["weight"].dtype), scale
    ep = mesh.shape["ep"]
    n_rows = table["weight"].shape[0]
    if n_rows % ep:
        raise ValueError(f"an Engram table of {n_rows} rows cannot split over ep={ep}: load the parameters onto the "
                         f"mesh (load_params(mesh=...)) or place them (dijax.parallel.mesh.place_params), which pad "
                         f"the rows to a multiple of ep")

    def lookup(weight_local, scale_local, rows_TJ):
        return tuple(jax.lax.psum(a, "ep") for a in local_rows(weight_local, scale_local, rows_TJ))

    codes_TJW, scale = jax.shard_map(lookup, mesh=mesh, in_specs=(P("ep"), P("ep"), P()), out_specs=(P(), P()))(
        table["weight"], table["scale"], rows_TJ)
    return jax.lax.bitcast_convert_type(codes_TJW, table["weight"].dtype), scale


def local_rows(weight_local: jax.Array, scale_local: jax.Array, rows_TJ: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inside ``shard_map`` over ``ep``: this rank's part of the lookup of global rows ``rows_TJ`` in its block of
    n rows (e4m3 [n, W], uint8 [n, W / 32]): (uint8 codes [T, J, W], uint8 scales [T, J, W / 32]), zero for the
    rows other ranks hold."""
    n_local = weight_local.shape[0]
    local_TJ = rows_TJ - jax.lax.axis_index("ep") * n_local
    mine_TJ1 = ((local_TJ >= 0) & (local_TJ < n_local))[..., None]
    safe_TJ = jnp.clip(local_TJ, 0, n_local - 1)
    codes_TJW = jnp.where(mine_TJ1, jax.lax.bitcast_convert_type(weight_local[safe_TJ], jnp.uint8), 0)
    return codes_TJW, jnp.where(mine_TJ1, scale_local[safe_TJ], 0)
