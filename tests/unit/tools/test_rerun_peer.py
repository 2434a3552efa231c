"""tools/bench/rerun_peer.py: megatron-core's `RerunStateMachine` on CPU, driven by the bench's
loop, classifies the three injected NaN faults as the comparison in `docs/anomalies.md` says
(one short subprocess: it initialises torch.distributed and the CPU layer, which the session's
other tests must not inherit); and the mecefo side's timing is read from events.jsonl as
documented. The timed runs (real restarts, `mecefo-launch`) are a benchmark, not a test."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools" / "bench"))

import rerun_peer as bench  # noqa: E402


@pytest.mark.timeout(120)
def test_state_machine_tells_transient_persistent_and_data_apart(tmp_path, demo_data_dir):
    out = tmp_path / "verdicts.json"
    cmd = [sys.executable, str(ROOT / "tools" / "bench" / "rerun_peer.py"), "--quick"]
    cmd += ["--settings", "as timed", "--demo-dir", demo_data_dir, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(out.read_text())["verdicts"]
    ref, timed = found["reference"]["loss"], found["as timed"]
    # transient: rerun in place, not reproduced, the job goes on; the failure-free losses
    t = timed["transient"]
    assert t["first_exit"] == 0 and "second_exit" not in t
    assert t["first"] == ["initial_run", "first_rerun_not_reproducible"]
    assert t["updated"] and t["loss"] == ref
    # persistent: reproduced in place -> checkpoint and exit 16; the restart on "another GPU"
    # does not reproduce it: the first device was faulty; the checkpoint resumed bit for bit
    p = timed["persistent"]
    assert p["first_exit"] == 16
    assert p["first"] == ["initial_run", "first_rerun_reproducible"]
    assert p["second_exit"] == 0 and p["second"] == ["second_rerun_not_reproducible"]
    assert p["updated"] and p["loss"] == ref
    # data: reproduced after the restart too -> a correct result; that step is not applied
    d = timed["data"]
    assert d["first_exit"] == 16 and d["second"] == ["second_rerun_reproducible"]
    assert d["second_exit"] == 0 and not d["updated"]
    assert math.isnan(d["loss"][0]) and math.isfinite(d["loss"][1]) and d["loss"][1] != ref[1]


def test_mecefo_times_come_from_the_events(monkeypatch, tmp_path):
    metrics = [{"step": k, "step_time_s": 0.04, "loss": 6.0} for k in range(8)]
    metrics[5]["step_time_s"] = 0.06  # the committed redo of the fault step
    events = [
        {"type": "anomaly", "step": 5, "time_s": 1.00},
        {"type": "rerun", "step": 5, "time_s": 1.00},
        {"type": "step_redone", "step": 5, "time_s": 1.00},
        {"type": "anomaly", "step": 5, "time_s": 1.05},
        {"type": "classified", "step": 5, "time_s": 1.10, "kind": "persistent"},
        {"type": "evicted", "step": 5, "time_s": 1.11},
        {"type": "takeover", "step": 5, "time_s": 1.50},
        {"type": "anomaly", "step": 7, "time_s": 9.0},  # another step: not read
    ]
    res = {"metrics": metrics, "events": events, "wall_s": 9.0}
    monkeypatch.setattr(bench, "run_launch", lambda *a, **k: res)
    args = bench.parse_args(["--step", "5"])
    row = bench.mecefo_kind(args, "persistent", tmp_path)
    assert row["inject"] == "nan:1:5:persistent" and row["classified"] == "persistent"
    assert row["detection_s"] == pytest.approx(0.04)  # a normal step: the vote ends it
    assert row["judgement_s"] == pytest.approx(0.10)  # first anomaly -> classified
    assert row["resume_s"] == pytest.approx(0.46)  # -> takeover, then the redo's 0.06 s
    assert row["total_s"] == pytest.approx(0.60)
    assert row["ranks_stopped"] == 1 and row["ckpt_bytes"] == 0
    transient = [{**e, "kind": "transient"} if e["type"] == "classified" else e for e in events]
    res["events"] = [e for e in transient if e["type"] not in ("evicted", "takeover")]
    row = bench.mecefo_kind(args, "transient", tmp_path)
    assert row["resume_s"] == 0.0 and row["total_s"] == pytest.approx(0.14)  # committed then


def test_report_section_renders_the_rows_and_the_verdicts():
    from types import SimpleNamespace

    import report_anomaly

    rows = [
        {"kind": "persistent", "system": "megatron-core", "verdict": "persistent",
         "detection_s": 0.011, "judgement_s": 5.38, "resume_s": 0.03, "total_s": 5.42,
         "ranks_stopped": "all", "ckpt_bytes": 2147734, "first_exit": 16, "second_exit": 0,
         "ckpt_save_s": 0.14, "exit_s": 2.09, "process_start_s": 2.94, "first_save_s": 1.72},
        {"kind": "persistent", "system": "megatron-mecefo", "verdict": "persistent",
         "detection_s": 0.044, "judgement_s": 0.05, "resume_s": 0.43, "total_s": 0.53,
         "ranks_stopped": 1, "ckpt_bytes": 0},
    ]  # fmt: skip
    verdicts = {"reference": {"loss": [6.1, 6.0]}, "fatal=True": {"transient": {
        "first_exit": 17, "first": ["initial_run", "first_rerun_not_reproducible"],
        "verdict": "transient", "updated": False}}}  # fmt: skip
    doc = {"args": {"step": 5}, "rows": rows, "verdicts": verdicts}
    ctx = SimpleNamespace(data={"rerun_peer": doc}, provenance=lambda name: f"*{name}*")
    md = "\n".join(report_anomaly.section_rerun_peer(ctx))
    assert "| persistent | megatron-core | persistent | 0.011 s | 5.38 s | 0.03 s | 5.42 s | all " \
           "| 2.15 MB |" in md  # fmt: skip
    assert "| persistent | megatron-mecefo | persistent | 0.044 s | 0.05 s | 0.43 s | 0.53 s | 1 " \
           "| 0 |" in md  # fmt: skip
    assert "exit 16 then 0;" in md and "checkpoint save 0.14 s" in md
    assert "- `validate_result` fatal=True: transient: exit 17 (transient)." in md
    assert md.rstrip().endswith("*rerun_peer*")
