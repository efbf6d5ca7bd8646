"""Kernels: each op's pure-jnp reference and its fast version behind one signature (``impl=``), a leaf package.

| op | module | implementations |
|---|---|---|
| routed experts (MXFP4 / fp8 grouped GEMM, SwiGLU) | ``routed_experts`` | reference, pallas |
| MXFP4 grouped GEMM on wgmma, weights decoded in registers (``routed_experts``' ``gemm_engine='mgpu'``) | ``fp4_wgmma`` | reference, mgpu |
| sparse attention with the sink | ``sparse_attn`` | reference, pallas |
| sparse attention on wgmma, rows gathered by ``cp.async`` (``sparse_attn``'s ``engine='mgpu'``) | ``sparse_attn_mgpu`` | reference, mgpu |
| the flash-decoding merge of split partial sums with the sink (both sparse-attention kernels) | ``flash_merge`` | (jnp only) |
| rows gathered by index into wgmma's swizzled shared-memory layout with ``cp.async`` (Mosaic GPU kernels) | ``row_gather`` | (helpers) |
| lightning-indexer scores over the paged key pool | ``indexer`` | reference, pallas |
| indexer scores on wgmma for prefill, tiles of 8 tokens, the head sum a second product (``indexer``'s ``engine='mgpu'``) | ``indexer_mgpu`` | reference, mgpu |
| the indexer's exact top-k | ``topk`` | reference (``lax.top_k``), select (threshold selection in XLA), pallas |
| the hyper-connection mix split (sigmoids, softmax, Sinkhorn rounds) | ``sinkhorn.split`` | reference, pallas |
| the MoE router's selection (top-X, ids ascending, renormalised weights) | ``router`` | reference, pallas |
| the sampler's top-k / top-p thresholds (radix descents over the vocabulary) | ``sample_filter`` | reference, pallas |
| fp8 block-scaled linear (attention, shared expert, Engram projections) | ``fp8_linear`` | reference, pallas |
| fp8 linear at decode on wgmma, weights decoded in registers (``fp8_linear``'s ``engine='mgpu'``) | ``fp8_wgmma`` | reference, mgpu |
| the attention's query latent and KV row after its first projections (RMS norms, rope, fp8) | ``latents`` | reference, pallas |
| the hyper-connections' collapse of the streams and the RMS norm after it (each sublayer's input) | ``collapse`` | reference, pallas |
| fp8 / fp4 fake quantisation, block-scaled weights | ``quant`` | (jnp only) |
| rotary embedding with YaRN | ``rope`` | (jnp only) |
| bf16 pairs in uint32 words: the weight decode's pieces (grouped GEMM, fp8 linear) | ``bf16_pairs`` | (helpers) |
| correctly rounded float32 division inside kernels (``div.rn.f32``) | ``division`` | (helpers) |
| kernel loops whose loads run a step ahead (Triton pipelines only loads that feed a dot) | ``prefetch`` | (helpers) |
| are a checkpoint's scales where those decodes are exact (else the reference) | ``scale_range`` | (engine start) |

The choice is static (part of the step's jit key) and made once per engine by ``options.kernel_options``. This
package's own module holds only what the kernel modules share (interpret mode, lowering for a GPU elsewhere), so
that they import it and ``options`` imports them, with no cycle.
"""

from __future__ import annotations

import contextlib

import jax

_lowering_for_gpu = False


@contextlib.contextmanager
def lowering_for_gpu():
    """Within: kernels take their GPU form (Triton, and Mosaic GPU where the engine would pick it: the target is
    taken for compute capability 9.0) whatever the default backend, so that a step can be lowered for CUDA on a
    machine without a GPU (tools/kernel_report.py, tools/deviceless.py). Running them there still needs a GPU."""
    global _lowering_for_gpu
    _lowering_for_gpu = True
    try:
        yield
    finally:
        _lowering_for_gpu = False


def lowering_without_gpu() -> bool:
    """Whether the step is being lowered for a GPU on a machine without one (inside ``lowering_for_gpu``)."""
    return _lowering_for_gpu


def interpret_mode(requested: bool | None = None) -> bool:
    """Whether a Pallas kernel runs interpreted: ``requested``, or when None, whether JAX's default backend is not a
    GPU (the kernels' Triton lowering needs one; interpreted, they run anywhere, slowly) outside
    ``lowering_for_gpu``."""
    if requested is not None:
        return requested
    return jax.default_backend() != "gpu" and not _lowering_for_gpu
