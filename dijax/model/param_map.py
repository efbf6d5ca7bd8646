"""Checkpoint tensor names <-> ``Transformer`` module paths and logical axes; the parameter state from a checkpoint.

Module paths follow the checkpoint names, with two changes:

* backbone layers live in stacked blocks: ``layers.L.<rest>`` is ``stages.s.blocks.r.<rest>`` at index (i, j) of
  the leading (period, layer) axes, where layer L is member j of run r in repeat i of stage s
  (dijax.model.plan);
* a layer's hyper-connection tensors ``hc_attn_fn`` / ``hc_attn_base`` / ``hc_attn_scale`` (and ``hc_ffn_*``) are
  the ``fn`` / ``base`` / ``scale`` of its ``hc_attn`` (``hc_ffn``) module.

Routed experts are stacked over the experts as the loader assembles them: ``layers.L.ffn.experts.w1.weight``
[E, out, in / 2]. Every parameter's logical axis names are its ``out_sharding`` metadata (not applied to a mesh
here: ``eager_sharding=False``); the names are listed and explained once, in ``dijax.model.layers.LOGICAL_AXES``.
``logical_axes(state)`` reads them back by path.

Arrays keep the checkpoint's dtypes: fp8 e4m3 codes, uint8 MXFP4 bytes and ue8m0 scale bytes, bf16, fp32.

``state_from_tree`` places each parameter on the default device, or with ``mesh`` as one global array split over
the mesh by its logical axes (dijax.parallel.mesh), every device's block read for that device alone.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dijax.config import ModelConfig
from dijax.model.plan import plan_layers
from dijax.model.transformer import abstract_state
from dijax.parallel.mesh import padded_shape, param_sharding

_HC = ("hc_attn", "hc_ffn")


class Deferred(NamedTuple):
    """A tensor made only when it is placed: ``make()`` returns it (a device array). A tree of these (random codes
    drawn on the device, dijax.io.random_init) costs no memory until ``state_from_tree`` places each parameter, so
    the device holds the parameters placed so far and one tensor, not the model twice over (the thirty-third
    session's flash-slice draw ran out of 80 GB that way). ``np.asarray`` makes it too."""
    shape: tuple[int, ...]
    dtype: np.dtype
    make: Callable[[], jax.Array]

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.make(), dtype)


def _made(array):
    return array.make() if isinstance(array, Deferred) else array


def _block_rest(name_rest: tuple[str, ...]) -> tuple[str, ...]:
    """Layer-relative checkpoint name parts -> block-relative module path."""
    head = name_rest[0]
    for hc in _HC:
        if head.startswith(hc + "_"):
            return (hc, head[len(hc) + 1:])
    return name_rest


def _name_rest(path_rest: tuple) -> str:
    """Block-relative module path -> layer-relative checkpoint name."""
    if path_rest[0] in _HC:
        return f"{path_rest[0]}_{path_rest[1]}"
    return ".".join(str(p) for p in path_rest)


@lru_cache(maxsize=16)
def _layer_slots(cfg: ModelConfig, fold: bool) -> dict[int, tuple[int, int, int, int]]:
    """layer -> (stage s, run r, repeat i, member j)."""
    slots = {}
    for s, stage in enumerate(plan_layers(cfg, fold)):
        for i, period in enumerate(stage.layers):
            for r, run in enumerate(period):
                for j, layer in enumerate(run):
                    slots[layer] = (s, r, i, j)
    return slots


def module_path(cfg: ModelConfig, name: str, fold: bool = True) -> tuple[tuple, tuple[int, ...]]:
    """(module path, index into the leading stacked axes) of checkpoint tensor ``name``.

    ``layers.3.attn.wq_a.weight`` -> (('stages', s, 'blocks', r, 'attn', 'wq_a', 'weight'), (i, j)); a top-level
    tensor has index (). Routed experts are named stacked (``layers.L.ffn.experts.w1.weight``).
    """
    parts = tuple(name.split("."))
    if parts[0] != "layers":
        return parts, ()
    layer = int(parts[1])
    slots = _layer_slots(cfg, fold)
    if layer not in slots:
        raise ValueError(f"tensor {name!r} names layer {layer}, but the config has n_layers={cfg.n_layers}")
    s, r, i, j = slots[layer]
    return ("stages", s, "blocks", r) + _block_rest(parts[2:]), (i, j)


