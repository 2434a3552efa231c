"""The processes of the peers benchmark (`peers.py`): each run's subprocesses by role, the polling
of its files, and the group kill: one replica's whole group (its launcher or agent and every
process under it) SIGKILLed at once when its trainer reaches the `--group-kill` step, and a new
launch in its place `--down-s` later, as a scheduler brings a replacement node. Which processes
make a group and what the new launch is are the systems' own (`peers.py`); this module only
kills, waits and reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
POLL_S = 0.05
"""How often a run's metrics.jsonl / events.jsonl are read; a row's time is when it was seen."""
GROUP_MARKER = "group_kill"
"""The file a trainer writes (its time) at the start of the group-kill step, in its system's
folder (`hold_for_kill`)."""
HOLD_S = 120.0
"""Bound on how long a trainer that reached the group-kill step waits to be killed."""


class PeersError(Exception):
    """A run failed or timed out (one line)."""


class Job:
    """Subprocesses by role, each in its own session, killed (whole trees) on close. A role
    started again (a relaunch) names its new process; the old one is kept for the close."""

    def __init__(self, log_dir: Path, timeout_s: float):
        self.procs: list[subprocess.Popen] = []
        self.roles: dict[str, subprocess.Popen] = {}
        self.log_dir = log_dir
        self.deadline = time.monotonic() + timeout_s

    def start(self, name: str, cmd: list[str], env: dict, role: str | None = None):
        log = open(self.log_dir / f"{name}.log", "w")
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.procs.append(proc)
        self.roles[role or name] = proc
        return proc

    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def left_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def close(self) -> None:
        """Kill every process still running and all their descendants (torchrun starts its
        workers in sessions of their own, so its process group does not hold them)."""
        for proc in self.procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
        for proc in self.procs:
            proc.wait()


def kill_tree(pid: int) -> list[list[str]]:
    """SIGKILL `pid` and every process under it at once (listed first, then signalled, so that
    none is re-parented away in between); returns the command lines of those signalled."""
    import psutil

    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    cmdlines = {}
    for proc in tree:
        with contextlib.suppress(psutil.Error):
            cmdlines[proc.pid] = proc.cmdline()
    signalled = []
    for proc in tree:  # one tight loop: the group dies at once
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
            signalled.append(cmdlines.get(proc.pid, []))
    return signalled


class GroupKill:
    """The group kill of one run: once `held()` (the group's trainer holds at `step`) or
    `passed()` (the job went past `step` without it), SIGKILL the tree of the job's `victim`
    role; `down_s` later `relaunch(job)` starts the new launch and returns it (None: not needed,
    the job had ended). Built for every run; `step` None: disabled."""

    def __init__(
        self,
        step: int | None,
        down_s: float,
        victim: str = "",
        held: Callable[[], bool] = lambda: False,
        passed: Callable[[], bool] = lambda: False,
        relaunch: Callable[[Job], subprocess.Popen | None] = lambda job: None,
    ):
        self.step = step
        self.down_s = down_s
        self.victim = victim
        self.held = held
        self.passed = passed
        self.was_held: bool | None = None
        self.relaunch = relaunch
        self.kill_time: float | None = None
        self.killed: subprocess.Popen | None = None
        self.cmdlines: list[list[str]] = []
        self.processes = 0
        self.new_launch: subprocess.Popen | None = None
        self.relaunched: bool | None = None

    @property
    def pending(self) -> bool:
        """Killed and not yet launched again: the run is not over."""
        return self.kill_time is not None and self.relaunched is None

    def poll(self, job: Job) -> None:
        if self.step is None or self.relaunched is not None:
            return
        if self.kill_time is None:
            self.was_held = self.held()
            if self.was_held or self.passed():
                self.killed = job.roles[self.victim]
                self.cmdlines = kill_tree(self.killed.pid)
                self.processes = len(self.cmdlines)
                self.kill_time = time.time()
                print(
                    f"[peers]   group kill at step {self.step}: {self.victim}, "
                    f"{self.processes} processes",
                    flush=True,
                )
        elif time.time() >= self.kill_time + self.down_s:
            self.new_launch = self.relaunch(job)
            self.relaunched = self.new_launch is not None

    def record(self) -> dict | None:
        """The trace's `group_kill` (None: disabled or never fired): also the exit codes of the
        killed group's top process (-9: it was SIGKILLed itself) and of the new launch."""
        if self.kill_time is None:
            return None
        return {
            "step": self.step,
            "time": self.kill_time,
            "held": self.was_held,
            "processes": self.processes,
            "victim_rc": self.killed.poll(),
            "relaunched": self.relaunched,
            "new_launch_rc": None if self.new_launch is None else self.new_launch.poll(),
        }


def marker_fired(path: Path) -> Callable[[], bool]:
    """A trigger: the trainer wrote `path` at the start of the group-kill step (and holds)."""
    return path.exists


def step_fired(path: Path, step: int) -> Callable[[], bool]:
    """A trigger: a committed row of `step` or later in the JSONL file at `path` (the job went
    past the group-kill step without the group's trainer holding there: it was still down
    after a kill, and its launcher or agent is killed now)."""
    state: dict = {"pos": (0, 0), "rows": [], "known": set()}

    def fired() -> bool:
        state["rows"].clear()  # `tail` keeps `known`: only rows not seen before come back
        state["pos"] = tail(path, state["pos"], 0.0, state["rows"], state["known"])
        return any(r.get("step", -1) >= step and r.get("committed", True) for r in state["rows"])

    return fired


def log_fired(path: Path, text: str) -> Callable[[], bool]:
    """A trigger: `text` (the trainer holding at the step) appeared in the log at `path` (read
    on from where it was read last)."""
    state = {"pos": 0, "carry": ""}

    def fired() -> bool:
        try:
            with open(path, errors="replace") as fh:
                fh.seek(state["pos"])
                chunk = fh.read()
                state["pos"] = fh.tell()
        except FileNotFoundError:
            return False
        seen = state["carry"] + chunk
        state["carry"] = seen[-len(text) :]
        return text in seen

    return fired


def hold_for_kill(marker: Path, what: str) -> None:
    """In a trainer at the group-kill step: write `marker` (the time) and wait for the benchmark
    to kill this process's whole group; exit if it never does (`HOLD_S`)."""
    marker.write_text(str(time.time()))
    print(f"[peers] {what}: group kill at this step, waiting for it", flush=True)
    time.sleep(HOLD_S)
    print(f"[peers] {what}: the group kill never came", flush=True)
    os._exit(1)


def wait_run(
    job: Job, group: GroupKill, finished: Callable[[], bool], what: str, on_poll=lambda: None
) -> float:
    """Poll (`POLL_S`) until `finished()` with no relaunch pending, `on_poll` (reading the run's
    files) and the group kill on each round, in that order: a row read in the round of the kill
    was written before it. Returns the time the job was seen finished (the end of its wall
    time); PeersError past the job's time limit."""
    while True:
        end = finished() and not group.pending
        seen = time.time()
        on_poll()
        if end:
            return seen
        group.poll(job)
        if job.expired():
            raise PeersError(f"{what}: no result within the time limit")
        time.sleep(POLL_S)


def tail(
    path: Path, pos: tuple[int, int], now: float, out: list[dict], known: set[str]
) -> tuple[int, int]:
    """Append the new complete lines of `path` to `out`, each stamped `seen` = now (`known`: the
    rows of `out` as read, kept beside it so that a poll does not rebuild it). `pos`:
    (inode, offset). A file replaced (a new inode: a run started over) or shrunk (in-job recovery
    keeps the rows before its state, rewriting the file in place) is read again from its start.
    A row already seen as it is is never added twice: it is kept history, not a step run again
    (a step run again has its own timings). Always checked, since a poll may catch a rewrite
    half done."""
    try:
        with open(path) as fh:
            st = os.fstat(fh.fileno())
            rewritten = st.st_ino != pos[0] or st.st_size < pos[1]
            offset = 0 if rewritten else pos[1]
            fh.seek(offset)
            chunk = fh.read()
    except FileNotFoundError:
        return pos
    lines = chunk.split("\n")
    for line in lines[:-1]:
        if line.strip():
            row = json.loads(line)
            text = json.dumps(row)
            if text not in known:
                known.add(text)
                out.append({**row, "seen": now})
    return st.st_ino, offset + len(chunk) - len(lines[-1])


class RunFiles:
    """metrics.jsonl and events.jsonl of a run of our trainer, read as they grow (`tail`)."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.rows: list[dict] = []
        self.events: list[dict] = []
        self._pos = [(0, 0), (0, 0)]
        self._known: tuple[set[str], set[str]] = (set(), set())

    def read(self) -> None:
        now = time.time()
        for i, (name, out) in enumerate((("metrics", self.rows), ("events", self.events))):
            path = self.run_dir / f"{name}.jsonl"
            self._pos[i] = tail(path, self._pos[i], now, out, self._known[i])


def log_tail(job: Job, name: str) -> str:
    text = (job.log_dir / f"{name}.log").read_text(errors="replace").strip().splitlines()
    return " | ".join(text[-3:])[-400:]


def run_trainer(
    name: str,
    job: Job,
    run_dir: Path,
    steps: int,
    group: GroupKill,
    *,
    launch: Callable[[Job], None],
    main: str,
) -> dict:
    """One run of our trainer: `launch(job)` starts its processes, then metrics and events are
    read as they appear, until the `main` role's process (the one whose exit ends the job; a
    relaunch may replace it) has exited (the end of the job's wall time), then every other
    role's within the time left (a replacement that was still starting may take seconds to give
    up). Exit 0 is required of each but the process the group kill killed."""
    files = RunFiles(run_dir)
    start = time.time()
    last_print = [0.0]

    def progress() -> None:
        files.read()
        if files.rows and time.time() - last_print[0] > 5:
            print(f"[peers]   {name}: step {files.rows[-1]['step'] + 1}/{steps}", flush=True)
            last_print[0] = time.time()

    try:
        launch(job)
        end = wait_run(job, group, lambda: job.roles[main].poll() is not None, name, progress)
        codes = {}
        for role, proc in job.roles.items():
            try:
                codes[role] = proc.wait(timeout=max(1.0, job.left_s()))
            except subprocess.TimeoutExpired:
                raise PeersError(f"{name}: {role} still running at the time limit") from None
        files.read()
        for role, rc in codes.items():
            if rc != 0 and job.roles[role] is not group.killed:
                raise PeersError(f"{name}: {role} exited {rc}: {log_tail(job, _log_of(job, role))}")
    finally:
        job.close()
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return {
        "start": start,
        "wall_s": end - start,
        "rows": files.rows,
        "events": files.events,
        "summary": summary,
        "exit_codes": codes,
    }


def _log_of(job: Job, role: str) -> str:
    """The log name of a role's current process (a relaunch logs as `<role>.relaunch`)."""
    relaunch = job.log_dir / f"{role}.relaunch.log"
    return f"{role}.relaunch" if relaunch.exists() else role
