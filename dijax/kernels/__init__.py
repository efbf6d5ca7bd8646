"""Kernels: each op's pure-jnp reference and its fast version behind one signature (``impl=``), a leaf package.

| op | module | implementations |
|---|---|---|
| routed experts (MXFP4 / fp8 grouped GEMM, SwiGLU) | ``routed_experts`` | reference, pallas |
| sparse attention with the sink | ``sparse_attn`` | reference, pallas |
| the indexer's exact top-k | ``topk`` | reference (``lax.top_k``), select (threshold selection) |
| the hyper-connection Sinkhorn rounds | ``sinkhorn`` | reference, pallas |
| fp8 / fp4 fake quantisation, block-scaled weights | ``quant`` | (jnp only) |

The choice is static (part of the step's jit key) and made once per engine by ``kernel_options``.
"""

from __future__ import annotations

KERNEL_CHOICES = ("auto", "on", "off")
REFERENCE = {"moe_impl": "reference", "topk_impl": "reference", "sparse_attn_impl": "reference",
             "sinkhorn_impl": "reference"}
FAST = {"moe_impl": "pallas", "topk_impl": "select", "sparse_attn_impl": "pallas", "sinkhorn_impl": "pallas"}
# The fast kernels 'auto' turns on for a GPU: a kernel joins once the whole model passes `dijax parity` on a GPU
# with it (`--kernels on`). None has yet: each kernel passed its own GPU test against its reference (except the
# Sinkhorn kernel, not yet run on a GPU), but the session that built them ran out of device time before the
# model-level GPU parity run (docs/benchmarks.md).
AUTO_ON_GPU: dict[str, str] = {}


def kernel_options(kernels: str, platform: str) -> dict[str, str]:
    """The step's kernel options for the engine option ``kernels``: 'on' (every fast kernel; they need a GPU),
    'off' (the jnp references) or 'auto' (the references, with ``AUTO_ON_GPU``'s kernels on a GPU)."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
    if kernels == "on" and platform != "gpu":
        raise ValueError(f"kernels='on' needs a GPU (the Pallas kernels lower through Triton); this platform is "
                         f"{platform!r}: use kernels='off' or 'auto'")
    if kernels == "on":
        return dict(FAST)
    return dict(REFERENCE, **(AUTO_ON_GPU if kernels == "auto" and platform == "gpu" else {}))
