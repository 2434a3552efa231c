"""The fork server (`--start-method fork`) with real processes: a trainer forked from it is
re-parented to the process that ordered it (here the test, as the agent), shows its own command
line, trains exactly as a freshly started trainer does, and reports its exit code and signal as
a child would; a server that cannot fork safely says why and is never used."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from megatron_mecefo.failover.node.fork_server import ForkServer
from tests.helpers.cli import ROOT, demo_args, metric_rows, run_train

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def server():
    lines: list[str] = []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    srv = ForkServer(env, lines.append)
    srv.lines = lines
    yield srv
    srv.stop()


def test_a_forked_trainer_is_our_child_and_trains_as_a_fresh_one(tmp_path, demo_data_dir, server):
    fresh = run_train(tmp_path / "fresh", demo_data_dir, 3)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert server.wait_ready(180), server.lines
    trainer = server.start(
        {"MECEFO_TEST_FORKED": "1"}, demo_args(tmp_path / "forked", demo_data_dir, 3)
    )
    assert trainer is not None, server.lines
    import psutil

    proc = psutil.Process(trainer.pid)
    assert proc.ppid() == os.getpid()  # re-parented to whoever ordered it
    assert "megatron_mecefo.train" in " ".join(proc.cmdline())
    assert os.getsid(trainer.pid) == trainer.pid  # its own session: signal_group reaches its forks
    assert trainer.wait(120) == 0
    fresh_losses = [r["loss"] for r in metric_rows(tmp_path / "fresh")]
    assert [r["loss"] for r in metric_rows(tmp_path / "forked")] == fresh_losses  # bit for bit
    assert server.proc.poll() is None  # the server serves on


def test_exit_codes_and_signals_reach_the_agent_and_a_dead_server_is_reported(
    tmp_path, demo_data_dir, server
):
    assert server.wait_ready(180), server.lines
    bad = server.start({}, ["--config", str(tmp_path / "missing.yaml")])
    code = subprocess.run(
        [sys.executable, "-m", "megatron_mecefo.train", "--config", str(tmp_path / "missing.yaml")],
        cwd=ROOT,
        capture_output=True,
        timeout=120,
    ).returncode
    assert code != 0 and bad.wait(120) == code  # the code a fresh process exits with
    slow = server.start({}, demo_args(tmp_path / "killed", demo_data_dir, 1000))
    os.kill(slow.pid, signal.SIGSTOP)
    slow.kill()
    assert slow.wait(30) == -signal.SIGKILL and slow.poll() == -signal.SIGKILL
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(30)
    assert server.died()
    assert server.start({}, ["--help"]) is None  # the agent then starts the rank itself


@pytest.mark.parametrize("thread", [False, True])
def test_the_server_refuses_to_fork_with_a_thread_running(thread):
    code = (
        "import threading, time\n"
        f"if {thread}: threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "from megatron_mecefo.warm_spare import fork_unsafe, preload\n"
        "preload()\n"
        "print(fork_unsafe())\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")  # as the server imports (`ForkServer`)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == ("2 threads are running" if thread else "None")
