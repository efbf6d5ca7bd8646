"""The engine's kernel options: which implementation each kernel seam takes (``kernel_options``), from the engine
option ``kernels`` ('auto', 'on' or 'off', then ``option=impl`` overrides: ``parse_kernels``). Each option's
implementations are its module's ``IMPLS``."""

from __future__ import annotations

from dijax.kernels import collapse, fp8_linear, indexer, latents, router, routed_experts, sinkhorn, sparse_attn, topk

KERNEL_CHOICES = ("auto", "on", "off")
REFERENCE = {"moe_impl": "reference", "topk_impl": "reference", "sparse_attn_impl": "reference",
             "sinkhorn_impl": "reference", "linear_impl": "reference", "indexer_impl": "reference",
             "router_impl": "reference", "latents_impl": "reference", "collapse_impl": "reference"}
FAST = {"moe_impl": "pallas", "topk_impl": "pallas", "sparse_attn_impl": "pallas", "sinkhorn_impl": "pallas",
        "linear_impl": "pallas", "indexer_impl": "pallas", "router_impl": "pallas", "latents_impl": "pallas",
        "collapse_impl": "pallas"}
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
# The latents kernel (thirty-ninth session, built without a GPU) and the collapse-and-norm kernel (fortieth) joined
# in the fortieth session (H100, 2026-12-06, docs/benchmarks.md): their GPU checks pass, and GPU parity of
# tiny-nodrop with every kernel on gave the figures of the runs with either one off (tier 1 0.00793 / 0.0108 /
# 0.0739 with and without the collapse kernel; every failure the issue-8 prefix rows).
AUTO_ON_GPU: dict[str, str] = dict(FAST)
# each option's implementations: its module's own list
OPTION_IMPLS = {"moe_impl": routed_experts.IMPLS, "topk_impl": topk.IMPLS, "sparse_attn_impl": sparse_attn.IMPLS,
                "sinkhorn_impl": sinkhorn.IMPLS, "linear_impl": fp8_linear.IMPLS, "indexer_impl": indexer.IMPLS,
                "router_impl": router.IMPLS, "latents_impl": latents.IMPLS, "collapse_impl": collapse.IMPLS}


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
