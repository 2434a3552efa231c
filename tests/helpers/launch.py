"""Run a real `mecefo-launch` job (coordinator + per-node agent + trainer processes) on
localhost for a test: free ports only, a hard timeout that kills the whole process group, and
the run directory's files parsed for assertions."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from megatron_mecefo.failover.node.agent_cli import launch_command

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "run" / "demo_cpu.yaml"


@dataclasses.dataclass
class LaunchResult:
    returncode: int
    output: str
    run_dir: Path
    wall_s: float
    node_codes: list[int] | None = None
    """launch_nodes: each agent's exit code (working nodes, then standbys)."""
    stopped: bool = False
    """`until_rejoined`: the job was asked to stop (exit PREEMPTED) once every failed rank was
    back and at least the requested steps were logged."""

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def losses(self) -> dict[int, float]:
        return {m["step"]: m["loss"] for m in self.metrics()}

    def events(self) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def event_types(self) -> list[str]:
        return [e["type"] for e in self.events()]

    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    def state_digests(self) -> dict[int, dict]:
        out = {}
        for path in sorted((self.run_dir / "audit").glob("state_rank*.json")):
            out[int(path.stem.removeprefix("state_rank"))] = json.loads(path.read_text())
        return out

    def task_rows(self) -> list[dict]:
        """The tasks audit rows of committed attempts (rows are logged before the vote)."""
        from megatron_mecefo.training.run_dir import committed_attempts, is_committed_row

        attempts = committed_attempts(self.run_dir)
        rows = []
        for path in sorted((self.run_dir / "audit").glob("tasks_rank*.jsonl")):
            rows += [json.loads(line) for line in path.read_text().splitlines()]
        return [row for row in rows if is_committed_row(row, attempts)]

    def committed_samples(self) -> list[tuple[int, int, int, int]]:
        """Every (step, source replica, micro-batch, sample) any rank committed, with repeats:
        a whole micro-batch gives all its samples, a slice [.., start, stop] those in range."""
        seen = []
        for row in self.task_rows():
            for task in row["tasks"]:
                start, stop = task[3:5] if len(task) >= 5 else (0, row["micro_batch_size"])
                seen += [(row["step"], task[0], task[1], j) for j in range(start, stop)]
        return seen

    def explain(self) -> str:
        return f"exit {self.returncode} after {self.wall_s:.0f} s\n{self.output[-6000:]}"


def trainer_args(
    run_dir: Path, demo_data_dir: str, steps: int, inject=(), overrides=()
) -> list[str]:
    """mecefo-train arguments of the tiny demo job the failover tests run."""
    args = [
        "--config",
        str(CONFIG),
        "--max-steps",
        str(steps),
        "--run-dir",
        str(run_dir),
        f"data.demo_dir={demo_data_dir}",
        "failover.audit=true",
        "logging.print_interval=1",
        "training.eval_interval=0",
        "training.micro_batch_size=4",
        *overrides,
    ]
    for spec in inject:
        args += ["--inject", spec]
    return args


