"""tools/trace_summary.py ``--streams``: per-GPU stream totals and the share of collective time that runs beside
compute; ``--graphs``: each graph launch against the kernels after it. Synthetic traces whose answers are known."""

from __future__ import annotations

import gzip
import json

import pytest

from tools.trace_summary import _overlap, _union, main, summarise_graphs, summarise_streams

pytestmark = pytest.mark.cost(1)  # CI seconds, a scheduling hint (tests/conftest.py)


def _meta(kind: str, pid: int, name: str, tid: int = 0) -> dict:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}


def _kernel(pid: int, tid: int, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


@pytest.fixture
def trace(tmp_path):
    """GPU 0: compute [0, 100) on stream 1, an all-reduce [50, 150) on stream 2 (50 us of it beside compute), and
    an ops line repeating the compute kernel; GPU 1: only a collective [0, 40) (nothing beside it); a host thread."""
    events = [_meta("process_name", 1, "/device:GPU:0"), _meta("process_name", 2, "/device:GPU:1"),
              _meta("process_name", 3, "/host:CPU"),
              _meta("thread_name", 1, "Stream #1(Compute)", 1), _meta("thread_name", 1, "Stream #2(Nccl)", 2),
              _meta("thread_name", 1, "XLA Ops", 9), _meta("thread_name", 2, "Stream #1(Compute)", 1),
              _kernel(1, 1, "loop_add_fusion", 0, 60), _kernel(1, 1, "gemm_fusion_dot", 60, 40),
              _kernel(1, 2, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 50, 100),
              _kernel(1, 9, "gemm_fusion_dot", 60, 40),
              _kernel(2, 1, "ncclDevKernel_AllGather_RING_LL", 0, 40),
              _kernel(3, 5, "PjitFunction(step)", 0, 500)]
    (tmp_path / "plugins").mkdir()
    with gzip.open(tmp_path / "plugins" / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(tmp_path)


def test_intervals():
    assert _union([(5, 8), (0, 2), (1, 3), (8, 9)]) == [(0, 3), (5, 9)]
    assert _overlap([(0, 3), (5, 9)], [(2, 6), (8, 20)]) == 1 + 1 + 1


def test_streams_and_collectives_beside_compute(trace):
    lines = summarise_streams(trace, steps=1).splitlines()[3:]
    assert len(lines) == 3  # GPU 0's two streams and GPU 1's one; the ops line and the host are left out
    gpu0_compute, gpu0_nccl, gpu1 = ([c.strip() for c in line.split("|")[1:-1]] for line in lines)
    assert gpu0_compute[1] == "Stream #1(Compute)" and gpu0_compute[2:] == ["2", "100", "0", "0", "-"]
    assert gpu0_nccl[2:] == ["1", "100", "1", "100", "50 %"]
    assert gpu1[0] == "/device:GPU:1" and gpu1[2:] == ["1", "40", "1", "40", "0 %"]


def test_cli(trace, capsys):
    assert main([trace, "--streams", "--steps", "2"]) == 0
    assert "| 50 |" in capsys.readouterr().out  # GPU 0's collective: 100 us over 2 steps


def test_graph_launches_against_the_kernels_after_them(tmp_path):
    """Two graph launches (host 0-100 and 300-380): the first's kernels start at 100 and end at 150, the second's
    at 390 and 420; an ops line repeating a kernel and a transfer on another stream are left out."""
    events = [_meta("process_name", 1, "/device:GPU:0"), _meta("process_name", 3, "/host:CPU"),
              _kernel(3, 5, "cuGraphLaunch (CudaGraph:41)", 0, 100), _kernel(3, 5, "cuGraphLaunch (CudaGraph:41)",
                                                                             300, 80),
              _kernel(1, 1, "fusion", 100, 20), _kernel(1, 1, "fp8_linear", 130, 20),
              _kernel(1, 1, "fusion", 390, 30), _kernel(1, 9, "fusion", 100, 20), _kernel(1, 2, "memcpy", 0, 5)]
    (tmp_path / "plugins").mkdir()
    with gzip.open(tmp_path / "plugins" / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in summarise_graphs(str(tmp_path)).splitlines()[3:]]
    assert rows == [["0", "100", "2", "100", "150", "40"], ["1", "80", "1", "90", "120", "30"],
                    ["median", "100", "2", "100", "150", "40"]]
    assert main([str(tmp_path), "--graphs"]) == 0
