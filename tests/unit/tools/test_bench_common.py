"""tools/bench/bench_common.py: the interleaved fastest-of-rounds timing that degraded.py,
granularity.py and convergence.py share, and the table cell that prints a missing value."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools" / "bench"))

import bench_common  # noqa: E402


def test_fastest_of_rounds_warms_up_then_interleaves_and_keeps_the_fastest():
    calls, times = [], {"a": iter([9.0, 3.0, 2.0, 4.0]), "b": iter([9.0, 5.0, 6.0, 1.0])}

    def run(name, step):
        calls.append((name, step))
        return next(times[name])

    best = bench_common.fastest_of_rounds(run, {"A": "a", "B": "b"}, 3)
    assert calls == [("a", 0), ("b", 0)] + [("a", 1), ("b", 1)] * 3
    assert best == {"A": 2.0, "B": 1.0}  # the warm-up steps never count
    calls.clear()
    times = {"a": iter([7.0, 8.0])}
    assert bench_common.fastest_of_rounds(run, {"A": "a"}, 2, warmup=False) == {"A": 7.0}
    assert calls == [("a", 1), ("a", 1)]


def test_cell_formats_scaled_values_and_marks_missing_ones():
    assert bench_common.cell(0.01234, ",.1f", scale=1000) == "12.3"
    assert bench_common.cell(12345.0, ",.0f") == "12,345"
    assert bench_common.cell(7, "") == "7"  # an int stays an int when not scaled
    assert bench_common.cell(None, "9.0f") == "n/a"
    assert bench_common.cell(None, "9.0f", missing="-") == "-"
