"""Kernel micro-benchmarks, kernels on and off in one process (DESIGN.md "Performance method").

    PYTHONPATH=. python3 tools/bench_kernels.py                  # every kernel's rows
    PYTHONPATH=. python3 tools/bench_kernels.py --only topk,sparse_attn --sweep

Each row times one jitted call: the best over ``--repeats`` of the mean of ``--iters`` back-to-back calls (so host
dispatch overlaps the device), after a warm-up call; ``--timing device`` takes the calls' GPU kernel time from a
profiler trace instead (``device_seconds``: no launches, no gaps; for rows of a few microseconds). Beside it, the
row's floor (bytes the kernel must move over the copy bandwidth, FLOPs over the bf16 matrix rate: ``BANDWIDTH`` and
``MATRIX_RATE``, the ceilings measured on a machine of the device's kind, ``tools/ceilings.py``) and the share of
it reached.
"""

from __future__ import annotations

import argparse
import ast
import functools
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dijax  # noqa: E402,F401  (sets XLA flags before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tools import trace_summary  # noqa: E402
from tools.ceilings import FALLBACK, MEASURED, ceilings  # noqa: E402

# the floors' ceilings: the H200's until main() sets the device's (tools/ceilings.py)
BANDWIDTH, MATRIX_RATE = MEASURED[FALLBACK][:2]
# --kernel-split: each device-timed row's kernels by name, seconds per call (``device_seconds`` keeps its trace's,
# ``time_call`` its best repeat's)
KERNEL_SPLIT = False
_last_split: dict[str, float] = {}


def time_call(fn, *args, iters: int = 20, repeats: int = 5, device: bool = False) -> float:
    """Seconds per call of ``fn(*args)``: the best over ``repeats`` of the mean of ``iters`` back-to-back calls;
    ``device``: of their GPU kernel time instead (``device_seconds``; the best repeat's kernels by name are left
    for ``--kernel-split``)."""
    jax.block_until_ready(fn(*args))
    best, split = float("inf"), {}
    for _ in range(repeats):
        if device:
            seconds = device_seconds(fn, *args, calls=iters)
            if seconds < best:
                best, split = seconds, dict(_last_split)
            _last_split.clear()
            _last_split.update(split)
            continue
        start = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def device_seconds(fn, *args, calls: int) -> float:
    """GPU kernel seconds per call of ``fn(*args)``: the kernels of the busiest GPU stream in a profiler trace of
    ``calls`` back-to-back calls (``tools/trace_summary.py``), their durations summed, over ``calls``. It leaves
    out launches and the gaps between kernels, which wall time cannot do for a few-microsecond call: in the
    twenty-seventh session one routed-experts configuration at one token timed 83-100 us by wall time across
    calls. RuntimeError when the trace has no GPU kernels (a CPU backend)."""
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            out = None
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
        stream = trace_summary.busiest_stream(*trace_summary.load_events(folder))
    if not stream:
        raise RuntimeError("device timing: the profiler trace has no GPU kernels (it needs a GPU backend)")
    _last_split.clear()
    for e in stream:
        _last_split[e["name"]] = _last_split.get(e["name"], 0.0) + e["dur"] * 1e-6 / calls
    return sum(e["dur"] for e in stream) * 1e-6 / calls


def _row(kernel: str, shape: str, impl: str, seconds: float, floor_bytes: float, base: float | None) -> dict:
    """A row whose floor is ``floor_bytes`` over the copy bandwidth."""
    return _timed_row(kernel, shape, impl, seconds, floor_bytes / BANDWIDTH, base)


def _timed_row(kernel: str, shape: str, impl: str, seconds: float, floor: float, base: float | None) -> dict:
    """A row against a floor in seconds; ``base``: the reference's seconds (None for the reference itself). With
    ``KERNEL_SPLIT`` it prints the row's kernels by name (device time per call, from the best repeat of the last
    device-timed call)."""
    if KERNEL_SPLIT and _last_split:
        parts = sorted(_last_split.items(), key=lambda kv: -kv[1])
        print(f"kernels of {kernel}, {shape}, {impl}: " + "; ".join(f"{n[:60]} {t * 1e6:.1f} us" for n, t in parts))
        _last_split.clear()
    return {"kernel": kernel, "shape": shape, "impl": impl, "us": seconds * 1e6, "floor_us": floor * 1e6,
            "floor_pct": 100 * floor / seconds, "speedup": (base / seconds) if base else 1.0}


def repeated(fn):
    """One jitted call that runs ``fn(x, *args)`` once per element of the argument lists (``zip(*lists)``): a
    kernel of a few microseconds timed as a step runs it, many calls in one executable, not one host dispatch
    each. -> the list of results."""
    return jax.jit(lambda x, *lists: [fn(x, *args) for args in zip(*lists)])


def topk_rows(rows_list=(1, 4, 64), width: int = 262_144, k: int = 512, sweep: bool = False, **timing) -> list[dict]:
    """Exact top-k of bf16-valued float32 score rows: ``lax.top_k`` against the threshold select (XLA) and the
    Pallas kernel. A row whose indices differ from ``lax.top_k``'s is marked MISMATCH.

    Floor: one read of the scores (4 bytes a value). ``sweep`` adds select variants (prefilter on / off), Pallas
    tilings (chunk length, warps, rank tile), shorter rows (where the dispatcher's hand-off to ``lax.top_k``
    belongs) and the select's stages alone.
    """
    from dijax.kernels import topk as topk_mod

    def pallas(config):
        return lambda s: topk_mod.topk_pallas(s, k, config=config)

    def select(s):
        return topk_mod.topk_select(s, k)

    variants = [("select", {}, select), ("pallas", {}, pallas(topk_mod.TopkConfig()))]
    if sweep:
        variants += [("select no-prefilter", {"PREFILTER_FACTOR": 1 << 30}, select),
                     ("select prefilter", {"PREFILTER_MIN_VALUES": 0}, select)]
        variants += [(f"pallas {label}", {}, pallas(topk_mod.TopkConfig(**fields))) for label, fields in (
            ("chunk=32", {"chunk": 32}), ("select_warps=4", {"select_warps": 4}),
            ("select_warps=16", {"select_warps": 16}), ("chunk=32 select_warps=16", {"chunk": 32, "select_warps": 16}),
            ("rank_tile=64", {"rank_tile": 64}), ("block_values=16384 max_warps=8",
                                                  {"block_values": 16_384, "max_warps": 8}))]
    shapes = [(rows, width) for rows in rows_list]
    if sweep:
        shapes += [(rows, short) for short in (8192, 32_768) for rows in (1, 64)]
    out = []
    for rows, cols in shapes:
        score = jax.random.normal(jax.random.key(rows), (rows, cols), jnp.bfloat16).astype(jnp.float32)
        shape = f"{rows} x {cols}, k={k}"
        base = time_call(jax.jit(lambda s: topk_mod.topk_reference(s, k)), score, **timing)
        out.append(_row("topk", shape, "lax.top_k", base, rows * cols * 4, None))
        want = topk_mod.topk_reference(score, k)[1]
        for name, consts, call in variants if cols == width else variants[:2]:
            saved = {c: getattr(topk_mod, c) for c in consts}
            for c, v in consts.items():
                setattr(topk_mod, c, v)
            try:
                fn = jax.jit(call)
                exact = bool(jnp.array_equal(want, fn(score)[1]))
                seconds = time_call(fn, score, **timing)
                out.append(_row("topk", shape, name + ("" if exact else " MISMATCH"), seconds, rows * cols * 4, base))
            finally:
                for c, v in saved.items():
                    setattr(topk_mod, c, v)
        if sweep and (rows, cols) == (max(rows_list), width):
            out += _topk_stage_rows(score, k, **timing)
    return out


