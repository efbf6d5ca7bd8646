"""Kernels: each op's pure-jnp reference and its fast version behind one signature (``impl=``), a leaf package.

| op | module | implementations |
|---|---|---|
| routed experts (MXFP4 / fp8 grouped GEMM, SwiGLU) | ``routed_experts`` | reference, pallas |
| MXFP4 grouped GEMM on wgmma, weights decoded in registers (``routed_experts``' ``gemm_engine='mgpu'``) | ``fp4_wgmma`` | reference, mgpu |
| sparse attention with the sink | ``sparse_attn`` | reference, pallas |
| lightning-indexer scores over the paged key pool | ``indexer`` | reference, pallas |
| the indexer's exact top-k | ``topk`` | reference (``lax.top_k``), select (threshold selection in XLA), pallas |
| the hyper-connection mix split (sigmoids, softmax, Sinkhorn rounds) | ``sinkhorn.split`` | reference, pallas |
| the MoE router's selection (top-X, ids ascending, renormalised weights) | ``router`` | reference, pallas |
| fp8 block-scaled linear (attention, shared expert, Engram projections) | ``fp8_linear`` | reference, pallas |
| fp8 / fp4 fake quantisation, block-scaled weights | ``quant`` | (jnp only) |
| bf16 pairs in uint32 words: the weight decode's pieces (grouped GEMM, fp8 linear) | ``bf16_pairs`` | (helpers) |
| correctly rounded float32 division inside kernels (``div.rn.f32``) | ``division`` | (helpers) |
| are a checkpoint's scales where those decodes are exact (else the reference) | ``scale_range`` | (engine start) |

The choice is static (part of the step's jit key) and made once per engine by ``kernel_options``.
"""

from __future__ import annotations

import contextlib

import jax

KERNEL_CHOICES = ("auto", "on", "off")
REFERENCE = {"moe_impl": "reference", "topk_impl": "reference", "sparse_attn_impl": "reference",
             "sinkhorn_impl": "reference", "linear_impl": "reference", "indexer_impl": "reference",
             "router_impl": "reference"}
FAST = {"moe_impl": "pallas", "topk_impl": "pallas", "sparse_attn_impl": "pallas", "sinkhorn_impl": "pallas",
        "linear_impl": "pallas", "indexer_impl": "pallas", "router_impl": "pallas"}
# The fast kernels 'auto' turns on for a GPU: a kernel joins once the whole model passes `dijax parity` on a GPU
# with it (`--kernels on`, tools/gpu_validate.sh). All four have (H200, 2026-12-01, docs/parity.md "On the GPU"):
# every statistical bound, tier 2, the engine's tokens; the one prefix row that misses is of the same kind as the
# row the CPU misses with every kernel off (a single position-1 row at r ~ 1e-2, issue 8). Each kernel also passed
# its own GPU test against its reference; top-k select returns exactly lax.top_k's result, and the Sinkhorn kernel
# matches a numpy float32 oracle bit for bit where XLA's GPU code for the reference is 9-21 ulps off.
# The fp8 linear and indexer kernels joined in the third session (2026-12-01): their GPU tests pass (the indexer
# bit-equal to its reference at every benchmarked shape), and tiny-nodrop tier 1, its engine run and tiny
# tier1-injected give the same verdicts and the same figures to three digits with them on; in the fourth session
# tiny tier 2 (0.677 >= 0.6) and tiny-nodrop --chunk 7 passed with every kernel on too, docs/parity.md.
# The top-k Pallas kernel joined in the seventh session (2026-12-02): its GPU tests pass (the same values, indices
# and order as lax.top_k), `dijax parity --kernels on` on tiny-nodrop and its engine run gave the figures of the
# 'auto' runs without it (index sets identical), and it is 19.9x lax.top_k at 64 rows x 262,144 (docs/benchmarks.md).
# The router kernel (twenty-second session) joined in the twenty-third (2026-12-04): its GPU test passes (the
# numpy oracle's experts and correctly rounded weights), GPU parity with it gave the figures of the runs without it
# (every failure the issue-8 prefix row), and one token a program it is 1.6-7.4x XLA's top-k path at 16-8192 tokens.
AUTO_ON_GPU: dict[str, str] = dict(FAST)
# each option's implementations (the modules' ``IMPLS``; tests/test_kernel_options.py checks they agree)
OPTION_IMPLS = {name: ("reference", "select", "pallas") if name == "topk_impl" else ("reference", "pallas")
                for name in REFERENCE}


_lowering_for_gpu = False


@contextlib.contextmanager
def lowering_for_gpu():
    """Within: kernels take their GPU (Triton) form whatever the default backend, so that a step can be lowered
    for CUDA on a machine without a GPU (tools/kernel_report.py). Running them there still needs a GPU."""
    global _lowering_for_gpu
    _lowering_for_gpu = True
    try:
        yield
    finally:
        _lowering_for_gpu = False


def interpret_mode(requested: bool | None = None) -> bool:
    """Whether a Pallas kernel runs interpreted: ``requested``, or when None, whether JAX's default backend is not a
    GPU (the kernels' Triton lowering needs one; interpreted, they run anywhere, slowly) outside
    ``lowering_for_gpu``."""
    if requested is not None:
        return requested
    return jax.default_backend() != "gpu" and not _lowering_for_gpu


def parse_kernels(kernels: str) -> tuple[str, dict[str, str]]:
    """Split the engine option ``kernels`` into its choice ('auto', 'on' or 'off') and its overrides: after the
    choice, comma-separated ``option=impl`` pairs, e.g. 'off,sparse_attn_impl=pallas' (the references with the
    Pallas sparse attention: a parity change bisected kernel by kernel). Raises ValueError naming the bad part."""
    choice, *items = kernels.split(",")
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels must start with one of {KERNEL_CHOICES}, got {kernels!r}")
    overrides = {}
    for item in items:
        name, _, impl = item.partition("=")
        if name not in OPTION_IMPLS:
            raise ValueError(f"kernels: an override is option=impl with option one of {sorted(OPTION_IMPLS)}, "
                             f"got {item!r}")
        if impl not in OPTION_IMPLS[name]:
            raise ValueError(f"kernels: {name} must be one of {OPTION_IMPLS[name]}, got {impl!r}")
        overrides[name] = impl
    return choice, overrides


def kernel_options(kernels: str, platform: str) -> dict[str, str]:
    """The step's kernel options for the engine option ``kernels``: 'on' (every fast kernel; they need a GPU),
    'off' (the jnp references) or 'auto' (the references, with ``AUTO_ON_GPU``'s kernels on a GPU), then its
    overrides (``parse_kernels``). An overridden Pallas kernel runs interpreted where the platform is not a GPU."""
    choice, overrides = parse_kernels(kernels)
    if choice == "on" and platform != "gpu":
        raise ValueError(f"kernels='on' needs a GPU (the Pallas kernels lower through Triton); this platform is "
                         f"{platform!r}: use kernels='off' or 'auto'")
    if choice == "on":
        return FAST | overrides
    return REFERENCE | (AUTO_ON_GPU if choice == "auto" and platform == "gpu" else {}) | overrides
