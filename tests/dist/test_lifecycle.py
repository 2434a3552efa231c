"""A job's lifecycle as a user meets it, with real processes: rerunning a finished run changes
nothing; killing `mecefo-launch` leaves no process behind (async checkpoint writers included) and
no C++ stack frames; a bad --inject is refused before anything starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.cli import ROOT, run_train
from tests.helpers.launch import launch

pytestmark = pytest.mark.timeout(400)


def test_rerunning_a_finished_run_changes_nothing(tmp_path, demo_data_dir):
    run_dir = tmp_path / "run"
    first = run_train(run_dir, demo_data_dir, 4, "checkpoint.interval=2")
    assert first.returncode == 0, first.stderr[-3000:]
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    again = run_train(run_dir, demo_data_dir, 4, "checkpoint.interval=2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "is already complete at step 4" in again.stdout
    assert "Traceback" not in again.stdout + again.stderr
    after = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    assert after == before  # summary.json, metrics, events, config untouched
    # ... and under mecefo-launch (2 ranks): same line, exit 0, nothing touched, and the launch
    # leaves no mecefo-coord-* folder behind in the temporary directory
    import glob
    import tempfile

    coord_dirs = set(glob.glob(os.path.join(tempfile.gettempdir(), "mecefo-coord-*")))
    res = launch(
        tmp_path,
        demo_data_dir,
        nproc=2,
        steps=4,
        name="run",
        overrides=("checkpoint.interval=2", "logging.print_interval=0"),
    )
    assert res.returncode == 0, res.explain()
    assert "is already complete at step 4" in res.output
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "mecefo-coord-*"))) <= coord_dirs


def test_killing_the_launcher_leaves_no_process_and_no_cpp_frames(tmp_path, demo_data_dir):
    """SIGKILL of mecefo-launch mid-run, with async checkpoint writers forked by the trainers:
    every process of the job is gone within seconds."""
    import psutil

    seen: set[int] = set()

    def kill_launcher(proc, run_dir):
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 6):
            assert proc.poll() is None and time.monotonic() < deadline, "the job never started"
            seen.update(p.pid for p in psutil.Process(proc.pid).children(recursive=True))
            time.sleep(0.05)
        seen.update(p.pid for p in psutil.Process(proc.pid).children(recursive=True))
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            alive = [
                pid
                for pid in seen
                if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            ]
            if not alive:
                return
            time.sleep(0.1)
        raise AssertionError(f"left behind: {[psutil.Process(p).cmdline()[:4] for p in alive]}")

    res = launch(
        tmp_path,
        demo_data_dir,
        nproc=2,
        steps=100000,
        while_running=kill_launcher,
        overrides=("checkpoint.interval=2", "checkpoint.async_save=true"),
        timeout_s=300,
    )
    assert len(seen) >= 4  # store host, coordinator, 2 trainers (+ spares, writers)
    assert "frame #" not in res.output and "Exception raised from" not in res.output


@pytest.mark.parametrize(
    "spec, message",
    [
        ("kill:2:3", "targets rank 2, but the job has 2 ranks"),
        ("kill:1:40", "the job runs steps 0..9"),
        ("kill: 1:3", "plain numbers"),
    ],
)
def test_a_bad_injection_is_refused_before_launch(tmp_path, demo_data_dir, spec, message):
    args = [
        "--config",
        "configs/run/demo_cpu.yaml",
        "--max-steps",
        "10",
        "--run-dir",
        str(tmp_path / "run"),
        f"data.demo_dir={demo_data_dir}",
        "--inject",
        spec,
    ]
    env = dict(os.environ, PYTHON=sys.executable, NPROC="2", PYTHONWARNINGS="ignore")
    for cmd in (
        ["bash", "launch/local/run.sh", *args],
        [
            sys.executable,
            "-m",
            "megatron_mecefo.failover.agent",
            "--nproc-per-node",
            "2",
            "--",
            *args,
        ],
    ):
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, (cmd[:3], out.stdout[-2000:], out.stderr[-2000:])
        assert message in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert not (tmp_path / "run").exists()
