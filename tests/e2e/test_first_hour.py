"""A new user's first hour, as the user meets it: the launcher and `mecefo-train` from a shell.

Two rules (launch/README.md): exit 0 means the job trained to its last step; a deterministic
error (configuration, layout, paths, permissions) is one line and a non-zero exit, caught by the
one-process pre-check where it can be, never restarted. Plus the launcher's own edge cases: the
project's interpreter without `PYTHON`, bad variables, a SIGKILLed launcher or head agent, a
finished run relaunched, and the coordinator's restarts all in `events.jsonl`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from megatron_mecefo.failover.node.agent_cli import launch_command
from megatron_mecefo.metrics.summary import check_summary
from tests.helpers.cli import demo_args
from tests.helpers.launch import job_processes
from tests.helpers.readme import readme_commands

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "run" / "demo_cpu.yaml"
pytestmark = pytest.mark.timeout(300)


def _env(**extra: str) -> dict[str, str]:
    """The user's environment: the venv is not on PATH and PYTHON is not set."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV")}
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != bindir)
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _run_sh(args: list[str], timeout_s: float = 240, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "launch/local/run.sh", *args],
        cwd=ROOT,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _one_error_line(res: subprocess.CompletedProcess) -> str:
    lines = [x for x in (res.stdout + res.stderr).splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stdout + res.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("env", "extra", "code", "says"),
    [
        ({"NPROC": "4"}, ["parallel.tensor_model_parallel_size=3"], 4, "TP x PP = 3 x 1"),
        ({"NPROC": "2"}, ["run_dir={tmp}/file/run"], 2, "is not a directory"),
        ({"NPROC": "2"}, ["run_dir=/proc/mecefo-run"], 2, "/proc is not writable"),
        ({"NPROC": "2"}, ["data.path=/nonexistent/c4", "data.tokenizer_model=/x.model"], 3, "c4"),
        ({"NPROC": "2"}, ["snapshot.interval=1", "snapshot.parity=rs"], 2, "parity groups"),
        ({"NPROC": "0"}, [], 2, "NPROC must be a whole number >= 1, got '0'"),
        ({"NPROC": "abc"}, [], 2, "NPROC must be a whole number >= 1, got 'abc'"),
        ({"NNODES": "2", "NSPARE": "-1", "NPROC": "1"}, [], 2, "NSPARE must be a whole number"),
        ({"MECEFO_STORE": "bogus"}, [], 2, "MECEFO_STORE must be tcp or etcd, got 'bogus'"),
    ],
    ids=["tp-does-not-divide", "run-dir-under-a-file", "run-dir-in-proc", "data-path",
         "rs-on-one-node", "nproc-0", "nproc-abc", "nspare-negative", "store-bogus"],
)  # fmt: skip
def test_a_mistake_is_one_line_before_anything_starts(tmp_path, demo_data_dir, env, extra, code,
                                                        says):  # fmt: skip
    (tmp_path / "file").touch()
    run_dir = tmp_path / "run"
    named = [x.removeprefix("run_dir=").format(tmp=tmp_path) for x in extra if "run_dir=" in x]
    extra = [x for x in extra if "run_dir=" not in x]
    start = time.monotonic()
    args = demo_args(Path(named[0]) if named else run_dir, demo_data_dir, 10, *extra)
    res = _run_sh(args, timeout_s=60, **env)
    assert res.returncode == code, res.stdout + res.stderr
    assert says in _one_error_line(res)
    assert time.monotonic() - start < 20  # the pre-check, not a start-up of every rank
    assert not run_dir.exists()


