"""Run `mecefo-train` on the tiny demo config (one process or N ranks, forked from a pre-imported
server), with a hard timeout; parse its metrics."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.helpers.train_server import kill_sessions

ROOT = Path(__file__).resolve().parents[2]


def demo_args(run_dir, demo_dir, steps, *extra) -> list[str]:
    """`mecefo-train` arguments of the tiny demo job (paths relative to the repository)."""
    return [
        "--config",
        "configs/run/demo_cpu.yaml",
        "--run-dir",
        str(run_dir),
        "--max-steps",
        str(steps),
        f"data.demo_dir={demo_dir}",
        "training.eval_interval=0",
        "logging.print_interval=0",
        *extra,
    ]


def run_train(run_dir, demo_dir, steps, *extra, nproc=1, timeout_s=300):
    """`mecefo-train` for `steps` steps in `nproc` ranks forked from this test process's train
    server (`train_server.py`: the env:// rendezvous torchrun sets up, no launcher); returns a
    CompletedProcess whose stdout and stderr are the ranks', in rank order."""
    args = demo_args(run_dir, demo_dir, steps, *extra)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHON=sys.executable)
    return _served_run(args, env, nproc, timeout_s)


class _TrainServer:
    """`train_server.py` in a child of this process; one order at a time."""

    START_LIMIT_S = 180.0

    def __init__(self):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.train_server"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._buf = b""
        ready = self.read(time.monotonic() + self.START_LIMIT_S)
        assert ready is not None and ready["ready"], f"the train server did not start: {ready}"

    def read(self, deadline: float) -> dict | None:
        """The next reply line, or None at the deadline (or if the server died)."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def order(self, record: dict) -> None:
        self.proc.stdin.write((json.dumps(record) + "\n").encode())
        self.proc.stdin.flush()


_server: _TrainServer | None = None


def _served_run(
    args: list[str], env: dict, world: int, timeout_s: float
) -> subprocess.CompletedProcess:
    """`python -m megatron_mecefo.train ARGS` in `world` ranks forked by the train server: the
    exit code as torchrun gives it, the ranks' stdout and stderr; on timeout their sessions are
    SIGKILLed and TimeoutExpired raised, as `subprocess.run` does."""
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = _TrainServer()
    cmd = [sys.executable, "-m", "megatron_mecefo.train", *args]
    with tempfile.TemporaryDirectory(prefix="mecefo-run-") as tmp:
        out = Path(tmp) / "rank"

        def read(kind: str) -> str:
            paths = [Path(f"{out}.{r}.{kind}") for r in range(world)]
            return "".join(p.read_text() for p in paths if p.exists())

        _server.order({"args": args, "env": env, "cwd": str(ROOT), "out": str(out), "world": world})
        deadline = time.monotonic() + timeout_s
        started = _server.read(deadline)
        assert started is not None, "the train server did not fork the run"
        done = _server.read(deadline)
        if done is None:
            kill_sessions(started["pids"])
            _server.read(time.monotonic() + 30)
            raise subprocess.TimeoutExpired(cmd, timeout_s, read("stdout"), read("stderr"))
        return subprocess.CompletedProcess(cmd, done["code"], read("stdout"), read("stderr"))


def metric_rows(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