def launch(
    tmp_path: Path,
    demo_data_dir: str,
    *,
    nproc: int = 4,
    steps: int = 16,
    inject: tuple[str, ...] = (),
    overrides: tuple[str, ...] = (),
    launch_args: tuple[str, ...] = (),
    timeout_s: float = 240,
    name: str = "run",
    while_running: Callable[[subprocess.Popen, Path], None] | None = None,
    until_rejoined: bool = False,
) -> LaunchResult:
    """Start `mecefo-launch` with the tiny demo config; wait (bounded) and collect the run.
    `until_rejoined`: see `_until_rejoined`."""
    run_dir = tmp_path / name
    if until_rejoined:
        steps, overrides, while_running = _until_rejoined(steps, overrides, while_running)
    cmd = launch_command(
        trainer_args(run_dir, demo_data_dir, steps, inject, overrides),
        nproc_per_node=nproc,
        flags=["--restart-delay-s", "0.5", *launch_args],
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    res = _run_job(cmd, env, tmp_path / f"{name}.log", run_dir, timeout_s, while_running)
    res.stopped = until_rejoined
    return res


STEP_BOUND = 400
"""The step count of a job stopped on request: a bound it never reaches."""


def _until_rejoined(
    steps: int, overrides: tuple[str, ...], while_running, *, standby: bool = False
):
    """Run at least `steps` steps and until every rank that failed has rejoined, then stop on
    request (SIGUSR1; exit PREEMPTED): a rejoin is never raced by the job's last step, however
    fast the machine. The learning rate follows a `steps`-step schedule (`lr_decay_steps`, when
    `steps` covers the warmup) and the demo corpus is one epoch either way, so the first `steps`
    steps are those of a plain `steps`-step job. `standby`: see `stop_after_rejoins`."""
    import yaml

    warmup = yaml.safe_load(CONFIG.read_text())["training"]["warmup_steps"]
    pinned = any(o.startswith("training.lr_decay_steps=") for o in overrides)
    if steps >= warmup and not pinned:  # a shorter schedule is refused (and compared nowhere)
        overrides = (*overrides, f"training.lr_decay_steps={steps}")

    def run_then_stop(proc, run_dir):
        if while_running is not None:
            while_running(proc, run_dir)
        head = proc[0] if isinstance(proc, list) else proc
        stop_after_rejoins(head, run_dir, min_steps=steps, standby=standby)

    return STEP_BOUND, overrides, run_then_stop


def _run_job(cmd, env, log_path: Path, run_dir: Path, timeout_s: float, while_running):
    """Start `cmd` in its own process group, run `while_running`, wait (bounded), kill the group
    if it is still there, and collect the result."""
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        rc = None  # a failing `while_running` leaves it unset
        try:
            if while_running is not None:
                while_running(proc, run_dir)
            rc = proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            rc = -9
        finally:
            if proc.poll() is None or rc == -9:
                _kill_group(proc)  # what it started dies with its group
    output = log_path.read_text()
    if rc == -9:
        output += f"\n[test] TIMEOUT after {timeout_s} s: killed the job"
    return LaunchResult(rc, output, run_dir, time.monotonic() - start)


def logged_steps(run_dir: Path) -> int:
    """How many rows `metrics.jsonl` holds now."""
    metrics = Path(run_dir) / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def wait_for_steps(run_dir: Path, n: int, *, proc=None, limit_s: float = 180) -> None:
    """Until `metrics.jsonl` holds `n` rows (bounded; fails at once if `proc` exited)."""
    deadline = time.monotonic() + limit_s
    while logged_steps(run_dir) < n:
        assert proc is None or proc.poll() is None, f"the job exited before {n} step(s)"
        assert time.monotonic() < deadline, f"the job never logged {n} step(s)"
        time.sleep(0.05)


def wait_for_event(run_dir: Path, kind: str, *, limit_s: float = 180) -> dict:
    """The first `kind` event of `events.jsonl`, once written (bounded)."""
    deadline = time.monotonic() + limit_s
    while True:
        path = run_dir / "events.jsonl"
        text = path.read_text() if path.exists() else ""
        for line in text[: text.rfind("\n") + 1].splitlines():  # whole lines only
            event = json.loads(line)
            if event.get("type") == kind:
                return event
        assert time.monotonic() < deadline, f"no {kind!r} event in {limit_s:.0f} s"
        time.sleep(0.1)


def stop_after_event(proc, run_dir: Path, kind: str, *, more_steps: int = 3) -> None:
    """Once a `kind` event is written and `more_steps` further steps are logged, ask the job to
    stop (SIGUSR1 to `proc`, a launcher: every rank checkpoints and stops at one step, exit
    PREEMPTED). A job whose step count is only a bound ends when what it tests has happened,
    however fast or slow the machine is."""
    wait_for_event(run_dir, kind)
    wait_for_steps(run_dir, logged_steps(run_dir) + more_steps, proc=proc)
    proc.send_signal(signal.SIGUSR1)


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def stop_after_rejoins(
    proc, run_dir: Path, *, min_steps: int, standby: bool = False, limit_s: float = 180
) -> None:
    """Once `min_steps` steps are logged, a rank has failed and every rank that failed has
    rejoined since (a `rejoin` event after its last `failure`), every node given to a standby is
    back at full strength (a `node_replaced` event after its straggler `evicted`, or with
    `standby` after its `node_lost`), and three more steps are logged, ask the job to stop
    (SIGUSR1 to `proc`). Returns at once if the job exits first (the test's assertions then say
    why)."""
    deadline = time.monotonic() + limit_s
    while proc.poll() is None:
        pending: set[int] = set()
        handed: set[tuple[int, ...]] = set()  # the ranks of nodes given to a standby
        failed = False
        for event in _events(run_dir):
            ranks = tuple(event.get("ranks") or ())
            if event["type"] == "failure":
                failed = True
                pending |= set(ranks)
            elif event["type"] == "rejoin":
                pending -= set(ranks)
            elif event["type"] == "evicted" and event.get("standby") is not None:
                handed.add(ranks)
            elif event["type"] == "node_lost" and standby:
                handed.add(ranks)
            elif event["type"] == "node_replaced":
                handed.discard(ranks)
        if failed and not pending and not handed and logged_steps(run_dir) >= min_steps:
            break
        assert time.monotonic() < deadline, (
            f"failed ranks {sorted(pending)} never rejoined, or nodes {sorted(handed)} "
            "given to a standby never came back at full strength"
        )
        time.sleep(0.05)
    else:
        return
    target = logged_steps(run_dir) + 3
    while proc.poll() is None and logged_steps(run_dir) < target:
        assert time.monotonic() < deadline, "the job stopped making progress"
        time.sleep(0.05)
    if proc.poll() is None:
        proc.send_signal(signal.SIGUSR1)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def launch_nodes(
    tmp_path: Path,
    demo_data_dir: str,
    *,
    nnodes: int,
    nproc_per_node: int = 1,
    steps: int = 16,
    inject: tuple[str, ...] = (),
    overrides: tuple[str, ...] = (),
    launch_args: tuple[str, ...] = (),
    timeout_s: float = 240,
    name: str = "run",
    while_running: Callable[[list[subprocess.Popen], Path], None] | None = None,
    standby: int = 0,
    etcd: tuple[list[str], str] | None = None,
    until_rejoined: bool = False,
) -> LaunchResult:
    """`nnodes` agents on this machine, each a simulated node (node 0 starts the coordinator on
    a port of the kernel's choice, read from its log before the others start), plus `standby`
    spare agents (`--standby`); returns node 0's result with every node's output and every
    agent's exit code. `etcd=(endpoints, job id)`: `--store etcd` on that
    cluster instead (every agent keeps a coordinator candidate; no node starts a store).
    `until_rejoined`: see `_until_rejoined` (the stop goes to node 0's agent)."""
    run_dir = tmp_path / name
    if until_rejoined:
        steps, overrides, while_running = _until_rejoined(
            steps, overrides, while_running, standby=standby > 0
        )
    port = 0  # node 0's store binds a port of the kernel's choice; the others join it
    trainer = trainer_args(run_dir, demo_data_dir, steps, inject, overrides)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    procs, logs = [], []
    start = time.monotonic()
    for node in range(nnodes + standby):
        where = (
            ["--coordinator-port", str(port)]
            if node == 0
            else ["--coordinator", f"127.0.0.1:{port}"]
        )
        if etcd is not None:
            where = ["--store", "etcd", "--etcd-endpoints", ",".join(etcd[0]), "--job-id", etcd[1]]
        if node >= nnodes:
            where.append("--standby")
        cmd = launch_command(
            trainer,
            nproc_per_node=nproc_per_node,
            nnodes=nnodes,
            node_rank=node,
            flags=["--restart-delay-s", "0.5", *where, *launch_args],
        )
        log_path = tmp_path / f"{name}.node{node}.log"
        logs.append(log_path)
        with open(log_path, "w") as log:
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=ROOT,
                    start_new_session=True,
                )
            )
        if node == 0 and etcd is None:
            port = _served_port(procs[0], log_path)
        elif node == 0:
            time.sleep(1.0)  # the coordinator first
    codes = []
    try:
        if while_running is not None:
            while_running(procs, run_dir)
        for proc in procs:
            codes.append(proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - start))))
    except subprocess.TimeoutExpired:
        codes = [-9]
    finally:
        for proc in procs:
            if proc.poll() is None or codes == [-9]:
                _kill_group(proc)
    output = "\n".join(f"--- node {i}\n{p.read_text()}" for i, p in enumerate(logs))
    rc = -9 if codes == [-9] else max(codes, key=abs)
    if codes == [-9]:
        output += f"\n[test] TIMEOUT after {timeout_s} s: killed the job"
    wall_s = time.monotonic() - start
    return LaunchResult(rc, output, run_dir, wall_s, node_codes=codes, stopped=until_rejoined)


