"""tools/bench/convergence.py: the multi-seed summary and the accuracy-cost table it writes for
the planner (pure functions; the training runs themselves are benchmarks, not tests)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools" / "bench"))

import convergence  # noqa: E402

from megatron_mecefo.plan import DegradedTechniques, load_accuracy_costs  # noqa: E402


def _row(config, seed, gap, fraction=0.125, policy="neighbor", techniques="skip+lowrank"):
    return {
        "scenario": "moderate",
        "config": config,
        "policy": policy,
        "seed": seed,
        "techniques": techniques,
        "gap_ppl_pct": gap,
        "degraded_fraction": fraction,
        "step_time_ratio": 1.1,
        "predicted_step_ratio": 1.2,
    }


def test_summary_pairs_seeds_and_flags_gaps_beyond_noise():
    rows = [_row("neighbor", s, g) for s, g in ((1, 1.0), (2, 1.2), (3, 0.8))]
    rows += [_row("hybrid", s, g, policy="hybrid") for s, g in ((1, 0.5), (2, -0.6), (3, 0.1))]
    summary = {r["config"]: r for r in convergence.summarize(rows)}
    neighbor = summary["neighbor"]["gap_ppl_pct"]
    assert neighbor["mean"] == pytest.approx(1.0) and neighbor["std"] == pytest.approx(0.2)
    assert neighbor["n"] == 3 and summary["neighbor"]["beyond_noise"]
    # Student t with 2 degrees of freedom: 1.0 +- 4.303 x 0.2 / sqrt(3)
    assert summary["neighbor"]["ci95"] == pytest.approx([0.503, 1.497], abs=1e-3)
    assert not summary["hybrid"]["beyond_noise"]  # mean 0 within the seeds' spread
    one = convergence.summarize([_row("neighbor", 1, 5.0)])[0]
    assert not one["beyond_noise"]  # one seed says nothing about noise


def test_accuracy_cost_table_is_gap_per_degraded_share_and_loads(tmp_path):
    rows = [_row("neighbor", s, g) for s, g in ((1, 0.6), (2, 0.75), (3, 0.9))]
    rows += [_row("no_skip", s, g, techniques="lowrank") for s, g in ((1, -0.2), (2, 0.1))]
    rows += [_row("hybrid", 1, 9.0, policy="hybrid")]  # mixed plans do not measure one set
    out = tmp_path / "costs.json"
    args = argparse.Namespace(
        accuracy_costs=str(out),
        corpus="fortunes",
        model="tiny",
        num_layers=8,
        replicas=4,
        microbatches=2,
        mbs=8,
        steps=150,
        scenarios=["moderate"],
        seeds=[1, 2, 3],
    )
    convergence.write_accuracy_costs({"rows": rows, "command": "cmd", "date": "d"}, args)
    table = load_accuracy_costs(out)
    assert table.of(DegradedTechniques(True, False, True)) == pytest.approx(0.75 / 0.125)
    assert table.of(DegradedTechniques(False, False, True)) == 0.0  # mean < 0 stored as 0
    assert table.of(DegradedTechniques(True, False, False)) is None  # not run


def test_table_of_a_file_that_is_not_a_run_is_one_error_line(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "costs.json"
    bad.write_text('{"costs": {}}')
    monkeypatch.setattr(sys, "argv", ["convergence.py", "--table", str(bad)])
    assert convergence.main() == 2
    err = capsys.readouterr().err
    assert err == f"error: {bad}: not a convergence run (no 'args' and 'rows')\n"
