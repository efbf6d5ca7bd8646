"""The Mosaic GPU kernels lowered for CUDA on a machine without a GPU: every Pallas -> Mosaic GPU lowering rule and
layout inference run before any device time is spent (docs/mosaic_gpu.md's second method).

    PYTHONPATH=.:.venv/mosaic-lowering .venv/bin/python tools/mgpu_lower.py   # the venv's jax (tools/setup.sh)

    python3 -m venv /tmp/mg && /tmp/mg/bin/pip install "jax==X" "jaxlib==X" numpy      # X: the GPU machine's jax
    /tmp/mg/bin/pip install --no-deps "jax-cuda13-plugin==X"     # only for its _mosaic_gpu_ext; not a dijax dependency
    PYTHONPATH=. /tmp/mg/bin/python tools/mgpu_lower.py

The first form is tests/test_mosaic_lowering.py's (CI: the newest jax); the second checks the GPU machine's jax.

It lowers ``dijax.kernels.fp4_wgmma`` at small and real shapes (every tile size and K-chunk form the routed path
uses), ``dijax.kernels.fp8_wgmma`` at the decode linears' shapes, ``dijax.kernels.sparse_attn_mgpu`` at small and
decode shapes, then the routed experts' ragged path with ``gemm_engine='mgpu'`` (its Triton and XLA parts too). It
stops before PTX: tools/mgpu_build.py goes on to ptxas and SASS; the numerics and the speed need the GPU
(tests/gpu/test_fp4_wgmma_gpu.py, tests/gpu/test_fp8_wgmma_gpu.py, tests/gpu/test_attention_gpu.py,
tools/bench_kernels.py --only fp4_wgmma / sparse_attn). In the twenty-eighth session every error this caught would
otherwise have cost a device call, and each kernel that lowered here ran correctly on its first GPU run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import tempfile
import typing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dijax.kernels import fp4_wgmma, fp8_wgmma, indexer_mgpu, lowering_for_gpu, row_gather  # noqa: E402
from dijax.kernels import sparse_attn_mgpu  # noqa: E402
from dijax.kernels import routed_experts as rx  # noqa: E402

# (experts, F, K, tile sizes, chunks): the GPU test's shapes, the real gate-up and down with the routed path's
# fitted sizes (rx.CONFIG.mgpu_sizes), decode's one size (8,), the smallest wgmma N, one compute warpgroup a CTA,
# a step's last wgmma overlapping the next step
KERNEL_SHAPES = [(3, 256, 512, (128,), 2), (3, 256, 512, (128,), 1), (2, 4608, 5120, rx.CONFIG.mgpu_sizes, 2),
                 (2, 5120, 2304, rx.CONFIG.mgpu_sizes, 2), (2, 5120, 2304, (64,), 2), (2, 2304, 5120, (8,), 2),
                 (2, 5120, 2304, (8,), 2), (1, 256, 256, (8,), 1), (2, 2304, 5120, (8,), 2, 1),
                 (1, 64, 256, (16,), 1, 1),
                 (2, 4608, 5120, rx.CONFIG.mgpu_sizes, 2, 2, True)]


def lower_kernel(n_experts: int, f: int, k: int, sizes: tuple[int, ...], chunks: int, warpgroups: int = 2,
                 overlap: bool = False) -> int:
    """Lower one ``grouped_gemm_t_mgpu`` for CUDA from abstract operands; -> the StableHLO text's length."""
    n_tiles = 4
    shapes = (jax.ShapeDtypeStruct((n_experts, f, k // 8), jnp.uint32),
              jax.ShapeDtypeStruct((n_experts, f, k // 32), jnp.uint8),
              jax.ShapeDtypeStruct((n_tiles * max(sizes), k), jnp.bfloat16),
              jax.ShapeDtypeStruct((n_tiles, 3), jnp.int32))
    fn = functools.partial(fp4_wgmma.grouped_gemm_t_mgpu, sizes=sizes, chunks=chunks, warpgroups=warpgroups,
                           overlap=overlap)
    return len(jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text())


# (T, O, I, warpgroups): the fp8 linears at decode (wkv, wq_b, wo_b with two warpgroups, the Engram wkv), small dims
LINEAR_SHAPES = [(1, 512, 5120, 1), (16, 32768, 1280, 1), (8, 5120, 8192, 2), (64, 25600, 6144, 1), (3, 64, 256, 1)]


def lower_linear(t: int, o: int, i: int, warpgroups: int) -> int:
    """Lower one ``fp8_wgmma.linear_mgpu`` for CUDA from abstract operands; -> the StableHLO text's length."""
    shapes = (jax.ShapeDtypeStruct((t, i), jnp.bfloat16), jax.ShapeDtypeStruct((o, i), jnp.float8_e4m3fn),
              jax.ShapeDtypeStruct((o // 32, i // 32), jnp.uint8))
    fn = functools.partial(fp8_wgmma.linear_mgpu, warpgroups=warpgroups)
    return len(jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text())


class AttnShape(typing.NamedTuple):
    """One ``sparse_attn_mgpu`` configuration lowered here: T tokens of H heads of K dims over source tables of
    ``sizes`` rows, index lists of L = ``length`` entries in ``splits`` splits; the rest are the kernel's own
    options (``clusters``: its ``cluster_splits``; ``timeline``: a ``trace_dir``; ``shared``: ``shared_scores``;
    ``wide``: ``wide_merge``)."""
    t: int
    h: int
    k: int
    sizes: tuple[int, ...]
    length: int
    splits: int
    clusters: tuple[int, ...] = sparse_attn_mgpu.CLUSTER_SPLITS
    pdl: bool = False
    timeline: bool = False
    shared: bool = True
    dim_splits: int = 1
    wide: bool = False


THREE = (4096, 64, 20000)  # decode's three sources: the window ring, this step's rows, the compressed pool
# A small shape over two sources, decode at 64 tokens (two splits over one source; one and two over three), two head
# groups at K = 256, the tiny model's 4 heads of 64 (one warpgroup); two splits merge across a cluster (the default),
# four in clusters of four, five in XLA; one launched as a programmatic dependent; decode at 64 tokens recording its
# timeline (Mosaic GPU's on-device profiler) over one and three sources; each warpgroup computing the scores itself
# (unshared); the output dims split over two CTAs at 64 tokens (one split), one token (ten splits merged in XLA) and
# K = 128 (two splits in a cluster); the cluster merge's 16-byte loads at 64 tokens in pairs and at 32 in clusters of
# four, and with two dim splits at 64 tokens (its tiles 64 wide)
ATTN_SHAPES = [AttnShape(2, 64, 128, (40, 300), 150, 2), AttnShape(64, 64, 512, (8192,), 640, 2),
               AttnShape(64, 64, 512, THREE, 640, 1), AttnShape(64, 64, 512, THREE, 640, 2),
               AttnShape(64, 64, 512, THREE, 640, 2, shared=False),
               AttnShape(3, 128, 256, (500,), 64, 1), AttnShape(7, 4, 64, (32, 7, 200), 300, 2),
               AttnShape(1, 64, 512, (8192,), 640, 5),
               AttnShape(32, 64, 512, (8192,), 640, 4, clusters=sparse_attn_mgpu.CLUSTER_SIZES),
               AttnShape(1, 64, 512, (8192,), 640, 2, pdl=True),
               AttnShape(64, 64, 512, (8192,), 640, 2, timeline=True),
               AttnShape(64, 64, 512, THREE, 640, 1, timeline=True),
               AttnShape(64, 64, 512, (8192,), 640, 2, shared=False),
               AttnShape(64, 64, 512, THREE, 640, 1, shared=False),
               AttnShape(64, 64, 512, THREE, 640, 1, dim_splits=2),
               AttnShape(1, 64, 512, THREE, 640, 10, dim_splits=2),
               AttnShape(3, 64, 128, (40, 300), 150, 2, dim_splits=2),
               AttnShape(64, 64, 512, (8192,), 640, 2, wide=True),
               AttnShape(32, 64, 512, (8192,), 640, 4, clusters=sparse_attn_mgpu.CLUSTER_SIZES, wide=True),
               AttnShape(64, 64, 512, THREE, 640, 2, dim_splits=2, wide=True)]


def lower_attention(*fields) -> int:
    """Lower one ``sparse_attn_mgpu.sparse_attn_mgpu`` for CUDA from abstract operands (``fields``: an
    ``AttnShape``'s, in order; the timeline's ``trace_dir`` is never written to here); -> the StableHLO text's
    length."""
    t, h, k, sizes, length, splits, clusters, pdl, timeline, shared, dim_splits, wide = AttnShape(*fields)
    shapes = (jax.ShapeDtypeStruct((t, h, k), jnp.bfloat16),
              tuple(jax.ShapeDtypeStruct((n, k), jnp.bfloat16) for n in sizes),
              jax.ShapeDtypeStruct((t, length), jnp.int32), jax.ShapeDtypeStruct((h,), jnp.float32))
    fn = functools.partial(sparse_attn_mgpu.sparse_attn_mgpu, softmax_scale=0.1, splits=splits,
                           cluster_splits=clusters, pdl=pdl, shared_scores=shared, dim_splits=dim_splits,
                           wide_merge=wide, trace_dir=tempfile.gettempdir() if timeline else "")
    with no_host_callbacks() if timeline else contextlib.nullcontext():
        return len(jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text())


@contextlib.contextmanager
def no_host_callbacks():
    """``jax.debug.callback`` as nothing: a kernel's on-device timeline is written by a host callback after each
    call, which cannot lower for CUDA on a machine without a GPU (nothing runs here, so nothing is lost)."""
    saved = jax.debug.callback
    jax.debug.callback = lambda *args, **kwargs: None
    try:
        yield
    finally:
        jax.debug.callback = saved


GATHER_SHAPES = [(512, (300, 5000), 2), (64, (40, 7, 200), 1), (128, (1000,), 1)]  # (K, source rows, parts)


def lower_gather(k: int, sizes: tuple[int, ...], parts: int) -> int:
    """Lower ``row_gather.gather_rows_mgpu`` (the row gather alone, for its GPU test) for CUDA; -> the StableHLO
    text's length."""
    shapes = (tuple(jax.ShapeDtypeStruct((n, k), jnp.bfloat16) for n in sizes), jax.ShapeDtypeStruct((192,), jnp.int32))
    fn = functools.partial(row_gather.gather_rows_mgpu, parts=parts)
    return len(jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text())


# (T, I, J, sequences, P, blocks[, warpgroups]): a prefill of 8192 tokens over 2048 positions, 64 decode rows over
# 4096, a small shape with one block a chunk, fewer tokens than a tile; the prefill and the small shape again with
# two warpgroups a CTA (the second idle in the small one)
INDEXER_SHAPES = [(8192, 32, 128, 1, 2048, 8), (64, 32, 128, 64, 4096, 8), (30, 8, 64, 4, 130, 1),
                  (3, 32, 128, 1, 256, 2), (8192, 32, 128, 1, 2048, 8, 2), (30, 8, 64, 4, 130, 1, 2)]


def lower_indexer(t: int, i: int, j: int, s: int, p: int, blocks: int,
                  warpgroups: int = indexer_mgpu.WARPGROUPS) -> int:
    """Lower one ``indexer_mgpu.index_scores_mgpu`` for CUDA from abstract operands; -> the StableHLO text's
    length."""
    shapes = (jax.ShapeDtypeStruct((t, i, j), jnp.bfloat16), jax.ShapeDtypeStruct((t, i), jnp.bfloat16),
              jax.ShapeDtypeStruct((s * p, j), jnp.bfloat16), jax.ShapeDtypeStruct((s, p), jnp.int32),
              jax.ShapeDtypeStruct((t,), jnp.int32), jax.ShapeDtypeStruct((t,), jnp.int32))
    fn = functools.partial(indexer_mgpu.index_scores_mgpu, blocks=blocks, warpgroups=warpgroups)
    return len(jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text())


def lower_routed(n_experts: int = 8, d: int = 512, f: int = 256, tokens: int = 64, per_token: int = 4) -> int:
    """Lower the routed experts' ragged path with ``gemm_engine='mgpu'`` for CUDA (``gathered_max=0`` and
    ``mgpu_min_assignments=0``, so few tokens take it too); -> the number of Mosaic GPU kernels in it (two: w1 and w3
    share one lowered kernel of their shape, w2 has its own)."""
    rng = np.random.default_rng(0)

    def draw(out_dim, in_dim):
        return {"weight": jnp.asarray(rng.integers(0, 256, (n_experts, out_dim, in_dim // 2)), jnp.uint8),
                "scale": jnp.asarray(rng.integers(116, 122, (n_experts, out_dim, in_dim // 32)), jnp.uint8)}

    experts = {"w1": draw(f, d), "w3": draw(f, d), "w2": draw(d, f)}
    x = jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16)
    ids = jnp.asarray(np.sort(np.stack([rng.choice(n_experts, per_token, replace=False) for _ in range(tokens)]), 1),
                      jnp.int32)
    weights = jnp.full(ids.shape, 1 / per_token, jnp.float32)
    config, available = rx.CONFIG, fp4_wgmma.available
    rx.CONFIG = dataclasses.replace(config, gemm_engine="mgpu", gathered_max=0, mgpu_min_assignments=0)
    fp4_wgmma.available = lambda: True  # the abstract target is sm_90
    try:
        with lowering_for_gpu():
            text = jax.jit(rx.routed_experts_pallas, static_argnames=("limit", "path")).trace(
                experts, x, weights, ids, limit=7.0, path="ragged").lower(lowering_platforms=("cuda",)).as_text()
    finally:
        rx.CONFIG, fp4_wgmma.available = config, available
    return text.count("@mosaic_gpu")


def kernels() -> list[tuple[str, str, object, list]]:
    """(name, the shape's fields, its lowering function, the shapes) of every Mosaic GPU kernel lowered here
    (tools/mgpu_build.py builds the same list)."""
    return [("fp4_wgmma", "experts/F/K/sizes/chunks[/warpgroups/overlap]", lower_kernel, KERNEL_SHAPES),
            ("fp8_wgmma", "T/O/I/warpgroups", lower_linear, LINEAR_SHAPES),
            ("sparse_attn_mgpu", "(fields named)", lower_attention, ATTN_SHAPES),
            ("indexer_mgpu", "T/I/J/S/P/blocks[/warpgroups]", lower_indexer, INDEXER_SHAPES),
            ("row_gather.gather_rows_mgpu", "K/sources/parts", lower_gather, GATHER_SHAPES)]


def main() -> int:
    print(f"jax {jax.__version__}")
    failed = 0
    for name, fields, lower, shapes in kernels():
        for shape in shapes:
            try:
                print(f"{name} {fields} {shape}: lowered ({lower(*shape)} chars)")
            except Exception as error:  # noqa: BLE001 (every shape is reported)
                failed += 1
                print(f"{name} {shape}: FAILED {type(error).__name__}: {str(error)[-600:]}")
    for tokens in (64, 1):  # prefill-like (every size) and decode (one size)
        try:
            calls = lower_routed(tokens=tokens)
            print(f"routed experts, {tokens} tokens, gemm_engine='mgpu': lowered, {calls} Mosaic GPU kernels "
                  f"(2 expected)")
            failed += calls != 2
        except Exception as error:  # noqa: BLE001
            failed += 1
            print(f"routed experts, {tokens} tokens, gemm_engine='mgpu': FAILED {type(error).__name__}: "
                  f"{str(error)[-600:]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
