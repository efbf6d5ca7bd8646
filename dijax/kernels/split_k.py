"""Split K (flash-decoding style): when a kernel's output tiles are too few to fill the GPU, each tile's K range is
cut into parts run by separate programs, whose fp32 partial sums are added afterwards (in XLA). Used by the fp8
linear and the routed experts' grouped GEMM."""

from __future__ import annotations


def k_splits(programs: int, n_slices: int, target: int) -> int:
    """The fewest parts of ``n_slices`` K slices (a divisor of it) giving ``programs * parts >= target``."""
    for parts in range(1, n_slices + 1):
        if n_slices % parts == 0 and programs * parts >= target:
            return parts
    return n_slices
