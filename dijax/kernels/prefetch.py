"""Loops whose loads run one step ahead, inside Triton-lowered Pallas kernels.

Triton's software pipeliner only schedules loads that feed a dot. A kernel loop without a dot (a streaming pass
over a row, the sum of a projection's parts, a mat-vec of fp32 FMAs) therefore waits out one memory round trip in
every step. ``fori_loop_ahead`` carries the next step's loaded values through the loop, so the load of step i + 1
is issued before step i's work and its latency hides behind that work. On an H100 this took the sampler's
thresholds kernel from 604 to 481 us at one block size, and with wider blocks to 305 us (docs/benchmarks.md,
forty-first session).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def fori_loop_ahead(steps, load: Callable[[Any], Any], body: Callable[[Any, Any, Any], Any], init: Any,
                    ahead: bool = True) -> Any:
    """``fori_loop(0, steps, lambda i, acc: body(i, load(i), acc), init)``; with ``ahead`` each step issues
    ``load(i + 1)`` before ``body``. ``load(steps)`` then runs too, so it must be safe one past the last step (a
    masked or a clamped load)."""
    if not ahead:
        return jax.lax.fori_loop(0, steps, lambda i, acc: body(i, load(i), acc), init)

    def step(i, carry):
        acc, loaded = carry
        next_loaded = load(i + 1)
        return body(i, loaded, acc), next_loaded

    return jax.lax.fori_loop(0, steps, step, (init, load(0)))[0]
