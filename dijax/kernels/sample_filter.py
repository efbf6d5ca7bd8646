"""The sampler's top-k / top-p thresholds over rows of a vocabulary: radix descents in XLA (the reference) and one
Triton-lowered program a row (the kernel), with the same signature.

The filter (``dijax.runtime.sampler``) keeps, of each row of scaled logits, the entries at or above a threshold:
top-k's, the k-th largest value (top_k 0: off), then top-p's on what top-k left, the smallest value whose own
probability and everything above it reach top_p (top_p >= 1: off; never above the row's largest value, so a top_p
that rounds to 0 keeps the most likely token). Both forms return it as a uint32 order key (``filter_keys``: the
float total order, with -0.0 read as +0.0, where a sort's compares see two equal values); the row keeps the entries
whose key is at or above it.

* ``thresholds_reference``: two descents of ``topk.largest_reaching`` (``DESCENT``: 2-bit digits laid out before
  the keys; each pass reads the whole [R, V] array: ~100 launches, compiled for an H100). On an H100 at V4.1's
  vocabulary the sample mode took 265 / 781 us at 16 / 64 rows with it, against 557 / 1186 with a sort
  (docs/benchmarks.md, thirty-seventh session).
* ``thresholds_pallas``: the same descents in one program a row, which streams its row from memory once a pass
  (the maximum, the top-k descent, the kept mass, the top-p descent: at most 2 + 2 * 32 / bits passes) and skips a
  descent whose filter is off. Its work a row does not grow with the rows, so a step of 64 rows costs what one
  costs while 64 programs fit the GPU at once. The sampler takes it from 64 rows on a GPU (``sampler.MANY_ROWS``).
  Triton pipelines only loads that feed a dot, so a pass's steps each waited out a memory round trip: 2048 lanes
  a step, 586 / 604 us at 16 / 64 rows of V4.1's vocabulary (H100, GPU kernel time, forty-first session). Loading
  the next block before working on this one (``FilterConfig.prefetch``) and 8192 lanes a step over 16 warps took
  that to 305 / 305 us (4-bit digits: 4.5-10 ms, spilled; 16384 lanes: 1.0-1.3 ms).

The two sum the top-p mass in different orders (and the kernel compares the unnormalised mass against top_p times
the total): their thresholds can differ only where a mass lands within float32 rounding of top_p.

Letters: R rows, V vocabulary; in the kernel B the lanes of a block.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dijax.kernels import interpret_mode
from dijax.kernels.prefetch import fori_loop_ahead
from dijax.kernels.topk import INT32_MIN, largest_reaching, order_key, signed_key

IMPLS = ("reference", "pallas")
# the reference's descents (topk.largest_reaching): 2-bit digits laid out before the keys measured fastest of
# {4, 2, 1} bits x both layouts at 64 rows (781 us against 953 for 4-bit digits innermost), 7 % slower at 16
DESCENT = {"bits": 2, "digits_major": True}


def filter_keys(scaled_RV: jax.Array) -> jax.Array:
    """uint32 order keys of float32 scaled logits [..., V], -0.0 read as +0.0 (``topk.order_key``)."""
    return order_key(jnp.where(scaled_RV == 0, 0.0, scaled_RV))


def thresholds_reference(scaled_RV: jax.Array, top_k_R: jax.Array, top_p_R: jax.Array) -> jax.Array:
    """The filter's threshold of each row as a ``filter_keys`` key, uint32 [R]: top-k's (the top_k-th largest key;
    0, keeping everything, where top_k is 0 or above V), then top-p's on the entries top-k kept (the largest key
    whose kept probability at or above it reaches top_p, clipped to [top-k's, the row's largest]) unless top_p >= 1.
    scaled_RV float32 [R, V]; top_k_R int32 [R]; top_p_R float32 [R]."""
    key_RV = filter_keys(scaled_RV)
    top_R = jnp.max(key_RV, axis=1)
    kth_R = jnp.where(top_k_R > 0, largest_reaching(key_RV, top_k_R, **DESCENT), np.uint32(0))
    weight_RV = jnp.where(key_RV >= kth_R[:, None], jnp.exp(scaled_RV - jnp.max(scaled_RV, axis=1, keepdims=True)),
                          0.0)
    mass_RV = weight_RV / jnp.sum(weight_RV, axis=1, keepdims=True)
    nucleus_R = jnp.clip(largest_reaching(key_RV, top_p_R, mass_RV, **DESCENT), kth_R, top_R)
    return jnp.where(top_p_R >= 1, kth_R, nucleus_R)


@dataclass(frozen=True)
class FilterConfig:
    """Tiling of ``thresholds_pallas``: ``block`` lanes a step of a pass (a power of two), ``bits`` a descent's
    digit (1, 2 or 4: 2 ** bits - 1 compares a key a pass), ``num_warps`` / ``num_stages`` the Triton program's,
    ``prefetch``: each step of a pass loads the next block before it works on its own
    (``dijax.kernels.prefetch``). 2-bit digits keep a pass near one compare-and-add a key per candidate.
    Defaults: the fastest of ``tools/bench_kernels.py --only sampler --sweep``'s tilings on an H100 (module
    docstring)."""

    block: int = 8192
    bits: int = 2
    num_warps: int = 16
    num_stages: int = 3
    prefetch: bool = True

    def __post_init__(self):
        if self.block < 16 or self.block & (self.block - 1):
            raise ValueError(f"FilterConfig.block must be a power of two >= 16, got {self.block}")
        if self.bits not in (1, 2, 4):
            raise ValueError(f"FilterConfig.bits must be 1, 2 or 4, got {self.bits}")


CONFIG = FilterConfig()


def _kernel(x_ref, top_k_ref, top_p_ref, out_ref, *, width: int, block: int, bits: int, prefetch: bool):
    """Program r: row r's threshold (``thresholds_reference``) into ``out_ref[r]`` as int32 bits.

    Keys are signed int32 (``topk.signed_key``: the unsigned key shifted by 2^31, so signed compares order them);
    the descents build their prefixes as unsigned bit patterns in int32 and compare through ``^ INT32_MIN``. Lanes
    past V read as the lowest key, which no candidate digit (>= 1) reaches."""
    r = pl.program_id(0)
    blocks = pl.cdiv(width, block)
    lane_B = jnp.arange(block, dtype=jnp.int32)
    digits = (1 << bits) - 1
    passes = np.int32(32 // bits)  # typed: a loop bound the lowering must not narrow

    def load(b):
        """Block b of the row, float32 [B] (0 past the row: a block past the last loads nothing). ``r * 0``: a
        traced start, so that block 0 of a row shorter than a block is a masked load, not a constant out-of-bounds
        slice at trace time."""
        return pltriton.load(x_ref.at[r, pl.ds(b * block + r * 0, block)], mask=b * block + lane_B < width,
                             other=0.0)

    def stream(fold, init):
        """``fold(acc, x_B, key_B, live_B)`` over the row's blocks in order (a pass); with ``prefetch`` each step
        issues the next block's load before its own work (``prefetch.fori_loop_ahead``)."""
        def work(b, x_B, acc):
            live_B = b * block + lane_B < width
            key_B = jnp.where(live_B, signed_key(jnp.where(x_B == 0, 0.0, x_B)), INT32_MIN)
            return fold(acc, x_B, key_B, live_B)

        return fori_loop_ahead(blocks, load, work, init, ahead=prefetch)

    def row_max(carry, x_B, key_B, live_B):
        key_max_B, x_max_B = carry
        return jnp.maximum(key_max_B, key_B), jnp.maximum(x_max_B, jnp.where(live_B, x_B, -jnp.inf))

    key_max_B, x_max_B = stream(row_max, (jnp.full((block,), INT32_MIN, jnp.int32),
                                          jnp.full((block,), -jnp.inf, jnp.float32)))
    top_s, x_max = jnp.max(key_max_B), jnp.max(x_max_B)

    def descend(count, measure, target, dtype):
        """The largest unsigned prefix whose ``measure`` (per lane, for the keys at or above a candidate) reaches
        ``target``, in ``count`` passes (0: prefix 0)."""
        def one_pass(i, prefix_u):
            shift = 32 - bits * (i + 1)
            cand_s = [(prefix_u | jnp.left_shift(np.int32(d), shift)) ^ INT32_MIN for d in range(1, digits + 1)]
            acc = stream(lambda acc, *block_values: [a + m for a, m in zip(acc, measure(*block_values, cand_s))],
                         [jnp.zeros((block,), dtype)] * digits)
            digit = np.int32(0)
            for d, a in enumerate(acc, 1):  # the reach falls as the digit grows: the last that reaches is largest
                digit = jnp.where(jnp.sum(a) >= target, np.int32(d), digit)
            return prefix_u | jnp.left_shift(digit, shift)

        return jax.lax.fori_loop(0, count, one_pass, np.int32(0))

    top_k, top_p = top_k_ref[r], top_p_ref[r]
    kth_u = descend(jnp.where((top_k > 0) & (top_k <= width), passes, np.int32(0)),
                    lambda x_B, key_B, live_B, cand_s: [(key_B >= c).astype(jnp.int32) for c in cand_s],
                    top_k, jnp.int32)
    kth_s = kth_u ^ INT32_MIN

    def kept_weight(x_B, key_B, live_B):
        return jnp.where(live_B & (key_B >= kth_s), jnp.exp(x_B - x_max), 0.0)

    total = jnp.sum(stream(lambda total_B, *block_values: total_B + kept_weight(*block_values),
                           jnp.zeros((block,), jnp.float32)))

    def mass_above(x_B, key_B, live_B, cand_s):
        weight_B = kept_weight(x_B, key_B, live_B)  # one exp a key, shared by the candidates
        return [jnp.where(key_B >= c, weight_B, 0.0) for c in cand_s]

    nucleus_u = descend(jnp.where(top_p < 1, passes, np.int32(0)), mass_above, top_p * total, jnp.float32)
    # clipped to [kth, top] in the unsigned order (compared as signed keys)
    nucleus_s = jnp.minimum(jnp.maximum(nucleus_u ^ INT32_MIN, kth_s), top_s)
    out_ref[r] = jnp.where(top_p >= 1, kth_s, nucleus_s) ^ INT32_MIN


