"""Load a checkpoint (memory-mapped safetensors, see dijax.io.safetensors) into the model's parameters.

The tensors are gathered into a checkpoint-named tree ({'embed': {'weight'}, 'norm': {...}, 'head': {...},
'layers': [per layer {'attn': ..., 'ffn': {'gate', 'experts', 'shared_experts'}, 'attn_norm', 'ffn_norm',
'hc_*', optional 'engram'}]}, routed experts stacked: ``experts['w1']['weight']`` is [E, out, in / 2]), which
dijax.model.param_map turns into the ``Transformer``'s ``nnx.State``.
"""

from __future__ import annotations

import os

from flax import nnx
from jax.sharding import Mesh

from dijax.config import ModelConfig
from dijax.io.convert import MARKER, convert, source_fingerprint
from dijax.io.safetensors import iter_tensors, tensor_refs
from dijax.model.param_map import state_from_tree

def _set(tree: dict, dotted: list[str], value) -> None:
    for part in dotted[:-1]:
        tree = tree.setdefault(part, {})
    tree[dotted[-1]] = value


def cache_root() -> str:
    """dijax's cache directory: ``$DIJAX_CACHE``, else ``~/.cache/dijax`` (converted checkpoints, compiled steps)."""
    return os.environ.get("DIJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dijax")


def resolve_checkpoint(path: str | os.PathLike, cache_dir: str | None = None, progress: bool = True) -> str:
    """A loadable dijax checkpoint for ``path``.

    A dijax checkpoint (``dijax.json`` marker) or a single reference-layout file is used as it is. A Hugging Face
    checkpoint directory is converted on first use into ``cache_dir`` (default ``$DIJAX_CACHE`` or
    ``~/.cache/dijax``), keyed by its content (``convert.source_fingerprint``: shard sizes and headers, index,
    config and tokenizer files), and the converted copy is reused until that content changes.
    """
    path = os.fspath(path)
    if os.path.isfile(path) or os.path.exists(os.path.join(path, MARKER)):
        return path
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index):
        return path
    root = cache_dir or cache_root()
    target = os.path.join(root, source_fingerprint(path)[:32])
    if not os.path.exists(os.path.join(target, MARKER)):
        print(f"dijax: {path} is a Hugging Face checkpoint; converting it once into {target}", flush=True)
        convert(path, target, progress=progress)
    return target


def load_params(cfg: ModelConfig, path: str | os.PathLike, mesh: Mesh | None = None) -> nnx.State:
    """Load a reference-layout or dijax checkpoint into the model's parameters (``nnx.State``, device arrays).

    Without a mesh the tensors are memory-mapped and placed on the default device one by one. ``mesh`` (dijax.parallel.mesh.make_mesh) loads every parameter straight onto the mesh as one global array,
    split by its logical axes: routed experts over ``ep``, Engram tables by rows over ``ep`` (ceil-split, zero
    rows padding the last devices), everything else replicated. Each device's block is read for it alone, by
    positioned reads rather than through a memory map (dijax.io.safetensors.TensorRef), so the host never holds
    a whole split tensor: on an accelerator one layer's share of one tensor at a time, on CPU host devices one
    device's block (dijax.model.param_map.state_from_tree). See ``params_from_tensors`` for the rest.
    """
    items = tensor_refs(path) if mesh is not None else ((name, array) for name, array, _ in iter_tensors(path))
    return params_from_tensors(cfg, items, source=os.fspath(path), mesh=mesh)


def params_from_tensors(cfg: ModelConfig, items, source: str = "checkpoint", mesh: Mesh | None = None) -> nnx.State:
    """Assemble (checkpoint name, array) pairs (numpy arrays, memory maps or ``TensorRef``s) into the model's
    parameters (device arrays; on ``mesh``, global arrays split as ``load_params`` describes).

    Routed experts come one per name (``layers.L.ffn.experts.E.w1.weight``) or already stacked
    (``layers.L.ffn.experts.w1.weight`` [E, ...], as ``random_codes`` draws them).

    Tensors keep their checkpoint dtypes (the reference's load-time fp32 promotions of ``head`` and ratio>1
    ``compressor.{wkv,wgate}`` happen in the model's computation). Returns the model's ``nnx.State``
    (dijax.model.param_map), each tensor placed on the device on its own.
    DSpark (``mtp.*``) tensors are not used by the backbone and are skipped.
    """
    first, last = 0, cfg.n_routed_experts
    layers: list[dict] = [{} for _ in range(cfg.n_layers)]
    experts: list[dict[int, dict]] = [{} for _ in range(cfg.n_layers)]
    stacked_experts: list[dict] = [{} for _ in range(cfg.n_layers)]
    top: dict = {}
    for name, array in items:
        parts = name.split(".")
        if parts[0] == "mtp":
            continue
        if parts[0] != "layers":
            _set(top, parts, array)
            continue
        layer = int(parts[1])
        if layer >= cfg.n_layers:
            raise ValueError(f"tensor {name!r} names layer {layer}, but the config has n_layers={cfg.n_layers}")
        rest = parts[2:]
        if rest[:2] == ["ffn", "experts"]:
            if rest[2] in ("w1", "w2", "w3"):  # already stacked over this range's experts: [E, ...]
                _set(stacked_experts[layer], rest[2:], array)
            elif first <= int(rest[2]) < last:
                experts[layer].setdefault(int(rest[2]), {}).setdefault(rest[3], {})[rest[4]] = array
            continue
        if rest[:2] == ["attn", "wo_a"] and rest[2] == "scale":
            raise ValueError(f"{source} holds an fp8 'attn.wo_a' with its scale (the Hugging Face layout): "
                             f"pass it through resolve_checkpoint() (or `dijax convert`) first")
        _set(layers[layer], rest, array)
    for layer in range(cfg.n_layers):
        found = experts[layer]
        if stacked_experts[layer]:
            if found or sorted(stacked_experts[layer]) != ["w1", "w2", "w3"]:
                raise ValueError(f"layer {layer}: routed experts must be either all per expert or stacked w1, w2 "
                                 f"and w3; found stacked {sorted(stacked_experts[layer])} and {len(found)} per expert")
            for w, tensors in stacked_experts[layer].items():
                if tensors["weight"].shape[0] != last - first:
                    raise ValueError(f"layer {layer}: stacked 'ffn.experts.{w}.weight' holds "
                                     f"{tensors['weight'].shape[0]} experts, expected {last - first}")
            layers[layer].setdefault("ffn", {})["experts"] = stacked_experts[layer]
            continue
        if sorted(found) != list(range(first, last)):
            raise ValueError(f"layer {layer}: expected routed experts {first}..{last - 1}, found {len(found)}")
        # per-expert lists: param_map stacks them on the device, one expert at a time
        stacked = {w: {k: [found[e][w][k] for e in range(first, last)]
                       for k in found[first][w]} for w in ("w1", "w2", "w3")}
        layers[layer].setdefault("ffn", {})["experts"] = stacked
    top["layers"] = layers
    return state_from_tree(cfg, top, mesh=mesh)
