"""How fast a Mosaic GPU pipeline streams the routed experts' MXFP4 words when it does nothing else: no decode, no
wgmma, each step's word tile only XOR-ed into registers. Two weight layouts, at decode's shapes:

  * ``rows``: the stored layout (``routed_experts.pack_words``, [E * F, K / 8] words). A step's tile is 16 words
    (64 bytes) of each of 128 rows, rows 2560 bytes apart at K = 5120: what ``fp4_wgmma``'s TMA copies read (its
    two 32-byte chunks a step side by side);
  * ``tiles``: the same words re-laid so that each step's [128, 16] tile is 8 KB contiguous in memory.

    PYTHONPATH=. python3 tools/stream_probe.py [--experts 64] [--rows 2304] [--k 5120] [--stages 2,4,8]

Why (thirty-fifth session, H100): at decode ``fp4_wgmma`` streams its weights at ~1.0-1.1 TB/s of the card's 3.35
whatever its depth, chunks or warpgroups (docs/benchmarks.md); XLA's plain XOR-reduction of the same words took
~1.8 TB/s. If ``rows`` alone is slow and ``tiles`` fast, the weights' layout (64-byte pieces of rows far apart)
bounds every decode kernel that reads them, and a tiled layout at load time is the fix; if both are fast, the
decode and wgmma are what to shorten. Each row is the median of ``--iters`` calls' wall time after a warm-up, and
its TB/s counts the words once. ``--interpret`` runs small shapes in the Mosaic GPU interpreter and checks the
XOR against numpy (the CPU test does this).

Letters: R weight rows (E * F), W = K / 8 words a row, S = W / 16 pipeline steps, M = R / 128 row blocks.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from dijax.kernels.fp4_wgmma import ROWS_PER_WG  # noqa: E402

WORDS = 16  # words a row a step: fp4_wgmma's two 64-code chunks
LAYOUTS = ("rows", "tiles")


def tiled(w_RW: jax.Array, warpgroups: int) -> jax.Array:
    """The ``tiles`` layout: [M, S, 128, 16] (M row blocks of ``warpgroups`` * 64 rows) from [R, W]."""
    rows = warpgroups * ROWS_PER_WG
    r, w = w_RW.shape
    return w_RW.reshape(r // rows, rows, w // WORDS, WORDS).transpose(0, 2, 1, 3)


def reference(w_RW: np.ndarray, warpgroups: int) -> np.ndarray:
    """What either kernel returns: each row block's step tiles XOR-ed together, uint32 [M, rows, 16]."""
    t = np.asarray(tiled(jnp.asarray(w_RW), warpgroups))
    return np.bitwise_xor.reduce(t, axis=1)