def checkpoint_names(cfg: ModelConfig, path: tuple, fold: bool = True) -> list[str]:
    """The checkpoint tensor name(s) held by the parameter at module ``path``: one for a top-level parameter,
    else one per stacked layer, in (repeat, member) order."""
    if path[0] != "stages":
        return [".".join(str(p) for p in path)]
    stage = plan_layers(cfg, fold)[path[1]]
    rest = _name_rest(path[4:])
    return [f"layers.{run[path[3]][j]}.{rest}" for run in stage.layers for j in range(len(run[path[3]]))]


def logical_axes(state: nnx.State) -> dict[tuple, tuple[str, ...]]:
    """{module path: logical axis names} of every parameter in ``state``."""
    return {path: var.get_metadata()["out_sharding"] for path, var in nnx.to_flat_state(state)}


def _lookup(tree: dict, name: str):
    node = tree
    for part in name.split("."):
        if part.isdigit() and isinstance(node, list):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise KeyError(name)
    return node


def _check(name: str, array, shape: tuple[int, ...], dtype) -> None:
    """``array`` is one tensor, or a list of per-expert tensors that stack to ``shape``."""
    parts = array if isinstance(array, list) else [array]
    inner = tuple(shape[1:]) if isinstance(array, list) else tuple(shape)
    for part in parts:
        if tuple(part.shape) != inner or np.dtype(part.dtype) != np.dtype(dtype):
            got = f"{len(parts)} x " if isinstance(array, list) else ""
            raise ValueError(f"tensor {name!r} is {got}{np.dtype(part.dtype)} {tuple(part.shape)}, the model "
                             f"expects {np.dtype(dtype)} {tuple(shape)}")
    if isinstance(array, list) and len(parts) != shape[0]:
        raise ValueError(f"tensor {name!r} has {len(parts)} experts, the model expects {shape[0]}")


def _write(stack, value, index):
    return jax.lax.dynamic_update_slice(stack, value.reshape((1,) * len(index) + value.shape),
                                        tuple(index) + (0,) * value.ndim)


# donated: each write lands in the stacked buffer in place, so device memory never holds a second copy of it
_write_donated = jax.jit(_write, donate_argnums=0)


def _host(array) -> np.ndarray:
    return np.stack([np.asarray(a) for a in array]) if isinstance(array, list) else np.asarray(array)