SERVING = re.compile(r"\[coordinator\] serving on port (\d+)")


def _served_port(node0: subprocess.Popen, log: Path, bound_s: float = 60.0) -> int:
    """The port node 0's store serves on, from its log (bounded). A port picked here and handed
    to node 0 could be taken by another process before its store binds it: CI once saw
    EADDRINUSE there, and the other nodes then waited on a job that never started."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        found = SERVING.search(log.read_text(errors="replace"))
        if found:
            return int(found.group(1))
        if node0.poll() is not None:
            break
        time.sleep(0.05)
    _kill_group(node0)
    tail = log.read_text(errors="replace")[-3000:]
    raise AssertionError(f"node 0 serves no store (exit {node0.poll()}):\n{tail}")


def job_processes(mark: bytes) -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, command line) of every live process whose environment holds
    `mark`: every process of a job inherits it (forked and spawned writers too), whoever its
    parent is now."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as fh:
                state, ppid = fh.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if mark in env and state != "Z":
            found[int(entry)] = (int(ppid), state, cmd)
    return found


def gloo_transport_threads(pid: int) -> int:
    """How many gloo transport threads (`gloo_tcp_loop`, one per live gloo group) `pid` has."""
    n = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                n += fh.read().strip() == "gloo_tcp_loop"
        except OSError:
            pass  # the thread ended meanwhile
    return n


def launch_script(
    tmp_path: Path,
    demo_data_dir: str,
    *,
    env: dict[str, str],
    steps: int = 16,
    overrides: tuple[str, ...] = (),
    timeout_s: float = 300,
    name: str = "run",
    while_running: Callable[[subprocess.Popen, Path], None] | None = None,
) -> LaunchResult:
    """`launch/local/run.sh` as a user runs it (`env`: NNODES, NSPARE, NPROC, MECEFO_STORE, ...),
    its exit code the job's; every agent's output is in `output`. `script_agent` finds a node's
    agent among the script's children."""
    run_dir = tmp_path / name
    cmd = [
        "bash",
        "launch/local/run.sh",
        *trainer_args(run_dir, demo_data_dir, steps, (), overrides),
    ]
    full_env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
        **env,
    }
    return _run_job(cmd, full_env, tmp_path / f"{name}.log", run_dir, timeout_s, while_running)


def script_agent(proc: subprocess.Popen, node: int):
    """psutil.Process of node `node`'s agent (`mecefo-launch --node-rank node`) under run.sh."""
    import psutil

    for child in psutil.Process(proc.pid).children():
        cmd = child.cmdline()
        if "megatron_mecefo.failover.node.agent_cli" in cmd and "--node-rank" in cmd:
            if cmd[cmd.index("--node-rank") + 1] == str(node):
                return child
    raise AssertionError(f"no agent of node {node} under run.sh (pid {proc.pid})")