def test_an_occupied_run_dir_and_a_copied_config(tmp_path, demo_data_dir):
    """The pre-check refuses a run directory that holds another run (one line); a config copied
    out of the repository still finds its presets, and a typo is named, not a preset."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    res = _run_sh(demo_args(run_dir, demo_data_dir, 10), timeout_s=60, NPROC="2")
    assert res.returncode == 2 and "already holds a run" in _one_error_line(res)
    mine = tmp_path / "my.yaml"
    mine.write_text(CONFIG.read_text())
    dry = [sys.executable, "-m", "megatron_mecefo.train", "--config", str(mine), "--dry-run"]
    res = subprocess.run(dry, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "num_layers" in res.stdout, res.stderr
    mine.write_text(CONFIG.read_text() + "trainig:\n  lr: 0.1\n")
    res = subprocess.run(dry, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "unknown config key 'trainig'" in _one_error_line(res)


def test_a_single_process_with_an_unwritable_run_dir_is_one_line(tmp_path, demo_data_dir):
    (tmp_path / "file").touch()
    cmd = [sys.executable, "-m", "megatron_mecefo.train"]
    cmd += demo_args(tmp_path / "file" / "run", demo_data_dir, 4)
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "is not a directory" in _one_error_line(res)


def test_a_rank_with_a_deterministic_error_ends_the_job_and_is_never_restarted(
    tmp_path, demo_data_dir
):
    """Past the pre-check (mecefo-launch started directly; NCCL on a machine without CUDA is
    only found by the ranks): every rank exits 4, the agent restarts none and exits 4."""
    cmd = [str(Path(sys.executable).parent / "mecefo-launch"), "--nproc-per-node", "2", "--"]
    cmd += demo_args(tmp_path / "run", demo_data_dir, 10, "parallel.backend=nccl")
    start = time.monotonic()
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180)
    out = res.stdout + res.stderr
    assert res.returncode == 4, out
    assert "restarting rank" not in out and "needs CUDA" in out
    assert time.monotonic() - start < 90, out


def test_exit_0_only_when_the_job_trained_to_its_last_step(tmp_path, demo_data_dir):
    """The only rank dies and may not be restarted (MECEFO_MAX_RESTARTS=0): nothing trains on,
    and the launcher must not report success."""
    run_dir = tmp_path / "run"
    res = _run_sh(
        [*demo_args(run_dir, demo_data_dir, 30), "--inject", "kill:0:3"],
        NPROC="1",
        MECEFO_MAX_RESTARTS="0",
    )
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert not (run_dir / "summary.json").exists()


def test_the_readme_first_hour_commands_pasted_in_order(tmp_path, demo_data_dir):
    """The README's "Your first hour" block, run as pasted (a shell without the venv on PATH, a
    working directory where the demo already ran): the kill job recovers (one failure, one
    rejoin, a summary that agrees with the events), the second command trains on from the
    step-100 checkpoint to step 120, and the third is one line, exit 0, within seconds, touching
    nothing. No library warning reaches the user."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "launch").symlink_to(ROOT / "launch")
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parents[1])  # run.sh's own venv
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "demo_data").symlink_to(demo_data_dir)  # the config's demo_dir
    (tmp_path / "runs" / "demo_cpu").mkdir(parents=True)  # the demo's run: must not matter
    commands = readme_commands("Your first hour (CPU)")
    assert len(commands) == 3, commands
    outs = []
    for env, argv in commands:
        res = subprocess.run(
            argv, cwd=tmp_path, env=_env(**env), capture_output=True, text=True, timeout=240
        )
        outs.append(res.stdout + res.stderr)
        assert res.returncode == 0, (argv, outs[-1][-3000:])
        assert "UserWarning" not in outs[-1] and "Traceback" not in outs[-1], outs[-1]
        run_dir = tmp_path / argv[argv.index("--run-dir") + 1]
        if len(outs) == 2:  # what the third command must leave untouched
            before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    assert "val_loss @ step    99" in outs[0]  # 0-based, as "step 99 |" and metrics.jsonl
    assert "1 failure(s), 1 rejoin(s)" in outs[0], outs[0][-2000:]
    assert "resumed from" in outs[1] and "step_00000100 at step 100" in outs[1], outs[1][-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 20
    assert check_summary(run_dir) == []
    lines = [x for x in outs[2].splitlines() if x.strip()]
    assert len(lines) == 1 and "already complete" in lines[0], lines
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


def _agents(mark: bytes) -> dict[int, str]:
    return {pid: cmd for pid, (_, _, cmd) in job_processes(mark).items() if "agent_cli" in cmd}


@pytest.mark.parametrize("victim", ["launcher", "head-agent"])
def test_a_killed_launcher_or_head_agent(tmp_path, demo_data_dir, victim):
    """Two simulated nodes. SIGKILL to run.sh: no agent trains on, nothing of the job is left,
    and no agent's beat folder stays in /dev/shm. SIGKILL to the head node's agent (and so the
    store): the other node stops (6) and run.sh says so, not 137."""
    mark = f"MECEFO_TEST_JOB={uuid.uuid4().hex}"
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        ["bash", "launch/local/run.sh", *demo_args(run_dir, demo_data_dir, 100000)],
        cwd=ROOT,
        env=_env(NNODES="2", NPROC="1", **dict([mark.split("=")])),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "metrics.jsonl").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)
        agents = _agents(mark.encode())
        assert len(agents) == 2, agents
        beat_dirs = [p for p in Path("/dev/shm").glob("mecefo-beat-*") if
                     int(p.name.split("-")[2]) in agents]  # fmt: skip
        if victim == "launcher":
            os.kill(proc.pid, signal.SIGKILL)
        else:
            head = next(pid for pid, cmd in agents.items() if "--node-rank 0" in cmd)
            os.kill(head, signal.SIGKILL)
        rc = proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while job_processes(mark.encode()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert job_processes(mark.encode()) == {}
        assert beat_dirs and not [p for p in beat_dirs if p.exists()], beat_dirs
        if victim == "head-agent":
            assert rc == 6, proc.stdout.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in job_processes(mark.encode()):
            os.kill(pid, signal.SIGKILL)


def test_every_coordinator_restart_reaches_events_jsonl(tmp_path, demo_data_dir):
    """The coordinator is SIGKILLed, then its restarted successor too before it has done
    anything: both restarts are in events.jsonl, each at the step the job had reached, and the
    summary's event count agrees with the file."""
    run_dir = tmp_path / "run"
    mark = f"MECEFO_TEST_JOB={uuid.uuid4().hex}"
    proc = subprocess.Popen(
        ["bash", "launch/local/run.sh", *demo_args(run_dir, demo_data_dir, 60)],
        cwd=ROOT,
        env=_env(NPROC="2", **dict([mark.split("=")])),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )

    def coordinator() -> int | None:
        procs = job_processes(mark.encode())
        return next((p for p, (_, _, c) in procs.items() if "coordinator_cli" in c), None)

    def rows() -> int:
        path = run_dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    killed_at = []
    try:
        for target in (10, None):
            deadline = time.monotonic() + 180
            while (pid := coordinator()) is None or (target is not None and rows() < target):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
                time.sleep(0.02)
            killed_at.append(rows())
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)  # the store host restarts it; the job trains on meanwhile
        out = proc.communicate(timeout=240)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    restarts = [
        json.loads(x)
        for x in (run_dir / "events.jsonl").read_text().splitlines()
        if '"coordinator_restart"' in x
    ]
    assert len(restarts) == 2, out
    assert [r["step"] >= k for r, k in zip(restarts, killed_at)] == [True, True], (
        restarts,
        killed_at,
    )
    assert check_summary(run_dir) == []


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("store", ["tcp", "etcd"])
def test_a_store_that_does_not_answer_is_one_line_and_exit_6(tmp_path, demo_data_dir, store):
    """tcp: a node's agent started before node 0's store (here: never) waits quietly, says so in
    one line, and stops at MECEFO_COORDINATOR_WAIT_S with one line, no C++ frames. etcd: endpoints
    nobody serves are named in one line, exit 6 within seconds, not a traceback after minutes."""
    port = _closed_port()
    args = demo_args(tmp_path / "run", demo_data_dir, 10)
    if store == "tcp":
        cmd = launch_command(
            args, nproc_per_node=1, nnodes=2, node_rank=1,
            flags=["--coordinator", f"127.0.0.1:{port}"],
        )  # fmt: skip
        env = _env(MECEFO_COORDINATOR_WAIT_S="4")
    else:
        cmd = ["bash", "launch/local/run.sh", *args]
        env = _env(NPROC="1", MECEFO_STORE="etcd", MECEFO_ETCD_ENDPOINTS=f"127.0.0.1:{port}")
    start = time.monotonic()
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = res.stdout + res.stderr
    lines = [x for x in out.splitlines() if x.strip()]
    assert res.returncode == 6, out
    assert lines[-1].startswith("error: ") and f"127.0.0.1:{port}" in lines[-1], out
    assert len(lines) == (2 if store == "tcp" else 1), out  # tcp: "waiting up to 4 s ..." first
    assert "frame #" not in out and "Traceback" not in out
    assert time.monotonic() - start < 60, out


def test_ctrl_c_is_one_line_and_the_same_command_starts_over(tmp_path, demo_data_dir):
    """Ctrl-C (SIGINT to the foreground group) during training: one line, exit 130, nothing of
    the job left. Nothing was saved yet, so the same command again trains the run from step 0
    instead of refusing the run directory."""
    mark = f"MECEFO_TEST_JOB={uuid.uuid4().hex}"
    run_dir = tmp_path / "run"
    args = demo_args(run_dir, demo_data_dir, 40, "logging.print_interval=1")
    proc = subprocess.Popen(
        ["bash", "launch/local/run.sh", *args],
        cwd=ROOT,
        env=_env(NPROC="1", **dict([mark.split("=")])),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("step "):
                os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
                break
        seen.append(proc.stdout.read())
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(seen)
    assert rc == 130, out
    assert out.count("interrupted") == 1 and "Traceback" not in out, out
    deadline = time.monotonic() + 30
    while job_processes(mark.encode()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job_processes(mark.encode()) == {}
    assert (run_dir / "metrics.jsonl").exists() and not (run_dir / "summary.json").exists()
    again = _run_sh(args, NPROC="1")
    assert again.returncode == 0, again.stdout + again.stderr
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(40)), steps
    assert check_summary(run_dir) == []