def _place(spec: jax.ShapeDtypeStruct, arrays: list, members: int) -> jax.Array:
    """The device array of one parameter from its per-layer tensors (``members`` layers per repeat when stacked,
    0 when not), each tensor (or expert) read from its memory map, or made (``Deferred``), and copied to the device
    on its own."""
    if jax.default_backend() == "cpu":  # device memory is host memory: stack there and place once
        host = _host(arrays[0]) if not members else np.stack([_host(a) for a in arrays]).reshape(spec.shape)
        return jax.device_put(host)
    if not any(isinstance(a, list) for a in arrays):
        if not members:
            return jax.device_put(_made(arrays[0]))
        if len(arrays) == 1:
            return jax.device_put(_made(arrays[0])[None, None])
    value = jnp.zeros(spec.shape, spec.dtype)
    for k, array in enumerate(arrays):
        layer = (k // members, k % members) if members else ()
        pieces = enumerate(array) if isinstance(array, list) else [(None, array)]
        for e, piece in pieces:
            index = layer + (() if e is None else (e,))
            value = _write_donated(value, jax.device_put(_made(piece)), index)
    return value


def _shard(shape: tuple[int, ...], dtype, arrays: list, members: int, index: tuple[slice, ...],
           device: jax.Device) -> jax.Array:
    """The block ``index`` (slices of the global ``shape``) of one parameter, on ``device``, from its per-layer
    tensors (``members`` layers per repeat when stacked, 0 when not).

    Each stacked layer inside the block gives the rows of the parameter's first own axis that the block selects,
    read on their own: a ``TensorRef`` by positioned reads, a memory map or array by slicing, a per-expert list
    only those experts. Rows past a tensor's end (the padding of a row-split table, ``padded_shape``) stay zero.
    On a CPU device the block is assembled in host memory and placed once; on an accelerator each layer's rows are
    written into the device buffer as they are read, so the host holds one layer's share at a time.
    """
    lead = 2 if members else 0
    ranges = [range(*s.indices(n)) for s, n in zip(index, shape)]
    rows, rest = ranges[lead], tuple(index[lead + 1:])
    block = tuple(len(r) for r in ranges)
    on_host = device.platform == "cpu"
    value = np.zeros(block, dtype) if on_host else jnp.zeros(block, dtype, device=device)
    for k, array in enumerate(arrays):
        layer = divmod(k, members) if members else ()
        if not all(i in r for i, r in zip(layer, ranges)):
            continue
        if isinstance(array, list):
            piece = np.stack([array[e][:] for e in rows])
        else:
            piece = np.asarray(_made(array)[rows.start:min(rows.stop, array.shape[0])])
        piece = piece[(slice(None),) + rest]
        at = tuple(i - r.start for i, r in zip(layer, ranges))
        if on_host:
            value[at + tuple(slice(0, n) for n in piece.shape)] = piece
        else:
            value = _write_donated(value, jax.device_put(piece, device), at)
    return jax.device_put(value, device) if on_host else value


def _place_on_mesh(shape: tuple[int, ...], dtype, names: tuple[str, ...], arrays: list, members: int,
                   mesh: Mesh) -> jax.Array:
    """One parameter as a global array on ``mesh``: its logical axis ``names`` give the sharding
    (``param_sharding``) and the zero-padded global shape (``padded_shape``); each device's block is read for that
    device alone (``_shard``), and a block several devices hold (a replicated parameter, ``dp`` replicas) is read
    once and copied between them.

    Built from per-device arrays (``jax.make_array_from_single_device_arrays``) rather than
    ``jax.make_array_from_callback``, which reads every device's block into host memory before it transfers any:
    for a split tensor that is the whole tensor on the host at once.
    """
    shape = padded_shape(shape, names, mesh)
    sharding = param_sharding(names, mesh)
    blocks: dict[tuple, jax.Array] = {}
    shards = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple(s.indices(n) for s, n in zip(index, shape))
        if key not in blocks:
            blocks[key] = _shard(shape, dtype, arrays, members, index, device)
        shards.append(jax.device_put(blocks[key], device))
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def state_from_tree(cfg: ModelConfig, tree: dict, fold: bool = True, mesh: Mesh | None = None) -> nnx.State:
    """Fill the model's abstract state from a checkpoint-named tree (``{'embed': {'weight': ...}, 'layers':
    [per layer {...}], ...}`` of numpy memory maps, arrays or ``TensorRef``s; a routed-expert tensor may be a list
    of per-expert arrays), placing each tensor on the device on its own.

    mesh: build each parameter as one global array on this mesh instead, split by its logical axes
    (dijax.parallel.mesh), every device reading only its own block (``_place_on_mesh``). Raises ValueError naming the tensor when one is missing or its shape or dtype differs from the model's.
    """
    abstract = abstract_state(cfg, fold=fold)
    flat = []
    for path, var in nnx.to_flat_state(abstract):
        spec = var.get_value()
        names = checkpoint_names(cfg, path, fold)
        arrays = []
        for name in names:
            try:
                arrays.append(_lookup(tree, name))
            except KeyError:
                raise ValueError(f"checkpoint has no tensor {name!r} (needed by {'.'.join(map(str, path))})") from None
        lead = 2 if path[0] == "stages" else 0
        for name, array in zip(names, arrays):
            _check(name, array, spec.shape[lead:], spec.dtype)
        members = spec.shape[1] if lead else 0
        if mesh is None:
            value = _place(spec, arrays, members)
        else:
            value = _place_on_mesh(spec.shape, spec.dtype, var.get_metadata()["out_sharding"], arrays, members, mesh)
        flat.append((path, var.replace(value)))
    return nnx.from_flat_state(flat)


def checkpoint_tree(cfg: ModelConfig, state: nnx.State, fold: bool = True) -> dict:
    """The checkpoint-named view of ``state``: {'embed', 'norm', 'head', 'layers': [per layer {...}]} with each
    stacked parameter sliced to its layer (arrays; ``ShapeDtypeStruct`` leaves give shape-only views)."""
    def take(value, index):
        if isinstance(value, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(value.shape[len(index):], value.dtype)
        return value[index]

    out: dict = {"layers": [{} for _ in range(cfg.n_layers)]}
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        for k, name in enumerate(checkpoint_names(cfg, path, fold)):
            parts = name.split(".")
            if parts[0] == "layers":
                node, keys = out["layers"][int(parts[1])], parts[2:]
                members = value.shape[1]
                leaf = take(value, (k // members, k % members))
            else:
                node, keys, leaf = out, parts, value
            for key in keys[:-1]:
                node = node.setdefault(key, {})
            node[keys[-1]] = leaf
    return out