@functools.partial(jax.jit, static_argnames=("layout", "stages", "warpgroups", "interpret"))
def stream(w: jax.Array, *, layout: str, stages: int = 4, warpgroups: int = 2, interpret: bool = False) -> jax.Array:
    """The probe kernel: ``w`` uint32 [R, W] (``rows``) or ``tiled(w)`` (``tiles``) -> uint32 [M, rows, 16]."""
    if layout not in LAYOUTS:
        raise ValueError(f"stream_probe: layout must be one of {LAYOUTS}, got {layout!r}")
    cta_rows = warpgroups * ROWS_PER_WG
    m_blocks, steps = (w.shape[0] // cta_rows, w.shape[1] // WORDS) if layout == "rows" else w.shape[:2]
    transforms = (plgpu.TilingTransform((8, WORDS)), plgpu.SwizzleTransform(4 * WORDS))

    def kernel(w_gmem, y_gmem, y_smem):
        m = lax.axis_index("m")

        def step(_, w_smem, acc):
            wg = lax.axis_index("wg")
            tile = w_smem.at[pl.ds(wg * ROWS_PER_WG, ROWS_PER_WG)] if layout == "rows" else \
                w_smem.at[0, pl.ds(wg * ROWS_PER_WG, ROWS_PER_WG)]
            return acc ^ plgpu.load(tile, layout=plgpu.Layout.WGMMA)

        def epilogue(run_pipeline):
            acc = run_pipeline(plgpu.layout_cast(jnp.zeros((ROWS_PER_WG, WORDS), jnp.uint32), plgpu.Layout.WGMMA))
            wg = lax.axis_index("wg")
            y_smem[wg] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(y_smem.at[wg], y_gmem.at[m, pl.ds(wg * ROWS_PER_WG, ROWS_PER_WG)])
            plgpu.wait_smem_to_gmem(0)

        if layout == "rows":
            spec = plgpu.BlockSpec((cta_rows, WORDS), lambda s: (0, s), transforms=transforms)
            source = w_gmem.at[pl.ds(m * cta_rows, cta_rows)]
        else:
            spec = plgpu.BlockSpec((1, cta_rows, WORDS), lambda s: (s, 0, 0), transforms=transforms)
            source = w_gmem.at[m]
        plgpu.emit_pipeline_warp_specialized(
            step, grid=(steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=warpgroups,
            max_concurrent_steps=stages, compute_context=epilogue, in_specs=[spec])(source)

    run = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((m_blocks, cta_rows, WORDS), jnp.uint32), grid=(m_blocks,),
        grid_names=("m",), num_threads=warpgroups + 1, thread_name="wg",
        scratch_types=dict(y_smem=plgpu.SMEM((warpgroups, ROWS_PER_WG, WORDS), jnp.uint32)),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    return run(w)


def _time(fn, *args, iters: int) -> float:
    """Median wall seconds of ``fn(*args)`` over ``iters`` calls after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--rows", type=int, default=2304, help="F: weight rows an expert")
    parser.add_argument("--k", type=int, default=5120, help="K: codes a row (8 a word)")
    parser.add_argument("--stages", default="2,4,8")
    parser.add_argument("--warpgroups", default="1,2")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--interpret", action="store_true", help="small shapes, interpreted, checked against numpy")
    args = parser.parse_args(argv)
    if args.interpret:
        w = np.random.default_rng(0).integers(0, 2 ** 32, (256, 64), dtype=np.uint32)
        for layout in LAYOUTS:
            data = jnp.asarray(w) if layout == "rows" else tiled(jnp.asarray(w), 2)
            got = np.asarray(stream(data, layout=layout, stages=2, interpret=True))
            np.testing.assert_array_equal(got, reference(w, 2))
        print("stream_probe: both layouts give numpy's XOR (interpreted)")
        return 0
    r, words = args.experts * args.rows, args.k // 8
    w = jax.random.bits(jax.random.key(0), (r, words), jnp.uint32)
    gb = r * words * 4 / 1e9
    print(f"stream_probe: {jax.devices()[0].device_kind}, {r} rows x {words} words ({gb:.3f} GB)")
    print("| layout | warpgroups | stages | us | TB/s |\n|---|---:|---:|---:|---:|")
    xor_all = jax.jit(lambda v: jnp.bitwise_xor.reduce(v, axis=1))
    seconds = _time(xor_all, w, iters=args.iters)
    print(f"| XLA xor-reduce of the rows | | | {seconds * 1e6:.1f} | {gb / seconds / 1e3:.2f} |")
    for warpgroups in (int(v) for v in args.warpgroups.split(",")):
        data = {"rows": w, "tiles": jax.block_until_ready(tiled(w, warpgroups))}
        for layout in LAYOUTS:
            for stages in (int(v) for v in args.stages.split(",")):
                fn = functools.partial(stream, layout=layout, stages=stages, warpgroups=warpgroups)
                seconds = _time(fn, data[layout], iters=args.iters)
                print(f"| {layout} | {warpgroups} | {stages} | {seconds * 1e6:.1f} | {gb / seconds / 1e3:.2f} |",
                      flush=True)
        del data
    return 0


if __name__ == "__main__":
    sys.exit(main())