def index_topk_rows(shapes=((1, 4096), (16, 4096), (64, 4096), (1024, 2048), (8192, 2048)), k: int = 512,
                    sweep: bool = False, **timing) -> list[dict]:
    """The index layers' selection (``model.attention.topk_positions``: the visible positions of the top-k set,
    ascending) on causal rows (a query sees a prefix of the row, -inf past it): the form before the twenty-third
    session (``lax.top_k``, a rank limit, a sort of the picks by position) against ``topk_ascending`` by each
    implementation, the select with its short-row hand-off to ``lax.top_k`` (``topk.SELECT_MIN_VALUES``) as it is
    and off.
    A row that differs from the old form is marked MISMATCH. Floor: one read of the scores."""
    from dijax.kernels import topk as topk_mod
    from dijax.model.attention import topk_positions

    def before(s, visible):  # the selection as it was: a rank limit of min(k, visible) and a sort
        _, picks = jax.lax.top_k(s, k)
        valid = (picks < visible[:, None]) & (jnp.arange(k)[None, :] < jnp.minimum(k, visible)[:, None])
        ordered = jnp.sort(jnp.where(valid, picks, jnp.iinfo(jnp.int32).max), axis=-1)
        return jnp.where(ordered == jnp.iinfo(jnp.int32).max, -1, ordered)

    variants = [("topk_positions reference", "reference", False), ("topk_positions select", "select", False),
                ("topk_positions select (all rows)", "select", True), ("topk_positions pallas", "pallas", False)]
    out = []
    for rows, width in shapes:
        score = jax.random.normal(jax.random.key(rows), (rows, width), jnp.bfloat16).astype(jnp.float32)
        visible = jnp.maximum(1, ((jnp.arange(rows) + 1) * width) // rows).astype(jnp.int32)
        score = jnp.where(jnp.arange(width)[None, :] < visible[:, None], score, -jnp.inf)
        shape, floor_bytes = f"{rows} x {width}, k={k}, causal", rows * width * 4
        old = jax.jit(before)
        want = old(score, visible)
        base = time_call(old, score, visible, **timing)
        out.append(_row("index top-k", shape, "top_k + rank limit + sort (before)", base, floor_bytes, None))
        for name, impl, every in variants:
            saved = topk_mod.SELECT_MIN_VALUES
            topk_mod.SELECT_MIN_VALUES = 0 if every else saved
            try:
                fn = jax.jit(lambda s, v, impl=impl: topk_positions(s, v, k, impl=impl))
                mark = "" if bool(jnp.array_equal(fn(score, visible), want)) else " MISMATCH"
                out.append(_row("index top-k", shape, name + mark, time_call(fn, score, visible, **timing),
                                floor_bytes, base))
            finally:
                topk_mod.SELECT_MIN_VALUES = saved
    return out


def _topk_stage_rows(score, k: int, **timing) -> list[dict]:
    """Time the select's stages alone on one score array (where the time goes; no floor)."""
    from dijax.kernels import topk as tk

    rows, width = score.shape
    key = jax.jit(tk.order_key)(score)
    maxima = jax.jit(lambda x: jnp.max(x.reshape(rows, -1, tk.CHUNK), axis=-1))(key)
    cand = key[:, :k * tk.CHUNK]
    cand_d = jnp.arange(1, 16, dtype=jnp.uint32)[None, :] << 20
    stages = {
        "order key + chunk max": (lambda x: jnp.max(tk.order_key(x).reshape(rows, -1, tk.CHUNK), axis=-1), score),
        "select on chunk maxima": (lambda m: tk._select_ascending(m, k), maxima),
        "kth on candidates": (lambda c: tk.largest_reaching(c, k), cand),
        "select on candidates": (lambda c: tk._select_ascending(c, k), cand),
        "one count pass, digits outer [R,D,N]": (
            lambda c: jnp.sum((c[:, None, :] >= cand_d[:, :, None]).astype(jnp.int32), -1), cand),
        "one count pass, digits inner [R,N,D]": (
            lambda c: jnp.sum((c[:, :, None] >= cand_d[:, None, :]).astype(jnp.int32), 1), cand),
        "cumsum on candidates": (lambda c: jnp.cumsum((c > 0).astype(jnp.int32), axis=1), cand),
        "sort k picks": (lambda c: jax.lax.sort((c[:, :k], jnp.broadcast_to(jnp.arange(k), (rows, k))), dimension=1,
                                                num_keys=1, is_stable=True), cand),
    }
    shape = f"{rows} x {width}, k={k}"
    return [_row("topk stage", shape, name, time_call(jax.jit(fn), arg, **timing), 0, None)
            for name, (fn, arg) in stages.items()]


def sparse_attn_inputs(batch: int, window: int = 128, topk: int = 512, heads: int = 64, dim: int = 512,
                       pool_rows_per_seq: int = 4096, reps: int = 1):
    """Decode sparse attention's inputs: (sources (ring bf16 [B window, K], new rows [B, K], pool [B pool, K]),
    sink float32 [H], ``reps`` steps' queries bf16 [B, H, K] and index lists int32 [B, window + topk]). Token b
    lists its ring's ``window - 1`` rows, its new row and ``topk`` sorted random rows of its own pool."""
    keys = jax.random.split(jax.random.key(batch), 4 + 2 * reps)
    ring = jax.random.normal(keys[0], (batch * window, dim), jnp.bfloat16)
    new = jax.random.normal(keys[1], (batch, dim), jnp.bfloat16)
    pool = jax.random.normal(keys[2], (batch * pool_rows_per_seq, dim), jnp.bfloat16)
    sink = jax.random.normal(keys[3], (heads,), jnp.float32)
    seq = jnp.arange(batch, dtype=jnp.int32)[:, None]
    ring_idx = seq * window + jnp.arange(window - 1, dtype=jnp.int32)[None, :]
    qs, idxs = [], []
    for r in range(reps):  # each step its own queries and compressed rows
        qs.append(jax.random.normal(keys[4 + 2 * r], (batch, heads, dim), jnp.bfloat16))
        comp = jnp.sort(jax.random.randint(keys[5 + 2 * r], (batch, topk), 0, pool_rows_per_seq), axis=1)
        idxs.append(jnp.concatenate([ring_idx, batch * window + seq, batch * window + batch
                                     + seq * pool_rows_per_seq + comp], axis=1).astype(jnp.int32))
    return (ring, new, pool), sink, qs, idxs


def window_and_pool(sources: tuple[jax.Array, ...], window: int) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """``sparse_attn_inputs``' three sources in the model's layout (``attention.attend_lists``): the ring and new
    rows as one source, the pool as the second from lane ``window`` -> ((window rows, pool), first_T int32 [B])."""
    ring, new, pool = sources
    return (jnp.concatenate([ring, new]), pool), jnp.full((new.shape[0],), window, jnp.int32)


def sparse_attn_rows(batches=(1, 64, 256), window: int = 128, topk: int = 512, heads: int = 64, dim: int = 512,
                     pool_rows_per_seq: int = 4096, sweep: bool = False, reps: int = 4, names: tuple[str, ...] = (),
                     changes: tuple[dict, ...] = (), **timing) -> list[dict]:
    """Decode sparse attention with the sink: the jnp reference against the Pallas kernel.

    Each token lists ``window`` rows (ring and its new row) and ``topk`` compressed rows of its own sequence, from
    three sources. ``reps`` steps' queries and lists run in one executable (``repeated``): at B=1 one jitted call
    a step timed the host's dispatch, not the kernel (49-82 us from run to run, twenty-fifth session). Floor: the
    gathered bf16 rows (T x (window + topk) x dim x 2 bytes). "window + pool" is the model's layout
    (``attention.attend_lists``: ring and new rows concatenated outside the timing, first_T = window).
    ``sweep`` adds splits variants and the kernel over one source (all three concatenated: what the sources'
    masked loads cost), each layout at 1 stage too. On a compute-capability-9 GPU the Mosaic GPU kernel
    (``SparseAttnConfig(engine='mgpu')``) has rows too, with splits variants under ``sweep``. ``names``: only the
    kernel rows whose name contains one of these (``kept``; the reference row always comes, as their base).
    ``changes``: more ``SparseAttnConfig`` changes of the Mosaic GPU kernel, each a row over the three sources (the
    decode step's layout) and a "window + pool" row (e.g. ``pdl=True``).
    """
    from dijax.kernels import sparse_attn as sa
    from dijax.kernels import sparse_attn_mgpu

    triton = functools.partial(sa.SparseAttnConfig, engine="triton")  # the Triton kernel's rows
    configs = [("pallas", triton())]
    if sweep:  # (twenty-fifth session: 4 or 16 warps and 32 or 16 heads a program were 1.4-40x slower at B >= 64)
        configs += [("pallas 1 block/program", triton(num_splits=1 << 20)),
                    ("pallas 2 waves", triton(wave_programs=264))]
        configs += [(f"pallas {n} split{'s' * (n > 1)}", triton(num_splits=n)) for n in (1, 2, 3)]
        # one source (2 stages by default: pipelined gathers) and one source at 1 stage; the model's layout
        # (``attend_lists``: the window rows as one source, the pool from lane first_T) at 1 stage (2 by default)
        configs += [("pallas 1 source", triton()),
                    ("pallas 1 source 1 stage", triton(num_stages=1)),
                    ("pallas window + pool 1 stage", triton(num_stages=1))]
    configs += [("pallas window + pool", triton())]
    if sparse_attn_mgpu.available():  # the Mosaic GPU kernel (the default on such a GPU)
        mgpu = functools.partial(sa.SparseAttnConfig, engine="mgpu")
        configs += [("mgpu", mgpu()), ("mgpu window + pool", mgpu())]
        configs += [(f"mgpu{layout} " + " ".join(f"{k}={v}" for k, v in change.items()), mgpu(**change))
                    for change in changes for layout in ("", " window + pool")]
        if sweep:
            configs += [(f"mgpu {n} split{'s' * (n > 1)}", mgpu(num_splits=n)) for n in (1, 2, 3, 4, 5)]
            # the in-kernel merge against XLA's: pairs merged in XLA, and 4 splits in clusters of 4
            configs += [("mgpu 2 splits merged in XLA", mgpu(num_splits=2, cluster_splits=())),
                        ("mgpu 4 splits in clusters of 4", mgpu(num_splits=4, cluster_splits=(2, 4)))]
    configs = kept(configs, names)
    scale = dim ** -0.5
    out = []
    for batch in batches:
        sources, sink, qs, idxs = sparse_attn_inputs(batch, window, topk, heads, dim, pool_rows_per_seq, reps)
        floor_bytes = batch * (window + topk) * dim * 2
        shape = f"B={batch}, {window + topk} rows x {dim}, {heads} heads"
        ref_fn = repeated(lambda x, q, i: sa.sparse_attn_reference(q, x[0], i, x[1], scale))
        want = np.asarray(ref_fn((sources, sink), qs, idxs)[0], np.float32)
        base = time_call(ref_fn, (sources, sink), qs, idxs, **timing) / reps
        out.append(_row("sparse_attn", shape, "reference (XLA)", base, floor_bytes, None))
        for name, config in configs:
            srcs, first = sources, None
            if "1 source" in name:
                srcs = (jnp.concatenate(sources),)
            elif "window + pool" in name:
                srcs, first = window_and_pool(sources, window)
            try:
                fn = repeated(lambda x, q, i, c=config, f=first: sa.sparse_attn_pallas(q, x[0], i, x[1], scale,
                                                                                        config=c, first_T=f))
                err = float(np.abs(np.asarray(fn((srcs, sink), qs, idxs)[0], np.float32) - want).max())
                seconds = time_call(fn, (srcs, sink), qs, idxs, **timing) / reps
                out.append(_row("sparse_attn", shape, f"{name} (max err {err:.1e})", seconds, floor_bytes, base))
            except Exception as exc:  # one failing tiling must not hide the others' rows
                print(f"sparse_attn {name} at B={batch} failed: {type(exc).__name__}: {str(exc)[:400]}")
    return out


def kept(configs: list[tuple[str, object]], names: tuple[str, ...]) -> list[tuple[str, object]]:
    """The (row name, config) pairs timed under ``--rows`` ``names``: those whose name contains one of them (every
    row when there are none)."""
    return [(row, config) for row, config in configs if not names or any(n in row for n in names)]


def _bf16_order(x: np.ndarray) -> np.ndarray:
    """Integers in the order of the float32 array of bf16 values ``x``, one apart per bf16 ulp (-0.0 = +0.0)."""
    bits = (x.view(np.int32) >> 16).astype(np.int64)
    return np.where(bits < 0, -0x8000 - bits, bits)


def indexer_rows(batches=(1, 64, 256), contexts=(4096, 65_536, 262_144), heads: int = 32, dim: int = 128,
                 pool_rows: int = 1 << 22, reference_max_bytes: float = 32e9, sweep: bool = False,
                 names: tuple[str, ...] = (), changes: tuple[dict, ...] = (), **timing) -> list[dict]:
    """Decode lightning-indexer scores: the jnp reference against the Pallas kernel.

    ``batch`` tokens, one sequence each, every one seeing its whole context of P compressed positions (the
    worst case), at random rows of a pool of ``pool_rows`` keys; fq4-quantised queries and keys (the model's).
    Floor: the visible keys and their row indices read once, the [T, P] float32 scores written. The reference
    (it materialises [T, P, J] keys and [T, I, P] dots) is skipped above ``reference_max_bytes`` of those. The
    kernel's row notes its agreement with the reference: the share of scores equal bit for bit, the largest gap in
    bf16 ulps. ``sweep`` adds tilings. ``names``: only the kernel rows whose name contains one of these (``kept``);
    a shape none of them runs at is skipped with its reference.
    """
    from dijax.kernels import indexer as ix

    triton = functools.partial(ix.IndexerConfig, engine="triton")  # the Triton kernel's rows
    configs = [("pallas", triton())]
    if sweep:
        configs += [("pallas p64", triton(block_p=64)),
                    ("pallas p256 warps8", triton(block_p=256, num_warps=8)),
                    ("pallas 1 block/program", triton(blocks=1)),
                    ("pallas 4 blocks/program", triton(blocks=4)),
                    ("pallas 16 blocks/program", triton(blocks=16)),
                    ("pallas warps8", triton(num_warps=8)),
                    ("pallas stages2", triton(num_stages=2))]
    configs = kept(configs, names)
    out = []
    for batch in batches if configs else ():
        for width in contexts:
            q, w, pool, key = _index_operands(jax.random.key(batch * 7 + width), batch, heads, dim, pool_rows)
            rows = jax.random.randint(key, (batch, width), 0, pool_rows, jnp.int32)
            seq = jnp.arange(batch, dtype=jnp.int32)
            visible = jnp.full((batch,), width, jnp.int32)
            args = (q, w, pool, rows, seq, visible)
            floor_bytes = batch * width * (dim * 2 + 4 + 4)
            shape = f"B={batch}, P={width}, {heads} heads x {dim}"
            base, want = None, None
            if batch * width * (dim * 2 + heads * 4) <= reference_max_bytes:
                try:
                    ref_fn = jax.jit(ix.index_scores_reference)
                    want = np.asarray(ref_fn(*args))
                    base = time_call(ref_fn, *args, **timing)
                    out.append(_row("indexer", shape, "reference (XLA)", base, floor_bytes, None))
                except Exception as exc:  # out of memory: the kernel rows still come
                    print(f"indexer reference at {shape} failed: {type(exc).__name__}: {str(exc)[:400]}")
            for name, config in configs:
                try:
                    fn = jax.jit(lambda *a, c=config: ix.index_scores_pallas(*a, config=c))
                    note = ""
                    if want is not None:
                        note = _ulp_note(np.asarray(fn(*args)), want)
                    seconds = time_call(fn, *args, **timing)
                    out.append(_row("indexer", shape, name + note, seconds, floor_bytes, base))
                except Exception as exc:  # one failing tiling must not hide the others' rows
                    print(f"indexer {name} at {shape} failed: {type(exc).__name__}: {str(exc)[:400]}")
            del args, pool, rows, want
    out += _indexer_prefill_rows(heads, dim, names=names, changes=changes, **timing)
    return out


def _index_operands(key: jax.Array, tokens: int, heads: int, dim: int, pool_rows: int):
    """The indexer's operands for a benchmark: fq4-quantised queries bf16 [tokens, heads, dim], head weights bf16
    [tokens, heads] (scaled by (dim x heads)^-1/2), an fq4-quantised key pool bf16 [pool_rows, dim], and a key left
    for the caller's rows."""
    from dijax.kernels import quant

    rng = jax.random.split(key, 4)
    q = quant.fq4_pow2(jax.random.normal(rng[0], (tokens, heads, dim), jnp.bfloat16), 32)
    w = (jax.random.normal(rng[1], (tokens, heads), jnp.float32) * (dim * heads) ** -0.5).astype(jnp.bfloat16)
    pool = quant.fq4_pow2(jax.random.normal(rng[2], (pool_rows, dim), jnp.bfloat16), 32)
    return q, w, pool, rng[3]


def _ulp_note(got: np.ndarray, want: np.ndarray) -> str:
    """" (x% equal, max n ulp)": float32 scores against the reference's, as bf16 ulps (``_bf16_order``)."""
    gap = np.abs(_bf16_order(got) - _bf16_order(want))
    return f" ({np.mean(got.view(np.uint32) == want.view(np.uint32)):.2%} equal, max {int(gap.max())} ulp)"


def _indexer_prefill_rows(heads: int, dim: int, tokens: int = 8192, width: int = 2048, names: tuple[str, ...] = (),
                          changes: tuple[dict, ...] = (), **timing) -> list[dict]:
    """Prefill lightning-indexer scores (issue 13: 50 % of the tensor cores' peak): ``tokens`` tokens of one
    sequence over ``width`` compressed positions, token t seeing t // 4 + 1 of them (an index layer of a
    ``tokens``-token prefill at compression 4), fq4-quantised inputs. Floor: the larger of the visible scores'
    FLOPs (the dots and the head sums) at the bf16 peak, and the keys, queries and scores through memory. The Triton
    kernel, and the Mosaic GPU one (``IndexerConfig(engine='mgpu')``) where it runs, also with each of ``changes``
    (IndexerConfig fields, e.g. ``mgpu_blocks=4``)."""
    from dijax.kernels import indexer as ix
    from dijax.kernels import indexer_mgpu

    configs = [("pallas", ix.IndexerConfig(engine="triton"))]
    if indexer_mgpu.available():
        configs.append(("mgpu", ix.IndexerConfig(engine="mgpu")))
        configs += [("mgpu " + " ".join(f"{k}={v}" for k, v in change.items()),
                     ix.IndexerConfig(engine="mgpu", **change)) for change in changes]
    configs = kept(configs, names)
    if not configs:
        return []
    q, w, pool, key = _index_operands(jax.random.key(tokens), tokens, heads, dim, 4 * width)
    rows = jax.random.permutation(key, 4 * width)[:width].reshape(1, width).astype(jnp.int32)
    seq = jnp.zeros((tokens,), jnp.int32)
    visible = jnp.minimum(jnp.arange(tokens, dtype=jnp.int32) // 4 + 1, width)
    args = (q, w, pool, rows, seq, visible)
    seen = int(np.asarray(visible).sum())
    floor = max(2 * seen * heads * (dim + 1) / MATRIX_RATE,
                (width * dim * 2 + tokens * (heads * dim * 2 + width * 4)) / BANDWIDTH)
    shape = f"prefill T={tokens}, P={width}, {heads} heads x {dim}"
    want = np.asarray(jax.jit(ix.index_scores_reference)(*args))
    out = []
    for name, config in configs:
        try:
            fn = jax.jit(lambda *a, c=config: ix.index_scores_pallas(*a, config=c))
            note = _ulp_note(np.asarray(fn(*args)), want)
            out.append(_timed_row("indexer", shape, name + note, time_call(fn, *args, **timing), floor, None))
        except Exception as exc:  # one failing engine must not hide the other's row
            print(f"indexer {name} at {shape} failed: {type(exc).__name__}: {str(exc)[:400]}")
    return out


@functools.cache
def _routed_experts_weights() -> tuple[dict, float, int]:
    """flash-slice's routed experts (random MXFP4 codes, exponents 116..120), SwiGLU limit, experts per token."""
    from tools.bench import flash_slice_config

    cfg = flash_slice_config(384)
    n_experts, d, f = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim
    keys = jax.random.split(jax.random.key(0), 3)
    experts = {"w1": random_mxfp4(keys[0], (n_experts,), f, d), "w3": random_mxfp4(keys[1], (n_experts,), f, d),
               "w2": random_mxfp4(keys[2], (n_experts,), d, f)}
    return experts, cfg.swiglu_limit, cfg.n_activated_experts


def random_mxfp4(key: jax.Array, lead: tuple[int, ...], out_dim: int, in_dim: int) -> dict:
    """Random MXFP4 matrices (benchmarks and the GPU tests' real-size stacks): {'weight': uint8 codes [*lead,
    out_dim, in_dim / 2], 'scale': ue8m0 bytes 116..120 [*lead, out_dim, in_dim / 32]} (scales 2^-11..2^-7)."""
    from dijax.io.random_init import random_bytes

    k1, k2 = jax.random.split(key)
    return {"weight": random_bytes(k1, (*lead, out_dim, in_dim // 2)),
            "scale": jax.random.randint(k2, (*lead, out_dim, in_dim // 32), 116, 121).astype(jnp.uint8)}


def routed_experts_inputs(tokens: int) -> tuple[dict, float, tuple[jax.Array, jax.Array, jax.Array]]:
    """The routed-experts layer's benchmark inputs at T = ``tokens``: (experts, SwiGLU limit, (x_TD bf16,
    weights_TX f32, experts_TX int32)). Experts: flash-slice's 384 MXFP4 experts of 2304 x dim with random codes
    and ue8m0 exponents 116..120, drawn once; routing: X distinct experts per token, uniformly at random. x_TD is
    fq8'd, as the seam takes it (since the fortieth session the MoE or the collapse kernel quantises it, outside
    the rows' time; before, the rows included XLA's fq8 of x)."""
    from dijax.kernels import quant

    experts, limit, x = _routed_experts_weights()
    n_experts, d = experts["w1"]["weight"].shape[0], experts["w1"]["weight"].shape[2] * 2
    k1, k2, k3 = jax.random.split(jax.random.key(tokens), 3)
    experts_TX = jnp.sort(jnp.argsort(jax.random.uniform(k1, (tokens, n_experts)), axis=1)[:, :x], axis=1)
    weights_TX = jax.random.uniform(k2, (tokens, x), jnp.float32, 0.05, 0.3)
    x_TD = quant.fq8((jax.random.normal(k3, (tokens, d), jnp.float32) * 3).astype(jnp.bfloat16))
    return experts, limit, (x_TD, weights_TX, experts_TX.astype(jnp.int32))


def routed_experts_rows(tokens=(1, 16, 64, 256, 1024), sweep: bool = False, changes: tuple[dict, ...] = (),
                        reference_max_assignments: int = 6144, **timing) -> list[dict]:
    """The routed-experts layer alone at the flash-slice dimensions (tools/bench.py: 384 MXFP4 experts of
    2304 x dim, 6 per token, random codes and ue8m0 exponents 116..120, uniformly random routing): the jnp
    reference (its own path choice) against the Pallas kernels on each path ('*' marks the default pick).

    Floor: the larger of the packed bytes of the distinct experts the routing touches (codes and ue8m0 scales,
    plus activations in and out) over ``BANDWIDTH``, and 2 x 3 x D x F FLOPs per assignment over ``MATRIX_RATE``.
    ``sweep`` adds a 64-column tiling and two pipeline stages instead of three; ``changes``: more KernelConfig
    changes; one of ``matvec_*`` fields only is timed on the gathered path (at T x X <= 4 E), any other on the
    GEMM's. (Swept before: the tile rows in the first session, ``gemm_rows``' docstring; a prefetching mat-vec K
    loop, 8 warps and a 32-word K step in the eighth / ninth, none faster; the lean mat-vec in the eleventh, now
    the mat-vecs' only form; 32 columns in the eleventh; the other tensor-core orientation (weights on M, tokens
    on N: wgmma with the weights in registers), 8-9 % slower at T = 16-256 in the seventeenth; split K to 264 or
    528 programs at T = 1 and 16 in the nineteenth, no faster; the mat-vecs' rows (8-64), warps (1-8), stages
    (2-5) and K step (32-128 words) at T = 1, 4 and 16 in the twenty-seventh, within the run-to-run spread:
    docs/benchmarks.md.)
    Past ``reference_max_assignments`` (T x X) the default Pallas kernel stands in for the reference as the
    baseline: XLA lowers the reference's ``ragged_dot`` densely, and at 8192 tokens its autotuner asked the H200
    for 81 and 180 GB buffers (twenty-fourth session).
    """
    import dataclasses

    from dijax.kernels import routed_experts as rx

    out = []
    for t in tokens:
        experts, limit, (x_TD, weights_TX, experts_TX) = routed_experts_inputs(t)
        n_experts, x = experts["w1"]["weight"].shape[0], experts_TX.shape[1]
        f, d = experts["w1"]["weight"].shape[1], x_TD.shape[1]
        expert_bytes = sum(v.nbytes for w in experts.values() for v in w.values()) / n_experts
        distinct = int(np.unique(np.asarray(experts_TX)).size)
        floor = max((distinct * expert_bytes + t * d * 2 * 2) / BANDWIDTH, 2 * 3 * d * f * t * x / MATRIX_RATE)
        shape = f"T={t}, X={x}, {distinct} experts"
        if t * x <= reference_max_assignments:
            ref_impl, ref_name = "reference", f"reference ({rx.routed_path(t * x, n_experts)})"
        else:  # the variants are compared with, and timed against, the default kernel instead
            ref_impl, ref_name = "pallas", "pallas default (the baseline: no XLA reference at this size)"
        ref_fn = jax.jit(lambda *a: rx.routed_experts(*a, limit, impl=ref_impl))
        want = np.asarray(ref_fn(experts, x_TD, weights_TX, experts_TX))
        base = time_call(ref_fn, experts, x_TD, weights_TX, experts_TX, **timing)
        out.append(_timed_row("routed_experts", shape, ref_name, base, floor, None))
        variants = [("ragged", {})]
        if t * x <= 4 * n_experts:
            variants.insert(0, ("gathered", {}))
        if sweep:
            variants += [("ragged", {"gemm_cols": 64}), ("ragged", {"gemm_stages": 2})]
        for change in changes:  # the mat-vecs' fields on the gathered path (where it is timed), the rest on the GEMM's
            matvec = all(key.startswith("matvec_") for key in change)
            if not matvec or variants[0][0] == "gathered":
                variants.append(("gathered" if matvec else "ragged", change))
        for path, change in variants:
            saved = rx.CONFIG
            rx.CONFIG = dataclasses.replace(saved, **change)
            try:
                fn = jax.jit(lambda *a, p=path: rx.routed_experts(*a, limit, impl="pallas", path=p))
                got = np.asarray(fn(experts, x_TD, weights_TX, experts_TX))
                err = float(np.abs(got - want).max() / np.abs(want).max())
                seconds = time_call(fn, experts, x_TD, weights_TX, experts_TX, **timing)
                pick = "*" if path == rx.pallas_path(t * x) and not change else ""
                name = f"pallas {path}{pick}" + "".join(f" {k}={v}" for k, v in change.items())
                label = f"{name} (err {err:.1e}, {np.mean(got == want):.1%} equal)"
                out.append(_timed_row("routed_experts", shape, label, seconds, floor, base))
            except Exception as exc:  # one failing variant must not hide the others' rows
                print(f"routed_experts {path} {change} at T={t} failed: {type(exc).__name__}: {str(exc)[:600]}")
            finally:
                rx.CONFIG = saved
    return out


def random_fp8_weight(o: int, i: int, seed: int) -> tuple[jax.Array, jax.Array]:
    """A random fp8 linear weight: e4m3 codes [o, i] (every finite code; NaN codes replaced by 1.0) and ue8m0
    exponents 116..120 [o/32, i/32], drawn from ``o + i + seed``."""
    k1, k2 = jax.random.split(jax.random.key(o + i + seed))
    bits = jax.random.bits(k1, (o, i), jnp.uint8)
    codes = jax.lax.bitcast_convert_type(jnp.where((bits & 0x7F) == 0x7F, 0x38, bits).astype(jnp.uint8),
                                         jnp.float8_e4m3fn)
    return codes, jax.random.randint(k2, (o // 32, i // 32), 116, 121).astype(jnp.uint8)


def fp8_linear_rows(tokens=(1, 16, 64, 256, 1024), sweep: bool = False, reps: int = 8, changes: tuple[dict, ...] = (),
                    linears: tuple[str, ...] = (), quantised: bool = False, **timing) -> list[dict]:
    """The fp8 block-scaled linears at the flash-slice dimensions (attention wq_a / wq_b / wkv / wo_b, the indexer's
    wq_b, the shared expert's w1 and w2; random e4m3 codes, ue8m0 exponents 116..120): the jnp reference against
    the Pallas kernel (every T through the kernel, whatever ``CONFIG.max_tokens`` says), and the Engram layers'
    ``wkv`` (``linears``: a subset of these names, default all). One timed call applies
    the linear to ``reps`` distinct weights (so a call's ~50 us of host dispatch does not hide a few-us kernel, and
    no weight is served from L2); the row is per linear. Floor: the larger of (codes + scales + x + y bytes) /
    ``BANDWIDTH`` and 2 T O I / ``MATRIX_RATE``. ``sweep`` adds tile variants (columns below and from ``wide_from``
    tokens, K slice, warps, K split target);
    ``changes``: more KernelConfig changes, each timed. ``quantised``: x comes ``quant.fq8``'d and every
    implementation is told so (``quantised=True``: the model's form where its input is fq8's output already; the
    kernel then skips its own fake-quantisation only with ``take_quantised=True``)."""
    import dataclasses

    from dijax.kernels import fp8_linear as fl
    from dijax.kernels import quant
    from tools.bench import flash_slice_config

    cfg = flash_slice_config(384)
    d, q, hk = cfg.dim, cfg.q_lora_rank, cfg.n_heads * cfg.head_dim
    shapes = {"wq_a": (q, d), "wq_b": (hk, q), "wkv": (cfg.head_dim, d), "wo_b": (d, cfg.o_groups * cfg.o_lora_rank),
              "index wq_b": (cfg.index_n_heads * cfg.index_head_dim, q), "shared w1": (cfg.moe_inter_dim, d),
              "shared w2": (d, cfg.moe_inter_dim),
              "engram wkv": ((cfg.hc_mult + 1) * d, cfg.engram_n_cols * cfg.engram_head_dim)}
    unknown = sorted(set(linears) - set(shapes))
    if unknown:
        raise ValueError(f"--linears: unknown fp8 linears {unknown}; choose from {sorted(shapes)}")
    shapes = {name: shape for name, shape in shapes.items() if not linears or name in linears}
    variants = [("pallas", {})]
    if sweep:
        variants += [(f"pallas {k}={v}", {k: v}) for k, v in (("cols", 32), ("cols", 128), ("wide_cols", 64),
                                                                ("wide_cols", 256), ("depth", 128), ("depth", 512),
                                                                ("warps", 8), ("stages", 2), ("target_programs", 1),
                                                                ("target_programs", 528), ("rows_max", 128))]
    variants += [("pallas " + " ".join(f"{k}={v}" for k, v in change.items()), change) for change in changes]

    out = []
    for name, (o, i) in shapes.items():
        ws, ss = zip(*(random_fp8_weight(o, i, r) for r in range(reps)))
        for t in tokens:
            x = (jax.random.normal(jax.random.key(t), (t, i), jnp.float32) * 3).astype(jnp.bfloat16)
            if quantised:
                x = quant.fq8(x)
            floor = max((o * i + ss[0].size + 2 * t * (i + o)) / BANDWIDTH, 2 * t * o * i / MATRIX_RATE)
            shape = f"{name} {o} x {i}, T={t}" + (", x fq8'd" if quantised else "")
            ref_fn = repeated(functools.partial(fl.fp8_linear_reference, quantised=quantised))
            want = np.asarray(ref_fn(x, ws, ss)[0].astype(jnp.float32))
            base = time_call(ref_fn, x, ws, ss, **timing) / reps
            out.append(_timed_row("fp8_linear", shape, "reference", base, floor, None))
            for label, change in variants:
                saved = fl.CONFIG
                fl.CONFIG = dataclasses.replace(saved, max_tokens=1 << 30, **change)
                try:
                    fn = repeated(functools.partial(fl.fp8_linear_pallas, quantised=quantised))
                    got = np.asarray(fn(x, ws, ss)[0].astype(jnp.float32))
                    err = float(np.abs(got - want).max() / np.abs(want).max())
                    seconds = time_call(fn, x, ws, ss, **timing) / reps
                    out.append(_timed_row("fp8_linear", shape, f"{label} (err {err:.1e}, {np.mean(got == want):.1%} "
                                          "equal)", seconds, floor, base))
                except Exception as exc:  # one failing variant must not hide the others' rows
                    print(f"fp8_linear {label} {shape} failed: {type(exc).__name__}: {str(exc)[:600]}")
                finally:
                    fl.CONFIG = saved
    return out


def fp8_linears_rows(tokens=(1, 16), sweep: bool = False, reps: int = 8, **timing) -> list[dict]:
    """Linears that share their input, at the flash-slice dimensions: attention's wq_a and wkv, the shared
    expert's w1 and w3, each pair as two launches of ``fp8_linear_pallas`` against one of ``fp8_linears_pallas``
    (the model's form). ``reps`` distinct weight pairs per timed call, as in ``fp8_linear_rows``; the row is per
    pair. Floor: both weights' bytes (and x, y) / ``BANDWIDTH``. (No variants: ``sweep`` is ignored.)"""
    from dijax.kernels import fp8_linear as fl
    from tools.bench import flash_slice_config

    cfg = flash_slice_config(384)
    d = cfg.dim
    pairs = {"wq_a + wkv": ((cfg.q_lora_rank, d), (cfg.head_dim, d)),
             "shared w1 + w3": ((cfg.moe_inter_dim, d), (cfg.moe_inter_dim, d))}

    def two_launches(x, w1, s1, w2, s2):
        return [fl.fp8_linear_pallas(x, w1, s1), fl.fp8_linear_pallas(x, w2, s2)]

    def one_launch(x, w1, s1, w2, s2):
        return fl.fp8_linears_pallas(x, [(w1, s1), (w2, s2)])

    out = []
    for name, ((o1, i), (o2, _)) in pairs.items():
        lists = list(zip(*(random_fp8_weight(o1, i, r) + random_fp8_weight(o2, i, reps + r) for r in range(reps))))
        for t in tokens:
            x = (jax.random.normal(jax.random.key(t), (t, i), jnp.float32) * 3).astype(jnp.bfloat16)
            floor = ((o1 + o2) * i * (1 + 1 / 1024) + 2 * t * (i + o1 + o2)) / BANDWIDTH
            want = base = None
            for label, form in (("two launches", two_launches), ("one launch", one_launch)):
                fn = repeated(form)
                got = np.concatenate([np.asarray(y.astype(jnp.float32)) for y in fn(x, *lists)[0]], axis=1)
                want = got if want is None else want
                seconds = time_call(fn, x, *lists, **timing) / reps
                out.append(_timed_row("fp8_linears", f"{name} {o1}+{o2} x {i}, T={t}",
                                      f"{label} ({np.mean(got == want):.1%} equal to two launches)", seconds, floor,
                                      base))
                base = base or seconds
    return out


def fp4_wgmma_rows(tokens=(1024, 8192), sweep: bool = False, **timing) -> list[dict]:
    """The Mosaic GPU MXFP4 grouped GEMM (dijax.kernels.fp4_wgmma; routed_experts' gemm_engine='mgpu') at the
    routed experts' prefill shapes: T tokens routed uniformly at random to 6 of 384 experts, assignments sorted
    into tiles (``routed_experts.fit_tiles`` with the config's sizes, or equal tiles of 128), the gate-up weights
    (w1 and w3 side by side: 4608 x 5120) and the down weight (5120 x 2304).

    Floor: the real assignments' FLOPs at ``MATRIX_RATE`` (the measured bf16 ceiling that docs/benchmarks.md's
    "30 % of peak" of the Triton grouped GEMM is against); padding rows count as waste. The time includes the
    wrapper's XLA pass (x's K order and row gather). ``sweep``: also one 64-wide K chunk a step instead of two,
    equal 128-row tiles, and ``overlap`` (a step's last wgmma running into the next step). (On the H200 the
    twenty-eighth session's 8-row sweep did not finish within 100 s: run it with --tokens 8192 alone.)"""
    from dijax.kernels import fp4_wgmma as fw
    from dijax.kernels.routed_experts import CONFIG, fit_tiles, pack_words

    n_experts, n_active = 384, 6
    configs = [dict(sizes=CONFIG.mgpu_sizes)] + ([dict(sizes=CONFIG.mgpu_sizes, chunks=1), dict(sizes=(128,)),
                                                  dict(sizes=CONFIG.mgpu_sizes, overlap=True)] if sweep else [])
    out = []
    for name, (f, k) in {"gate-up": (4608, 5120), "down": (5120, 2304)}.items():
        rng = np.random.default_rng(f)
        w = pack_words(jnp.asarray(rng.integers(0, 256, (n_experts, f, k // 2)), jnp.uint8))
        s = jnp.asarray(rng.integers(116, 124, (n_experts, f, k // 32)), jnp.uint8)
        for t in tokens:
            expert_A = jnp.asarray(np.stack([rng.choice(n_experts, n_active, replace=False) for _ in range(t)]),
                                   jnp.int32).reshape(-1)
            floor = 2 * expert_A.size * f * k / MATRIX_RATE
            x = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
            for config in configs:
                tiles_I3, token_R, _, _ = fit_tiles(expert_A, n_experts, n_active, config["sizes"])
                fn = jax.jit(functools.partial(fw.grouped_gemm_t_mgpu, **config))
                seconds = time_call(fn, w, s, x, tiles_I3, token_R, **timing)
                used = np.asarray(tiles_I3)[np.asarray(tiles_I3)[:, 0] >= 0]
                out.append(_timed_row("fp4_wgmma", f"{name} {f} x {k}, T={t}, A={expert_A.size}",
                                      "mgpu " + " ".join(f"{k}={v}" for k, v in config.items())
                                      + f" ({len(used)} tiles, {used[:, 2].sum()} rows)", seconds, floor, None))
    return out


def xla_gemm_rows(tokens=(8, 64, 1024), sweep: bool = False, reps: int = 4, **timing) -> list[dict]:
    """The GEMMs the step leaves to XLA with every kernel on, compiled with XLA's autotuning (its default) and with
    ``xla_gpu_autotune_level=0`` (what the engine's step compiled with in the seventh to ninth sessions; inside the
    step, fused with their operands' conversions, such GEMMs then took XLA's fallback tiling: docs/benchmarks.md,
    tenth session), flash-slice dimensions: the fp8 linears past the Pallas kernel's token limit (XLA
    dequantises, then multiplies), the head, router and compressor weights the reference promotes to fp32 (as
    fp32 GEMMs, what the step ran before the seventh session, and as ``matmul_promoted``'s bf16 GEMMs with fp32
    accumulation, what it runs now). Same method as
    ``fp8_linear_rows`` (``reps`` distinct weights per call); floor: weight + activation bytes / ``BANDWIDTH`` or
    FLOPs / ``MATRIX_RATE``. Beside each row, its first call (the compile)."""
    from dijax.kernels import fp8_linear as fl
    from dijax.kernels.numerics import matmul_f32
    from dijax.model.layers import matmul_promoted
    from tools.bench import flash_slice_config

    cfg = flash_slice_config(384)
    d, q, hk = cfg.dim, cfg.q_lora_rank, cfg.n_heads * cfg.head_dim

    def bf16(o, i, r):
        return (jax.random.normal(jax.random.key(o + i + r), (o, i), jnp.float32) * 0.02).astype(jnp.bfloat16), None

    def f32_linear(x, w, _):
        return matmul_f32(x.astype(jnp.float32), w.astype(jnp.float32))

    def promoted(x, w, _):
        return matmul_promoted(x, w)

    cases = {"wq_b (fp8)": (hk, q, random_fp8_weight, fl.fp8_linear_reference, 1),
             "wo_b (fp8)": (d, cfg.o_groups * cfg.o_lora_rank, random_fp8_weight, fl.fp8_linear_reference, 1),
             "shared w1 (fp8)": (cfg.moe_inter_dim, d, random_fp8_weight, fl.fp8_linear_reference, 1),
             "router (fp32 GEMM)": (cfg.n_routed_experts, d, bf16, f32_linear, 2),
             "router (matmul_promoted)": (cfg.n_routed_experts, d, bf16, promoted, 2),
             "head (fp32 GEMM)": (cfg.vocab_size, d, bf16, f32_linear, 2),
             "head (matmul_promoted)": (cfg.vocab_size, d, bf16, promoted, 2),
             "compressor (matmul_promoted)": (cfg.head_dim, d, bf16, promoted, 2)}
    out = []
    for name, (o, i, make, fn, item) in cases.items():
        weights = [make(o, i, r) for r in range(reps if o * i < 1 << 28 else 1)]
        ws, ss = [w for w, _ in weights], [s for _, s in weights]
        for t in tokens:
            x = (jax.random.normal(jax.random.key(t), (t, i), jnp.float32) * 3).astype(jnp.bfloat16)
            floor = max((o * i * item + 2 * t * (i + o)) / BANDWIDTH, 2 * t * o * i / MATRIX_RATE)
            base = None
            for label, options in (("autotuned", None), ("autotune level 0", {"xla_gpu_autotune_level": 0})):
                call = jax.jit(lambda x, ws, ss: [fn(x, w, s) for w, s in zip(ws, ss)], compiler_options=options)
                start = time.perf_counter()
                jax.block_until_ready(call(x, ws, ss))
                first = time.perf_counter() - start
                seconds = time_call(call, x, ws, ss, **timing) / len(ws)
                out.append(_timed_row("xla gemm", f"{name} {o} x {i}, T={t}", f"{label} (first call {first:.1f} s)",
                                      seconds, floor, base))
                base = base or seconds
    return out


def sinkhorn_rows(tokens=(1, 32, 1024), c: int = 4, rounds: int = 20, sweep: bool = False, **timing) -> list[dict]:
    """The hyper-connection mix split (C = 4, 20 iterations as in a V4.1 layer: sigmoids, softmax, 19 Sinkhorn
    rounds): the jnp reference against the Pallas kernel with ``div.rn.f32`` and with
    ``SinkhornConfig.fast_divide``, whose bits must be the former's (else MISMATCH; tests/gpu/test_sinkhorn_gpu.py
    checks both). Each row gives the comb's largest distance from the reference in float32 ulps. Floor: the mixes
    read and the split written once (the kernel is latency-bound far above it)."""
    from dijax.kernels import sinkhorn as sk

    def bits(x):
        return np.asarray(x[2]).view(np.int32).astype(np.int64)

    out = []
    m = (2 + c) * c
    scale, base = jnp.array([0.5, 1.5, 2.0], jnp.float32), jnp.zeros((m,), jnp.float32)
    for t in tokens:
        mixes = jax.random.normal(jax.random.key(t), (t, m), jnp.float32) * 3
        ref = jax.jit(lambda x: sk.split_reference(x, scale, base, c, rounds, 1e-6))
        want = bits(ref(mixes))
        base_s = time_call(ref, mixes, **timing)
        floor_bytes, shape = 2 * mixes.size * 4, f"T={t}, C={c}, {rounds} iterations"
        out.append(_row("sinkhorn", shape, "reference (XLA)", base_s, floor_bytes, None))
        exact = None
        for name, config in (("pallas div.rn", sk.SinkhornConfig(fast_divide=False)),
                             ("pallas fast_divide", sk.SinkhornConfig(fast_divide=True))):
            fn = jax.jit(lambda x, config=config: sk.split_pallas(x, scale, base, c, rounds, 1e-6, config=config))
            got = bits(fn(mixes))
            mark = " MISMATCH" if exact is not None and not np.array_equal(got, exact) else ""
            exact = got if exact is None else exact
            label = f"{name} ({np.abs(got - want).max()} ulps from the reference){mark}"
            out.append(_row("sinkhorn", shape, label, time_call(fn, mixes, **timing), floor_bytes, base_s))
    return out


def mixes_rows(tokens=(1, 16, 64), widths=(1024, 20480), c: int = 4, rounds: int = 20, sweep: bool = False,
               calls: int = 14, rtol: float = 1e-4, **timing) -> list[dict]:
    """A hyper-connection's mixes at the tiny model's stream width (C * D = 1024) and flash-slice's (20480): XLA's
    projection and sums of squares with the split kernel (``hc.mixes``' split path, the RMS factor in the kernel's
    prologue: what ``SinkhornConfig`` leaves outside its range) against ``mixes_pallas``' two launches. One jitted
    call runs ``calls`` of them on one token block, each with its own weight (a step's 14 hyper-connections at
    flash-slice's 7 layers). A row further than ``rtol`` (tests' MIXES_RTOL) from the XLA path is marked MISMATCH.
    Floor: the streams and the weight read once."""
    from dijax.kernels import sinkhorn as sk

    out = []
    m = (2 + c) * c
    scale, base = jnp.array([0.5, 1.5, 2.0], jnp.float32), jnp.zeros((m,), jnp.float32)
    xla = repeated(lambda x, fn: sk.split(sk.mixes_projection(x, fn), scale, base, c, rounds, 1e-6, sk.sum_squares(x),
                                          x.shape[1], 1e-6, impl="pallas"))
    fused = repeated(lambda x, fn: sk.mixes_pallas(x, fn, scale, base, c, rounds, 1e-6, 1e-6))
    for k in widths:
        fns = [jax.random.normal(jax.random.key(k + i), (m, k), jnp.float32) / np.sqrt(k) for i in range(calls)]
        for t in tokens:
            x = jax.random.normal(jax.random.key(t), (t, k), jnp.float32).astype(jnp.bfloat16)
            shape, floor_bytes = f"T={t}, C * D={k}, C={c}", t * k * 2 + fns[0].size * 4
            want = xla(x, fns)
            base_s = time_call(xla, x, fns, **timing) / calls
            out.append(_row("hc mixes", shape, "XLA projection + split kernel", base_s, floor_bytes, None))
            close = all(np.allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=1e-6)
                        for gs, ws in zip(fused(x, fns), want) for g, w in zip(gs, ws))
            seconds = time_call(fused, x, fns, **timing) / calls
            out.append(_row("hc mixes", shape, "mixes_pallas" + ("" if close else " MISMATCH"), seconds, floor_bytes,
                            base_s))
    return out


def sampler_rows(rows=(1, 16, 64), vocab: int = 129_280, sweep: bool = False, **timing) -> list[dict]:
    """What the step's sampler costs at V4.1's vocabulary: ``sample_packed`` (the engine step's sampler, every mode
    computed and one selected, the filter ``SELECT_MIN_ROWS`` picks) against each mode alone, the ``sample`` mode
    with each of ``FILTERS`` (a sort of each row, or radix descents with no sort), and a bare sort of the rows (on
    the GPU a CUB radix sort the step's CUDA graph cannot hold). Rows sample at
    temperature 0.8, top-p 0.95. Floor: the logits read once."""
    from dijax.runtime import sampler
    from dijax.runtime.sampling_params import SamplingParams

    class Row:  # what sampling_inputs reads of a scheduled chunk
        def __init__(self, i: int):
            self.params, self.seed, self.output_position = SamplingParams(temperature=0.8, top_p=0.95), i, 7

    out = []
    for r in rows:
        logits = jax.random.normal(jax.random.key(r), (r, vocab), jnp.float32) * 3
        host = sampler.sampling_inputs([Row(i) for i in range(r)], r)
        columns, packed = tuple(map(jnp.asarray, host)), jnp.asarray(sampler.StepSampling.of(host, "sample").packed_7R)
        shape, floor_bytes = f"R={r}, V={vocab}", r * vocab * 4
        base = time_call(jax.jit(sampler.sample_packed), logits, packed, **timing)
        out.append(_row("sampler", shape, "sample_packed (the step's: every mode, one selected)", base, floor_bytes,
                        None))
        for mode in sampler.MODES[:-1]:
            fn = jax.jit(functools.partial(sampler.sample, mode=mode))
            out.append(_row("sampler", shape, f"{mode} mode alone", time_call(fn, logits, *columns, **timing),
                            floor_bytes, base))
        for name in sampler.FILTERS:
            fn = jax.jit(functools.partial(sampler.sample, mode="sample", top_filter=name))
            out.append(_row("sampler", shape, f"sample mode alone, {name} filter",
                            time_call(fn, logits, *columns, **timing), floor_bytes, base))
        sort = jax.jit(lambda x: jnp.sort(x, axis=-1))
        out.append(_row("sampler", shape, "jnp.sort of the rows alone", time_call(sort, logits, **timing),
                        floor_bytes, base))
        if sweep and r > 1:
            out += _select_variant_rows(sampler, logits, columns, shape, floor_bytes, base, **timing)
            out += _thresholds_kernel_rows(logits, columns, shape, floor_bytes, **timing)
    return out


# (block, warps, prefetch, bits) tilings of the thresholds kernel that ``sampler_rows --sweep`` times
THRESHOLD_TILINGS = ((2048, 8, False, 2), (2048, 8, True, 2), (4096, 8, True, 2), (8192, 8, True, 2),
                     (8192, 16, True, 2), (16384, 16, True, 2), (8192, 8, False, 2), (8192, 8, True, 4))


def _thresholds_kernel_rows(logits, columns, shape, floor_bytes, **timing) -> list[dict]:
    """The top-k / top-p thresholds kernel alone (``sample_filter.thresholds_pallas``) at ``THRESHOLD_TILINGS``, on
    the sample mode's scaled rows; each must give the first tiling's thresholds (else MISMATCH)."""
    from dijax.kernels import sample_filter

    temperature_R, top_k_R, top_p_R = columns[:3]
    scaled = logits / temperature_R[:, None]
    rows, want, first = [], None, None
    for block, warps, prefetch, bits in THRESHOLD_TILINGS:
        config = sample_filter.FilterConfig(block=block, num_warps=warps, prefetch=prefetch, bits=bits)
        fn = jax.jit(functools.partial(sample_filter.thresholds_pallas, config=config))
        got = np.asarray(fn(scaled, top_k_R, top_p_R))
        want = got if want is None else want
        seconds = time_call(fn, scaled, top_k_R, top_p_R, **timing)
        first = first or seconds
        label = (f"thresholds kernel alone, block {block}, {warps} warps, {bits}-bit digits"
                 f"{', prefetch' if prefetch else ''}" + ("" if np.array_equal(got, want) else " MISMATCH"))
        rows.append(_row("sampler", shape, label, seconds, floor_bytes, first))
    return rows


def _select_variant_rows(sampler, logits, columns, shape, floor_bytes, base, **timing) -> list[dict]:
    """The sample mode with the select filter's descents at 4 and 2 radix bits a pass, the digits innermost or
    before the keys (``sample_filter.DESCENT``, set while a fresh jit of the unjitted ``sample`` traces it); the
    draws must equal the first variant's (else MISMATCH)."""
    from dijax.kernels import sample_filter

    saved = sample_filter.DESCENT
    rows, want = [], None
    try:
        for bits in (4, 2):
            for major in (False, True):
                sample_filter.DESCENT = {"bits": bits, "digits_major": major}
                fn = jax.jit(functools.partial(sampler.sample.__wrapped__, mode="sample", top_filter="select"))
                got = np.asarray(fn(logits, *columns))
                want = got if want is None else want
                label = (f"select filter, {bits}-bit digits {'before the keys' if major else 'innermost'}"
                         + ("" if np.array_equal(got, want) else " MISMATCH"))
                rows.append(_row("sampler", shape, label, time_call(fn, logits, *columns, **timing), floor_bytes,
                                 base))
    finally:
        sample_filter.DESCENT = saved
    return rows


def router_rows(tokens=(1, 16, 64, 1024, 8192), n_experts: int = 384, n_active: int = 6, sweep: bool = False,
                calls: int = 16, **timing) -> list[dict]:
    """The MoE router's selection (top-6 of 384, ids ascending, renormalised weights): ``route_reference`` (XLA's
    top-k sort and fusions) against the Pallas kernel at its default tiling (one token, one warp) and, with
    ``sweep``, other tokens per program and warps (16 tokens and 4 warps: the first default). One jitted call runs
    ``calls`` selections (a bias each), as a step runs one per MoE layer, so the row is the device's time per
    selection rather than the host's dispatch of a microsecond kernel. A row whose
    experts differ from the reference's is marked MISMATCH (the weights may differ by an ulp: XLA's GPU division is
    not correctly rounded). Floor: one read of the scores (4 bytes a value)."""
    from dijax.kernels import router

    configs = [("pallas", router.RouterConfig())]
    if sweep:
        configs += [(f"pallas block_tokens={b} warps={w}", router.RouterConfig(block_tokens=b, warps=w))
                    for b, w in ((16, 4), (1, 2), (1, 4), (2, 2), (4, 4), (8, 4), (16, 8))]

    out = []
    for t in tokens:
        key1, key2 = jax.random.split(jax.random.key(t))
        scores = jnp.sqrt(jax.nn.softplus(jax.random.normal(key1, (t, n_experts), jnp.float32)))
        biases = list(jax.random.normal(key2, (calls, n_experts), jnp.float32) * 0.01)
        shape, floor_bytes = f"T={t}, top {n_active} of {n_experts}", t * n_experts * 4
        ref = repeated(lambda s, b: router.route_reference(s, b, n_active, True, 2.5))
        want = [e for _, e in ref(scores, biases)]
        base = time_call(ref, scores, biases, **timing) / calls
        out.append(_row("router", shape, "reference (XLA)", base, floor_bytes, None))
        for name, config in configs:
            fn = repeated(lambda s, b, config=config: router.route_pallas(s, b, n_active, True, 2.5, config=config))
            same = all(bool(jnp.array_equal(e, w)) for (_, e), w in zip(fn(scores, biases), want))
            seconds = time_call(fn, scores, biases, **timing) / calls
            out.append(_row("router", shape, name + ("" if same else " MISMATCH"), seconds, floor_bytes, base))
    return out


def latents_rows(tokens=(1, 8, 64, 1024, 8192), q_width: int = 1280, kv_width: int = 512, rope_dim: int = 64,
                 calls: int = 16, **timing) -> list[dict]:
    """The attention's latents at V4.1-Flash's widths (``dijax.kernels.latents``: the query latent's RMS norm, the
    KV row's norm, rope and fp8): ``latents_reference`` (XLA's fusions) against the Pallas kernel. One jitted call
    runs ``calls`` of them (a projection output each), as a step runs one per attention layer. A row where more
    than 1 % of either latent's values differ from the reference's is marked MISMATCH (rounding of the sums of
    squares moves a few). Floor: one read of the joined projection output and one write of both latents (bf16)."""
    from dijax.kernels import latents
    from dijax.kernels.rope import rope_frequencies

    freqs = rope_frequencies(rope_dim, 160000.0, 65536, 16.0, 32.0, 1.0)
    out = []
    for t in tokens:
        keys = jax.random.split(jax.random.key(t), calls + 2)
        weights = [(jax.random.normal(key, (n,), jnp.float32) * 0.1 + 1).astype(jnp.bfloat16)
                   for key, n in zip(keys[:2], (q_width, kv_width))]
        lists = [[jax.random.normal(key, (t, q_width + kv_width), jnp.float32).astype(jnp.bfloat16)
                  for key in keys[2:]]]
        positions = jnp.arange(t, dtype=jnp.int32) * 7

        def call(impl, weights, qkva):
            return latents.latents(qkva, q_width, *weights, positions, freqs, 1e-6, impl=impl)

        shape, floor_bytes = f"T={t}, Q={q_width}, K={kv_width}", t * (q_width + kv_width) * 2 * 2
        ref = repeated(functools.partial(call, "reference"))
        want = ref(weights, *lists)
        base = time_call(ref, weights, *lists, **timing) / calls
        out.append(_row("latents", shape, "reference (XLA)", base, floor_bytes, None))
        fn = repeated(functools.partial(call, "pallas"))
        close = all(float(jnp.mean(g == w)) > 0.99 for got, wanted in zip(fn(weights, *lists), want)
                    for g, w in zip(got, wanted))
        seconds = time_call(fn, weights, *lists, **timing) / calls
        out.append(_row("latents", shape, "pallas" + ("" if close else " MISMATCH"), seconds, floor_bytes, base))
    return out


def print_table(rows: list[dict]) -> None:
    """Markdown table of benchmark rows."""
    print("| kernel | shape | impl | us | floor us | % of floor | x reference |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['kernel']} | {r['shape']} | {r['impl']} | {r['us']:.1f} | {r['floor_us']:.1f} | "
              f"{r['floor_pct']:.1f} | {r['speedup']:.2f} |")


def parse_change(text: str) -> dict:
    """'key=value,key=value' -> a KernelConfig change (values as Python literals: True, 528, ...)."""
    change = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--variant: expected KEY=VALUE, got {item!r}")
        change[key.strip()] = ast.literal_eval(value.strip())
    return change


BENCHES = {"topk": topk_rows, "index_topk": index_topk_rows, "sparse_attn": sparse_attn_rows, "indexer": indexer_rows,
           "routed_experts": routed_experts_rows, "fp8_linear": fp8_linear_rows, "fp8_linears": fp8_linears_rows,
           "xla_gemm": xla_gemm_rows, "sinkhorn": sinkhorn_rows, "mixes": mixes_rows, "sampler": sampler_rows,
           "router": router_rows, "latents": latents_rows,
           "fp4_wgmma": fp4_wgmma_rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(BENCHES), help=f"comma-separated subset of {sorted(BENCHES)}")
    ap.add_argument("--sweep", action="store_true", help="add tiling / algorithm variants")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timing", choices=("wall", "device"), default="wall",
                    help="wall: wall time of back-to-back calls; device: their GPU kernel time from a profiler trace "
                         "(a GPU only)")
    ap.add_argument("--tokens", help="routed_experts and fp8_linear: comma-separated token counts (default "
                                     "1,16,64,256,1024); sparse_attn: its decode batches (default 1,64,256)")
    ap.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                    help="routed_experts, fp8_linear, the indexer's prefill row and sparse_attn's Mosaic GPU rows: one "
                         "more config change to time (repeatable), e.g. gemm_cols=64, cols=32, mgpu_blocks=4 or "
                         "pdl=True")
    ap.add_argument("--kernel-split", action="store_true",
                    help="with --timing device: print each row's GPU kernels by name and their time per call")
    ap.add_argument("--rows", default="", help="sparse_attn and indexer: only the kernel rows whose name contains "
                                               "one of these comma-separated strings (e.g. 'mgpu')")
    ap.add_argument("--quantised", action="store_true",
                    help="fp8_linear: x comes fq8'd and the linears are told so (time take_quantised=True against "
                         "the default with --variant)")
    ap.add_argument("--linears", default="", help="fp8_linear: comma-separated subset of the linears' names "
                                                  "(default all; e.g. 'engram wkv,wq_b')")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(BENCHES))
    if unknown:
        raise ValueError(f"--only: unknown benchmarks {unknown}; choose from {sorted(BENCHES)}")
    if args.timing == "device" and jax.default_backend() != "gpu":
        raise SystemExit(f"--timing device reads GPU kernels from a profiler trace; the backend is "
                         f"{jax.default_backend()} (use --timing wall)")
    global BANDWIDTH, MATRIX_RATE, KERNEL_SPLIT
    KERNEL_SPLIT = args.kernel_split
    measured = ceilings(jax.devices()[0].device_kind)
    BANDWIDTH, MATRIX_RATE = measured.bandwidth, measured.flops
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, timing: {args.timing}, ceilings "
          f"{BANDWIDTH / 1e12:.2g} TB/s, {MATRIX_RATE / 1e12:.0f} TFLOP/s ({measured.source})")
    # a second of matrix work first, so that the first rows are not timed at idle clocks
    warm = jnp.ones((4096, 4096), jnp.bfloat16)
    time_call(jax.jit(lambda a: a @ a), warm, iters=200, repeats=1)
    rows = []
    for name in names:
        extra = {}
        if name in ("routed_experts", "fp8_linear", "indexer", "sparse_attn"):
            extra["changes"] = tuple(parse_change(v) for v in args.variant)
        if name in ("routed_experts", "fp8_linear", "fp8_linears", "fp4_wgmma"):
            if args.tokens:
                extra["tokens"] = tuple(int(t) for t in args.tokens.split(","))
        if name in ("sparse_attn", "indexer"):
            extra["names"] = tuple(n for n in args.rows.split(",") if n)
        if name == "sparse_attn" and args.tokens:  # a decode step's tokens are its batch
            extra["batches"] = tuple(int(t) for t in args.tokens.split(","))
        if name == "fp8_linear":
            extra["linears"] = tuple(n.strip() for n in args.linears.split(",") if n.strip())
            extra["quantised"] = args.quantised
        rows += BENCHES[name](sweep=args.sweep, iters=args.iters, repeats=args.repeats,
                              device=args.timing == "device", **extra)
    print_table(rows)


if __name__ == "__main__":
    main()
