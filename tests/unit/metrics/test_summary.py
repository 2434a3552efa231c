"""The job-wide summary: rebuilt from the job's metric rows, and checked against them."""

from __future__ import annotations

import json

import pytest

from megatron_mecefo.metrics.summary import check_summary, job_wide

pytestmark = pytest.mark.timeout(30)


def _rows(path, steps, *, degraded=(), short=()):
    with open(path, "w") as fh:
        for s in steps:
            row = {
                "step": s,
                "loss": 10.0 - s,
                "tokens_per_s": 100.0 + s,
                "global_microbatches": 6 if s in short else 8,
                "job_degraded": s in degraded,
            }
            if s % 5 == 4:
                row["val_loss"] = 9.0 - s
            fh.write(json.dumps(row) + "\n")
        fh.write('{"step": 99, "loss"')  # a line cut short by a crash is ignored


def test_a_restarted_leader_summarises_the_whole_job(tmp_path):
    _rows(tmp_path / "metrics.jsonl", range(10), degraded={3, 4, 5})
    local = {  # what a leader restarted at step 6 saw itself
        "steps": 4,
        "first_loss": 4.0,
        "final_loss": 1.0,
        "val_losses": [[9, 0.0]],
        "final_val_loss": 0.0,
        "failover": {"steps_degraded": 0, "samples_lost": 0, "failures": 1},
    }
    out = job_wide(local, tmp_path / "metrics.jsonl", start_step=0, expected_microbatches=8)
    assert (out["steps"], out["first_loss"], out["final_loss"]) == (10, 10.0, 1.0)
    assert out["val_losses"] == [(4, 5.0), (9, 0.0)] and out["final_val_loss"] == 0.0
    assert out["failover"]["steps_degraded"] == 3 and out["failover"]["failures"] == 1
    assert out["mean_tokens_per_s"] == pytest.approx(sum(100.0 + s for s in range(1, 10)) / 9)
    resumed = job_wide(local, tmp_path / "metrics.jsonl", start_step=6, expected_microbatches=8)
    assert (resumed["steps"], resumed["first_loss"], resumed["start_step"]) == (4, 4.0, 6)


def test_samples_lost_are_counted_from_every_row(tmp_path):
    _rows(tmp_path / "metrics.jsonl", range(5), short={2})
    out = job_wide(
        {"failover": {}}, tmp_path / "metrics.jsonl", start_step=0, expected_microbatches=8
    )
    assert out["failover"]["samples_lost"] == 2


def test_check_summary_names_each_disagreement(tmp_path):
    _rows(tmp_path / "metrics.jsonl", range(10), degraded={3})
    events = [{"type": "failure"}, {"type": "detection"}, {"type": "rejoin"}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    good = job_wide(
        {"failover": {"failures": 1, "rejoins": 1, "samples_lost": 0}},
        tmp_path / "metrics.jsonl",
        start_step=0,
        expected_microbatches=8,
    )
    (tmp_path / "summary.json").write_text(json.dumps(good))
    assert check_summary(tmp_path) == []
    bad = {
        **good,
        "steps": 4,
        "first_loss": 4.0,
        "failover": {**good["failover"], "failures": 0, "steps_degraded": 0},
    }
    (tmp_path / "summary.json").write_text(json.dumps(bad))
    problems = check_summary(tmp_path)
    assert len(problems) == 4, problems
    assert any("steps 4 but metrics.jsonl has 10" in p for p in problems)
    assert any("failover.failures = 0 but events.jsonl has 1" in p for p in problems)
