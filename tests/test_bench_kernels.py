"""tools/bench_kernels.py's timing: ``--timing device`` sums the GPU kernels of a profiler trace (a synthetic trace
whose answer is known; on the CPU a clear error), and a benchmark's own parameters never take the timing's."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import sys

import jax
import numpy as np
import pytest

from tools import bench_kernels

pytestmark = pytest.mark.cost(4)  # CI seconds, a scheduling hint (tests/conftest.py)


def _event(pid: int, tid: int, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


def test_device_seconds_sums_the_busiest_streams_kernels(monkeypatch):
    """Two calls traced: 30 + 10 us of kernels on the compute stream, a gap between them, an ops line that repeats
    one kernel and a host event; per call that is 20 us."""
    events = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 2, "tid": 0, "args": {"name": "/host:CPU"}},
              _event(1, 1, "fp8_linear", 0, 30), _event(1, 1, "loop_reduce_fusion", 500, 10),
              _event(1, 9, "fp8_linear", 0, 30), _event(2, 5, "PjitFunction(f)", 0, 900)]
    calls = []

    @contextlib.contextmanager
    def trace(folder, create_perfetto_trace):
        assert create_perfetto_trace
        yield
        os.makedirs(os.path.join(folder, "plugins"))
        with gzip.open(os.path.join(folder, "plugins", "perfetto_trace.json.gz"), "wt") as f:
            json.dump({"traceEvents": events}, f)

    monkeypatch.setattr(jax.profiler, "trace", trace)
    seconds = bench_kernels.device_seconds(lambda x: calls.append(x) or x, 1.0, calls=2)
    assert calls == [1.0, 1.0]
    assert seconds == pytest.approx(20e-6)


def test_device_timing_needs_a_gpu(monkeypatch):
    if jax.default_backend() == "gpu":
        pytest.skip("checks the CPU's refusal")
    with pytest.raises(RuntimeError, match="no GPU kernels"):
        bench_kernels.device_seconds(jax.jit(lambda x: x + 1), jax.numpy.ones(4), calls=1)
    monkeypatch.setattr(sys, "argv", ["bench_kernels.py", "--only", "topk", "--timing", "device"])
    with pytest.raises(SystemExit, match="--timing device reads GPU kernels"):
        bench_kernels.main()


def test_sinkhorn_rows_keep_their_rounds():
    """The timing's ``iters`` (back-to-back calls) is not the Sinkhorn rounds of the benchmarked split: before
    the twenty-seventh session ``--iters 10`` made the rows run 10 rounds instead of a V4.1 layer's 20."""
    rows = bench_kernels.sinkhorn_rows(tokens=(1,), iters=1, repeats=1)
    assert rows and all("20 iterations" in row["shape"] for row in rows)


def test_mixes_rows_agree_and_time_both_paths():
    """The hyper-connection mixes rows run XLA's path and mixes_pallas (interpreted here) on the same streams, and
    the two agree (a MISMATCH label would say they do not)."""
    rows = bench_kernels.mixes_rows(tokens=(3,), widths=(1024,), calls=2, iters=1, repeats=1)
    assert [row["impl"] for row in rows] == ["XLA projection + split kernel", "mixes_pallas"]
    assert all(row["us"] > 0 and "C * D=1024" in row["shape"] for row in rows)


def test_latents_rows_agree_and_time_both_paths():
    """The latents rows run the reference and the kernel (interpreted here) on the same projections, and the two
    agree (a MISMATCH label would say they do not)."""
    rows = bench_kernels.latents_rows(tokens=(3,), q_width=64, kv_width=64, rope_dim=16, calls=2, iters=1, repeats=1)
    assert [row["impl"] for row in rows] == ["reference (XLA)", "pallas"]
    assert all(row["us"] > 0 and row["shape"] == "T=3, Q=64, K=64" for row in rows)


def test_sampler_rows_time_the_step_sampler_each_mode_and_the_sort():
    rows = bench_kernels.sampler_rows(rows=(2,), vocab=512, iters=1, repeats=1)
    assert [row["impl"] for row in rows] == ["sample_packed (the step's: every mode, one selected)",
                                             "greedy mode alone", "temperature mode alone",
                                             "sample mode alone, sort filter", "sample mode alone, select filter",
                                             "sample mode alone, pallas filter",
                                             "jnp.sort of the rows alone"]
    assert all(row["us"] > 0 and row["shape"] == "R=2, V=512" for row in rows)
    swept = bench_kernels.sampler_rows(rows=(2,), vocab=64, sweep=True, iters=1, repeats=1)[len(rows):]
    tilings = [f"thresholds kernel alone, block {block}, {warps} warps, {bits}-bit digits"
               f"{', prefetch' if ahead else ''}" for block, warps, ahead, bits in bench_kernels.THRESHOLD_TILINGS]
    assert [row["impl"].removesuffix(" MISMATCH") for row in swept] == [
        *(f"select filter, {bits}-bit digits {where}" for bits in (4, 2) for where in ("innermost", "before the keys")),
        *tilings]


def test_rows_filter_keeps_the_named_rows():
    configs = [("pallas", 1), ("pallas 2 splits", 2), ("mgpu", 3), ("mgpu split scores", 4)]
    assert bench_kernels.kept(configs, ("mgpu",)) == [("mgpu", 3), ("mgpu split scores", 4)]
    assert bench_kernels.kept(configs, ("split", "mgpu")) == configs[1:]
    assert bench_kernels.kept(configs, ()) == configs
    assert bench_kernels.kept(configs, ("window",)) == []


def test_random_mxfp4_shapes_and_exponents():
    m = bench_kernels.random_mxfp4(jax.random.key(0), (2, 3), 64, 256)
    assert m["weight"].shape == (2, 3, 64, 128) and m["weight"].dtype == jax.numpy.uint8
    assert m["scale"].shape == (2, 3, 64, 8)
    assert set(np.unique(np.asarray(m["scale"]))) <= set(range(116, 121))
