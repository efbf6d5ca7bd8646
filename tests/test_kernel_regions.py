"""tools/kernel_regions.py: a Mosaic GPU on-device timeline summed up by region. Synthetic traces whose answers are
known (the GPU writes the real ones: tools/profile_attn.py --trace-dir)."""

from __future__ import annotations

import json
import os

import pytest

from tools.kernel_regions import UNMARKED, main, newest_trace, summarise, table

pytestmark = pytest.mark.cost(1)  # CI seconds, a scheduling hint (tests/conftest.py)


def _span(tid: int, name: str, begin: float, end: float) -> list[dict]:
    # ts: (globaltimer ns + clock cycles) / 1000, as Mosaic GPU's profiler dumps it
    return [{"name": name, "ph": "B", "ts": begin, "pid": 3, "tid": tid},
            {"name": name, "ph": "E", "ts": end, "pid": 3, "tid": tid}]


def _events() -> list[dict]:
    """Trace 1 (9000 cycles): start 1000, meeting 2000, scores 4000 (a nested scores inside, not counted again), 1000
    unmarked, pv 1000. Trace 2 (4000 cycles): meeting 2000, scores 2000."""
    a = (_span(1, "start", 0, 1) + _span(1, "meeting", 1, 3) + [_span(1, "scores", 3, 7)[0]]
         + _span(1, "scores", 3.5, 6.5) + [_span(1, "scores", 3, 7)[1]] + _span(1, "pv", 8, 9))
    b = _span(2, "meeting", 100, 102) + _span(2, "scores", 102, 104)
    return b + a  # traces in any order


def test_regions_are_summed_per_entry_and_share():
    got = summarise(_events())
    assert got["traces"] == 2 and got["span"] == pytest.approx(6500)
    want = {"start": (0.5, 1000, 1000), "meeting": (1, 2000, 4000), "scores": (1, 3000, 6000), "pv": (0.5, 1000, 1000)}
    for name, (entries, cycles, total) in want.items():
        assert got[name]["entries"] == pytest.approx(entries), name
        assert got[name]["cycles"] == pytest.approx(cycles), name
        assert got[name]["share"] == pytest.approx(total / 13000), name
    assert got[UNMARKED]["share"] == pytest.approx(1000 / 13000)
    text = table(got, clock_ghz=2.0)
    assert "| scores | 1.0 | 3000 | 1.50 | 46.2 % |" in text  # 6000 of 13000 cycles; 3000 cycles at 2 GHz


def test_bad_traces_are_named(tmp_path):
    with pytest.raises(ValueError, match="unbalanced"):
        summarise(_span(1, "a", 0, 2)[:1] + _span(1, "b", 1, 2)[1:])
    with pytest.raises(ValueError, match="no begin / end"):
        summarise([{"ph": "M", "name": "process_name"}])
    with pytest.raises(FileNotFoundError, match="profile_dir"):
        newest_trace(str(tmp_path))


def test_main_reads_the_newest_trace(tmp_path, monkeypatch, capsys):
    (tmp_path / "kernel-1-trace.json").write_text(json.dumps({"traceEvents": _span(1, "old", 0, 1)}))
    newest = tmp_path / "kernel-2-trace.json"
    newest.write_text(json.dumps({"traceEvents": _events()}))
    os.utime(newest, (2e9, 2e9))
    os.utime(tmp_path / "kernel-1-trace.json", (1e9, 1e9))
    monkeypatch.setattr("sys.argv", ["kernel_regions.py", str(tmp_path)])
    main()
    out = capsys.readouterr().out
    assert "kernel-2-trace.json" in out and "| meeting |" in out and "old" not in out
