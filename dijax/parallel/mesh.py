"""The device mesh of expert parallelism and the placement of the model's parameters on it.

The mesh has two axes: ``dp`` and ``ep``; each ``ep`` rank holds 1 / ep of the routed experts and of every Engram
table's rows, replicated over ``dp``. With attention data parallelism (dijax.parallel.ranks) every device is also an
attention rank holding its own sequences; without it every device runs the whole batch. Placement reads each
parameter's logical axis names (``out_sharding`` metadata, dijax.model.layers.LOGICAL_AXES) and maps them by
``RULES``; everything else is replicated. A split axis is ceil-split: its size is rounded up to a multiple of the
mesh axis (``padded_shape``) with zeros, which only Engram tables need (an expert count must divide by ep,
``make_mesh`` checks; a table's row count need not).

Two ways onto the mesh: a checkpoint is loaded straight into its shards (dijax.io.checkpoint.load_params with
``mesh=``, each device reading only its experts and rows); parameters already on one device (random weights, a
parity fixture loaded once) are resharded by ``place_params``.

On a CPU-only machine JAX exposes one host device unless ``XLA_FLAGS`` asks for more before JAX initialises its
backends: ``force_host_devices`` sets that flag and must run before the first JAX computation (the CLI calls it
right after parsing ``--ep``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dijax.model.layers import LOGICAL_AXES

AXES = ("dp", "ep")
# (logical axis, mesh axis, the axis that marks the parameters the rule applies to). Only the routed experts'
# matrices carry "expert_in": the router's own "expert" axis (gate weight [E, D], bias [E]) is read whole by every
# device to choose the experts, so it stays replicated. Engram tables (weight and scale) split by rows
# (dijax.parallel.engram looks them up).
RULES = (("expert", "ep", "expert_in"), ("engram_rows", "ep", "engram_rows"))
_HOST_FLAG = "--xla_force_host_platform_device_count"


def force_host_devices(n: int) -> None:
    """Give the host (CPU) platform ``n`` devices through ``XLA_FLAGS``, replacing an earlier count.

    Call it before the first JAX computation: XLA reads the flag once, when JAX initialises its backends, and
    ignores later changes. On a machine with GPUs the flag only adds CPU devices, which ``jax.devices()`` (the
    default backend's) does not list, so it is harmless there.
    """
    if n < 1:
        raise ValueError(f"host device count must be >= 1, got {n}")
    flags = re.sub(rf"{_HOST_FLAG}=\S+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags.strip()} {_HOST_FLAG}={n}".strip()


def make_mesh(ep: int, n_experts: int | None = None) -> Mesh:
    """A ``(dp, ep)`` mesh over all of ``jax.devices()``: ``ep`` ranks share the routed experts and dp =
    devices / ep. ``n_experts`` (the config's n_routed_experts), when given, must be divisible by ``ep``."""
    devices = jax.devices()
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep must be a positive integer, got {ep!r}")
    if ep > len(devices) or len(devices) % ep:
        hint = (f" (on a CPU-only machine, dijax.parallel.mesh.force_host_devices({ep}) before JAX starts gives "
                f"the host {ep} devices)" if devices[0].platform == "cpu" else "")
        raise ValueError(f"ep={ep} must divide the device count {len(devices)} ({devices[0].platform}): allowed "
                         f"{[d for d in range(1, len(devices) + 1) if len(devices) % d == 0]}{hint}")
    if n_experts is not None and n_experts % ep:
        raise ValueError(f"ep={ep} must divide n_routed_experts={n_experts}: allowed (dividing both it and the "
                         f"device count {len(devices)}) "
                         f"{[d for d in range(1, len(devices) + 1) if len(devices) % d == 0 and n_experts % d == 0]}")
    return Mesh(np.asarray(devices).reshape(len(devices) // ep, ep), AXES)


def partition_spec(names: tuple[str, ...] | None) -> PartitionSpec:
    """The mesh placement of a parameter with logical axis ``names`` (``RULES``; unnamed or unmatched axes are
    replicated)."""
    names = tuple(names or ())
    spec = [None] * len(names)
    for logical, mesh_axis, marker in RULES:
        if logical in names and marker in names:
            spec[names.index(logical)] = mesh_axis
    return PartitionSpec(*spec)


def param_sharding(names: tuple[str, ...] | None, mesh: Mesh) -> NamedSharding:
    """The ``NamedSharding`` on ``mesh`` of a parameter with logical axis ``names`` (``partition_spec``)."""
    return NamedSharding(mesh, partition_spec(names))


def param_specs(params: nnx.State) -> nnx.State:
    """``params`` (an ``nnx.State`` of ``nnx.Param``, placed or traced) with each parameter replaced by its
    ``partition_spec``: the ``in_specs`` of a ``shard_map`` that takes the parameters as placed (each device its
    own experts and Engram rows, every other parameter whole)."""
    return jax.tree.map(lambda variable: partition_spec(variable.get_metadata().get("out_sharding")), params,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def padded_shape(shape: tuple[int, ...], names: tuple[str, ...] | None, mesh: Mesh) -> tuple[int, ...]:
    """The global shape of a parameter of ``shape`` with logical axis ``names`` on ``mesh``: every split axis
    rounded up to a multiple of its mesh axis's size (ceil-split; the extra rows are zeros)."""
    spec = partition_spec(names)
    return tuple(-(-n // mesh.shape[axis]) * mesh.shape[axis] if axis else n
                 for n, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))))


def place_params(params: nnx.State, mesh: Mesh | None) -> nnx.State:
    """``params`` (an ``nnx.State`` of ``nnx.Param``) with each array zero-padded to ``padded_shape`` and put on
    ``mesh`` by ``partition_spec`` of its logical axes. ``mesh=None`` returns ``params`` unchanged (one device);
    parameters already on ``mesh`` stay as they are."""
    if mesh is None:
        return params

    def place(variable: nnx.Variable) -> nnx.Variable:
        names = variable.get_metadata().get("out_sharding")
        value = variable.get_value()
        shape = padded_shape(value.shape, names, mesh)
        if shape != value.shape:
            value = jnp.pad(value, [(0, padded - n) for padded, n in zip(shape, value.shape)])
        return variable.replace(jax.device_put(value, param_sharding(names, mesh)))

    return jax.tree.map(place, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def params_mesh(params: nnx.State) -> Mesh | None:
    """The mesh ``params`` were placed on (``place_params``, or loaded onto) when it splits experts (an ``ep`` axis
    of size > 1), else None (parameters on one device)."""
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.shape.get("ep", 1) > 1:
            return sharding.mesh
    return None


@contextlib.contextmanager
def mesh_context(mesh: Mesh | None):
    """The context in which the model traces on ``mesh``: ``jax.set_mesh(mesh)`` (the ``shard_map``s of the MoE
    and the Engram lookup read it; the context mesh is part of the jit key) with every logical axis name bound to
    no mesh axis, so that Flax's abstract model (``nnx.eval_shape``, which builds a sharding from each parameter's
    names under a context mesh) stays replicated: the placement is the parameters' own (loaded onto the mesh, or
    ``place_params``). A no-op context for ``mesh=None``."""
    if mesh is None:
        yield
        return
    with jax.set_mesh(mesh), nnx.logical_axis_rules(tuple((name, None) for name in LOGICAL_AXES)):
        yield


def on_mesh(fn, mesh: Mesh | None):
    """``fn`` called under ``mesh_context(mesh)``; ``fn`` itself for ``mesh=None``."""
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with mesh_context(mesh):
            return fn(*args, **kwargs)

    return call
