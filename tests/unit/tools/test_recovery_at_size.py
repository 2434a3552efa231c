"""tools/bench/recovery_at_size.py's breakdown of one recovery, from events.jsonl and
metrics.jsonl rows: each part is the interval the docstring names, the parts add up to the
total, and "lost" leaves out the step that would have run anyway. The timed runs (two 1 GB
trainers killed) are a benchmark, not a test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from tools.bench.recovery_at_size import breakdown  # noqa: E402


def _events() -> list[dict]:
    rows = [
        ("failure", 10.0, {}),
        ("failure", 10.1, {}),
        ("detection", 10.3, {}),
        # rank 0 up at 10.8 (latency from its start), loaded in 1.0 s; rank 1 the slowest
        ("recovery", 13.0, {"latency_ms": 2200.0, "load_ms": 1000.0, "step": 4}),
        ("recovery", 13.5, {"latency_ms": 2500.0, "load_ms": 1200.0, "step": 4}),
        ("regroup", 13.6, {"detail": "recover: members [0, 1]"}),
    ]
    return [
        {"type": t, "time_s": ts, "seq": i, "step": 4, "generation": 2, **extra}
        for i, (t, ts, extra) in enumerate(rows)
    ]


def test_each_part_is_its_interval_and_they_add_up():
    metrics = [{"step": s, "step_time_s": 2.0, "generation": 1} for s in range(4)]
    metrics.append({"step": 4, "step_time_s": 2.5, "generation": 2})
    row = breakdown(_events(), metrics)
    assert row["detection_s"] == pytest.approx(0.3)
    assert row["start_s"] == pytest.approx(0.5)  # detection -> rank 0 up (13.0 - 2.2)
    assert row["load_s"] == pytest.approx(2.5)  # the slowest rank's latency
    assert row["state_s"] == pytest.approx(1.2)
    assert row["build_s"] == pytest.approx(1.3)
    assert row["first_step_s"] == pytest.approx(0.1 + 2.5)
    assert row["total_s"] == pytest.approx(0.3 + 0.5 + 2.5 + 2.6)
    assert row["lost_s"] == pytest.approx(row["total_s"] - 2.0)
    assert row["steps_redone"] == 0


def test_events_without_load_ms_leave_the_split_unknown():
    events = [{k: v for k, v in e.items() if k != "load_ms"} for e in _events()]
    row = breakdown(events, [{"step": 4, "step_time_s": 2.5, "generation": 2}])
    assert row["state_s"] is None and row["build_s"] is None
    assert row["load_s"] == pytest.approx(2.5)
