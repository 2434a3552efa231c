"""Whether a launch trained to its last step (`megatron_mecefo/job_outcome.py`): what
`launch/local/run.sh` asks before it exits non-zero (issue 32, item 5)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from megatron_mecefo.job_outcome import main, trained_to_last_step

pytestmark = pytest.mark.timeout(60)

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "run" / "demo_cpu.yaml"


def _summary(run_dir: Path, *, last: int = 7, missing=(), **fields) -> None:
    """A summary and the metrics rows of steps 0..`last` but `missing`."""
    run_dir.mkdir(exist_ok=True)
    summary = {"start_step": 0, "steps": last + 1 - len(missing), "stopped_at": None, **fields}
    rows = [json.dumps({"step": s, "loss": 1.0}) for s in range(last + 1) if s not in missing]
    (run_dir / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_only_a_summary_that_reached_the_last_step_since_the_launch_counts(tmp_path):
    assert not trained_to_last_step(tmp_path, 8)  # no summary: the job never finished
    _summary(tmp_path)
    assert trained_to_last_step(tmp_path, 8)
    assert not trained_to_last_step(tmp_path, 9)  # --max-steps raised since
    assert not trained_to_last_step(tmp_path, 8, since_s=time.time() + 60)  # an earlier launch's
    _summary(tmp_path, start_step=5)  # a resumed launch: its own steps 5..7
    assert trained_to_last_step(tmp_path, 8)
    # a leader lost between a commit and its row: one row missing, the job still finished
    _summary(tmp_path, missing=(6,))
    assert trained_to_last_step(tmp_path, 8)
    _summary(tmp_path, last=4, stopped_at=5)  # stopped on request
    assert not trained_to_last_step(tmp_path, 5)
    _summary(tmp_path, last=6)  # a summary without the last step's row
    assert not trained_to_last_step(tmp_path, 8)
    (tmp_path / "summary.json").write_text('{"steps": ')
    assert not trained_to_last_step(tmp_path, 8)


def test_the_cli_reads_the_run_dir_and_max_steps_from_the_trainer_args(tmp_path, capsys):
    run_dir = tmp_path / "R"
    args = ["--", "--config", str(CONFIG), "--run-dir", str(run_dir), "--max-steps", "8"]
    start = int(time.time())
    assert main(["--since", str(start), *args]) == 1
    _summary(run_dir)
    assert main(["--since", str(start), "--codes", "137 0 0", *args]) == 0
    line = capsys.readouterr().out.strip()
    assert line == (
        f"the job trained to its last step (step 7, {run_dir}/summary.json) "
        "(node exit codes: 137 0 0): exit 0"
    )
    old = start - 3600
    os.utime(run_dir / "summary.json", (old, old))
    assert main(["--since", str(start), *args]) == 1
    assert main(["--since", "0", "--", "--config", "missing.yaml"]) == 1