def thresholds_pallas(scaled_RV: jax.Array, top_k_R: jax.Array, top_p_R: jax.Array, *,
                      config: FilterConfig | None = None, interpret: bool | None = None) -> jax.Array:
    """``thresholds_reference`` in one Triton-lowered program a row (module docstring): uint32 [R]. ``config``
    default ``CONFIG``; ``interpret`` runs the Pallas interpreter (default: off a GPU)."""
    config = config or CONFIG
    rows, width = scaled_RV.shape
    if rows == 0:
        return jnp.zeros((0,), jnp.uint32)
    if rows * -(-width // config.block) * config.block >= 1 << 31:
        raise ValueError(f"thresholds_pallas: {rows} rows of {width} values need int32 offsets past 2^31")
    bits_R = pl.pallas_call(
        functools.partial(_kernel, width=width, block=config.block, bits=config.bits,
                          prefetch=config.prefetch),
        grid=(rows,),
        out_shape=jax.ShapeDtypeStruct((rows,), jnp.int32),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret_mode(interpret),
        name="sample_filter_thresholds",
    )(scaled_RV.astype(jnp.float32), top_k_R.astype(jnp.int32), top_p_R.astype(jnp.float32))
    return jax.lax.bitcast_convert_type(bits_R, jnp.uint32)


_IMPLEMENTATIONS = {"reference": thresholds_reference, "pallas": thresholds_pallas}


def thresholds(scaled_RV: jax.Array, top_k_R: jax.Array, top_p_R: jax.Array, *, impl: str = "reference"
               ) -> jax.Array:
    """The filter's thresholds (``thresholds_reference``) by ``impl``, one of ``IMPLS``: uint32 [R]."""
    if impl not in _IMPLEMENTATIONS:
        raise ValueError(f"sample_filter: impl must be one of {IMPLS}, got {impl!r}")
    return _IMPLEMENTATIONS[impl](scaled_RV, top_k_R, top_p_R)
