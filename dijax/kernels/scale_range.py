"""Whether a checkpoint's block scales lie where the GPU kernels' weight decodes are exact; checked once per engine.

The fp8 linear's and the routed experts' grouped GEMM's GPU forms build each weight as one bf16 product of a
decoded code and a power of two. That product is the exact weight only for ue8m0 scale bytes in a range
(``fp8_linear.SCALE_RANGE``, ``routed_experts.GEMM_SCALE_RANGE``); real checkpoints sit far inside it (scales near
2^-8, byte 119). Outside it the kernel would give inexact weights and no error, so ``exact_kernels`` hands that op to
its reference instead and says which parameter made it.

Parameters are the model's nested mappings (an ``nnx.State`` or dicts): a linear is a mapping with 'weight' and
'scale' (dijax.model.layers), whose scale has one row per 32 weight rows (an fp8 table's, one per row, is no
linear); the routed experts' are under a key 'experts'.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from dijax.kernels import fp8_linear, routed_experts


def _array(leaf):
    """A parameter's array (an ``nnx.Variable``'s value, or the leaf itself)."""
    return leaf.get_value() if hasattr(leaf, "get_value") else leaf


def _kernel_range(path: str, weight: jax.Array, scale: jax.Array) -> tuple[str, tuple[int, int]] | None:
    """(kernel option, exact scale bytes) of the kernel that decodes this weight on the GPU, or None."""
    experts = "experts" in path.split("/")
    linear = scale.ndim == weight.ndim and scale.shape[-2] == -(-weight.shape[-2] // fp8_linear.FP8_BLOCK)
    if weight.dtype == jnp.float8_e4m3fn and linear and not experts:
        return "linear_impl", fp8_linear.SCALE_RANGE
    if weight.dtype == jnp.uint8 and experts:  # MXFP4 experts (fp8 experts take the reference)
        return "moe_impl", routed_experts.GEMM_SCALE_RANGE
    return None


def out_of_range(params: dict) -> dict[str, list[str]]:
    """Kernel option -> the parameters (path and their scale bytes' span) whose scales leave that kernel's exact
    range. Reads every checked scale array's min and max in one host read (one device sync, not one per linear)."""
    checked: list[tuple[str, str, tuple[int, int]]] = []
    spans: list[jax.Array] = []

    def visit(path: str, node) -> None:
        if not isinstance(node, Mapping):
            return
        weight, scale = (_array(node.get(key)) for key in ("weight", "scale"))
        if weight is not None and scale is not None and (kernel := _kernel_range(path, weight, scale)):
            checked.append((path, *kernel))
            spans.append(jnp.stack([jnp.min(scale), jnp.max(scale)]))
        for key, child in node.items():
            visit(f"{path}/{key}" if path else str(key), child)

    visit("", params)
    found: dict[str, list[str]] = {}
    for (path, option, (lo, hi)), span in zip(checked, jax.device_get(spans), strict=True):
        smallest, largest = (int(v) for v in span)
        if smallest < lo or largest > hi:
            found.setdefault(option, []).append(f"{path}: scale bytes {smallest}..{largest} (exact: {lo}..{hi})")
    return found


def exact_kernels(options: dict[str, str], params: dict) -> dict[str, str]:
    """``options`` (``kernel_options``' result) with each Pallas op whose exact scale range some parameter leaves
    set back to 'reference', with a warning naming the parameters. Without a Pallas option nothing is read."""
    if not any(options.get(option) == "pallas" for option in ("linear_impl", "moe_impl")):
        return options
    options = dict(options)
    for option, where in out_of_range(params).items():
        if options.get(option) == "pallas":
            options[option] = "reference"
            warnings.warn(f"{option}: the Pallas kernel is exact only within its scale range; these parameters "
                          f"leave it, so the reference serves them: {'; '.join(where[:4])}"
                          f"{f' (and {len(where) - 4} more)' if len(where) > 4 else ''}", stacklevel=2)
    return options
