"""A stop on request (SIGUSR1, what Slurm sends before the time limit): every rank stops at the
same step after a final checkpoint, exits PREEMPTED (9), and relaunching the same command resumes
there, with plain processes and under mecefo-launch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_mecefo.checkpoint import layout
from megatron_mecefo.errors import ExitCode
from tests.helpers.launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
ROOT = Path(__file__).resolve().parents[2]


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _signal_after(pid: int, run_dir: Path, steps: int, timeout_s: float = 200) -> None:
    deadline = time.monotonic() + timeout_s
    while len(_rows(run_dir)) < steps:
        assert time.monotonic() < deadline, "the run never reached the step to signal at"
        time.sleep(0.1)
    os.kill(pid, signal.SIGUSR1)


def _checkpoint_steps(run_dir: Path) -> list[int]:
    folders = layout.candidates(run_dir / "checkpoints")
    return sorted(int(p.name.removeprefix("step_")) for p in folders)


def test_sigusr1_stops_with_a_final_checkpoint_and_resumes(tmp_path, demo_data_dir):
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "megatron_mecefo.train",
        "--config",
        "configs/run/demo_cpu.yaml",
        "--run-dir",
        str(run),
        "--max-steps",
        "400",
        f"data.demo_dir={demo_data_dir}",
        "training.eval_interval=0",
        "logging.print_interval=0",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        _signal_after(proc.pid, run, 3)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == ExitCode.PREEMPTED, out[-3000:]
    steps = [r["step"] for r in _rows(run)]
    stop = steps[-1] + 1
    assert steps == list(range(stop)) and stop < 400
    assert _checkpoint_steps(run) == [stop]  # checkpoint.interval is 0: only the final one
    assert "stopped on request" in out

    resumed = subprocess.run(
        [*cmd[:-5], "--max-steps", str(stop + 3), *cmd[-3:]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {stop}" in resumed.stdout
    assert [r["step"] for r in _rows(run)] == list(range(stop + 3))


def test_sigusr1_to_the_agent_stops_every_rank_at_one_step(tmp_path, demo_data_dir):
    def stop_it(proc: subprocess.Popen, run_dir: Path) -> None:
        _signal_after(proc.pid, run_dir, 4)

    res = launch(tmp_path, demo_data_dir, nproc=2, steps=400, while_running=stop_it, name="stopped")
    assert res.returncode == ExitCode.PREEMPTED, res.explain()
    steps = [r["step"] for r in res.metrics()]
    stop = steps[-1] + 1
    assert steps == list(range(stop)) and stop < 400, res.explain()
    assert _checkpoint_steps(res.run_dir) == [stop], res.explain()
    digests = res.state_digests()
    assert {d["next_step"] for d in digests.values()} == {stop}, digests  # the same step on all
    assert len({(d["model"], d["optimizer"]) for d in digests.values()}) == 1

    again = launch(tmp_path, demo_data_dir, nproc=2, steps=stop + 3, name="stopped")
    assert again.returncode == 0, again.explain()
    assert [r["step"] for r in again.metrics()] == list(range(stop + 3)), again.explain()
    assert "resumed from" in again.output
