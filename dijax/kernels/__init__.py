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
# with it (`--kernels on`, tools/gpu_validate.sh), or when it returns exactly the reference's result. Top-k select
# returns the same values, indices and order as lax.top_k, ties included (tests/test_kernels_topk.py on CPU,
# tests/gpu/test_attention_gpu.py on the H200), so the model's output cannot change. The Pallas kernels agree
# with their references to float32 / bf16 rounding and each passed its own GPU test (the Sinkhorn kernel not yet
# run on a GPU), but the model-level GPU parity run with them is still to be made.
AUTO_ON_GPU: dict[str, str] = {"topk_impl": "select"}


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
