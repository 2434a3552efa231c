"""A job's lifecycle as a user meets it, with real processes: rerunning a finished run changes
nothing; killing `mecefo-launch` leaves no process behind (async checkpoint writers included) and
no C++ stack frames; a bad --inject is refused before anything starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from megatron_mecefo.control.proc import FORK_NAME
from megatron_mecefo.failover.node.agent_cli import launch_command
from megatron_mecefo.metrics.summary import check_summary
from tests.helpers.cli import ROOT, metric_rows, run_train
from tests.helpers.launch import job_processes, launch

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
    # ... and under mecefo-launch (2 ranks): same line, exit 0, nothing touched
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
    # raising max_steps trains on from the final state
    more = run_train(run_dir, demo_data_dir, 6, "checkpoint.interval=2")
    assert more.returncode == 0, more.stderr[-3000:]
    assert [r["step"] for r in metric_rows(run_dir)] == list(range(6))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["first_loss"]) == (2, metric_rows(run_dir)[4]["loss"])
    assert summary["start_step"] == 4 and check_summary(run_dir) == []  # this launch's steps


def _stop_a_checkpoint_writer(mark: bytes, proc, trainer: str, limit_s: float = 180) -> int:
    """Wait for a trainer to be mid-save (a forked writer alive and bound to die with it, and
    megatron's spawned result-queue process up under a trainer whose command line holds
    `trainer`) and SIGSTOP that writer, so the launcher is killed while the save is still under
    way however fast it is; returns the writer's pid."""
    deadline = time.monotonic() + limit_s
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint writer seen"
        procs = job_processes(mark)
        spawned = any(
            "multiprocessing.spawn" in cmd and trainer in procs.get(ppid, (0, "", ""))[2]
            for ppid, _, cmd in procs.values()
        )
        writers = [  # a fork of that trainer: same command line as its parent
            pid
            for pid, (ppid, _, cmd) in procs.items()
            if "megatron_mecefo" in cmd
            and trainer in cmd
            and ppid in procs
            and procs[ppid][2] == cmd
        ]
        for pid in writers if spawned else ():
            try:  # a writer names itself once bound to die with its trainer: stop it after that
                with open(f"/proc/{pid}/comm") as fh:
                    if fh.read().strip() != FORK_NAME:
                        continue
                os.kill(pid, signal.SIGSTOP)
            except (FileNotFoundError, ProcessLookupError):
                continue
            time.sleep(0.05)
            if job_processes(mark).get(pid, (0, ""))[1] == "T":
                return pid
        time.sleep(0.02)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killing_the_launcher_leaves_no_process_behind(tmp_path, demo_data_dir, monkeypatch, sig):
    """SIGKILL or SIGTERM to mecefo-launch mid-save (async checkpoints every 2 steps; a forked
    writer is held stopped): within a bound no process of the job is left, whatever it was
    (store host, coordinator, fork server, trainers, forked writers, megatron's spawned queue
    process), and no trainer prints a traceback or C++ frames. With SIGKILL the agent cannot
    clean up: rank 0 is killed first and restarted from the fork server (re-parented to the
    agent), so a restarted trainer is saving when the launcher dies."""
    mark = f"MECEFO_TEST_JOB={uuid.uuid4().hex}"
    monkeypatch.setenv(*mark.split("="))
    mark = mark.encode()
    seen: dict[int, tuple[int, str, str]] = {}
    log_at_signal = []
    # SIGKILL: the kernel kills the agent's children at once (PDEATHSIG), well before they
    # would stop by themselves on losing the store (failover.coordinator_timeout_s = 5 s);
    # SIGTERM: the agent stops its children's groups (waiting <= 10 s), then the store host
    bound_s = 3.0 if sig == signal.SIGKILL else 20.0
    def signal_mid_save(proc, run_dir):
        writer = _stop_a_checkpoint_writer(mark, proc, "megatron_mecefo.train")
        seen.update(job_processes(mark))
        log_at_signal.append(len((tmp_path / "run.log").read_bytes()))
        os.kill(proc.pid, sig)
        t0 = time.monotonic()
        left = seen
        while left and time.monotonic() - t0 < bound_s:
            time.sleep(0.1)
            left = job_processes(mark)
        assert not left, f"{writer=} left {time.monotonic() - t0:.0f} s after {sig!r}: {left}"

    res = launch(
        tmp_path,
        demo_data_dir,
        nproc=2,
        steps=100000,
        while_running=signal_mid_save,
        inject=("kill:0:1",) if sig == signal.SIGKILL else (),
        overrides=("checkpoint.interval=2", "checkpoint.async_save=true"),
        timeout_s=300,
    )
    kinds = [cmd.split(" -m ")[-1].split()[0] for _, _, cmd in seen.values() if " -m " in cmd]
    for kind in ("agent_cli", "store_host", "coordinator_cli", "train", "warm_spare"):
        assert any(k.endswith(kind) for k in kinds), (kind, kinds)
    assert any("multiprocessing.spawn" in cmd for _, _, cmd in seen.values())
    after = res.output.encode()[log_at_signal[0] :].decode(errors="replace")
    for bad in ("Traceback", "frame #", "Exception raised from"):
        assert bad not in after, after[-3000:]
    trainer_lines = [  # not the agents' and coordinator's ([...]) or a step's progress line
        x for x in after.splitlines() if x.strip() and not x.startswith(("[", "step "))
    ]
    assert len(trainer_lines) <= 2, after[-3000:]  # at most one line per rank


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
        launch_command(args, nproc_per_node=2),
    ):
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, (cmd[:3], out.stdout[-2000:], out.stderr[-2000:])
        assert message in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert not (tmp_path / "run").exists()


def test_summary_of_a_resumed_run_counts_its_own_launch(tmp_path, demo_data_dir, monkeypatch):
    """A resumed run appends to events.jsonl: the second launch's summary counts its own steps
    and failures, and agrees with the part of events.jsonl and metrics.jsonl that is its own.
    Neither launch leaves a mecefo-coord-* folder in the temporary directory (a private one:
    tests beside this one under xdist start coordinators of their own)."""
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    common = ("checkpoint.interval=4", "logging.print_interval=0")
    first = launch(
        tmp_path, demo_data_dir, nproc=2, steps=8, inject=("kill:1:3",), overrides=common
    )
    assert first.returncode == 0, first.explain()
    size = (first.run_dir / "events.jsonl").stat().st_size
    second = launch(
        tmp_path, demo_data_dir, nproc=2, steps=14, inject=("kill:1:10",), overrides=common
    )
    assert second.returncode == 0, second.explain()
    summary = second.summary()
    fo = summary["failover"]
    assert (summary["start_step"], summary["steps"]) == (8, 6)
    assert fo["events_start"] == size and fo["failures"] == 1, fo
    assert [e["type"] for e in second.events()].count("failure") == 2  # one per launch
    ours = [e for e in second.events() if e["step"] >= 8]
    assert ours and all(0 <= e["time_s"] < second.wall_s for e in ours)  # this launch's clock
    assert check_summary(second.run_dir) == []
    assert not list(private_tmp.glob("mecefo-coord-*"))
