"""This node's coordinator candidate under `--store etcd` (`authority/election.py`).

The agent keeps one `coordinator_cli --elect` process alive: in its own session (a stop signal to
the agent's group does not reach it), dying with the agent (PDEATHSIG: a lost node takes its
candidate with it), restarted after it exits with anything but 0 (it stood down, crashed or was
killed) until the agent stops. At most one candidate of the job coordinates at a time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass

from megatron_mecefo.control.proc import die_with_parent, ignore_stop_signal

RESTART_DELAY_S = 0.5

_ID = re.compile(r"node(\d+)(-standby)?@(.+):(\d+)")


@dataclass(frozen=True)
class CandidateId:
    """Who a candidate is: `node<N>[-standby]@host:agent pid`, the value of the leader key."""

    node: int
    standby: bool
    host: str
    agent_pid: int

    def __str__(self) -> str:
        return f"node{self.node}{'-standby' if self.standby else ''}@{self.host}:{self.agent_pid}"

    @classmethod
    def parse(cls, text: str) -> CandidateId:
        found = _ID.fullmatch(text)
        if found is None:
            raise ValueError(f"not a candidate id (node<N>[-standby]@host:pid): {text!r}")
        node, standby, host, pid = found.groups()
        return cls(int(node), standby is not None, host, int(pid))


def _child_setup() -> None:
    os.setsid()
    ignore_stop_signal()
    die_with_parent()


class CandidateKeeper:
    """Starts and restarts the candidate from a thread that lives as long as the agent (the
    PDEATHSIG of a child follows the thread that started it)."""

    def __init__(self, address: str, world: int, candidate: str, extra: list[str], log=print):
        self.cmd = [
            sys.executable,
            "-m",
            "megatron_mecefo.failover.authority.coordinator_cli",
            "--store",
            address,
            "--world-size",
            str(world),
            "--elect",
            candidate,
            *extra,
        ]
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, name="candidate", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _keep(self) -> None:
        while not self._stop.is_set():
            self.proc = subprocess.Popen(self.cmd, preexec_fn=_child_setup)
            self.starts += 1
            rc = self.proc.wait()
            if rc == 0 or self._stop.is_set():
                return
            self._stop.wait(RESTART_DELAY_S)
            if not self._stop.is_set():
                self.log(f"coordinator candidate exited ({rc}); starting a new one")
        # the thread ends only at stop(): its children's PDEATHSIG must not fire early

    def stop(self, own_exit_s: float = 3.0, wait_s: float = 10.0) -> None:
        """Give the candidate `own_exit_s` to end by itself (a finished job: the leader drains
        its events once every agent left), then SIGTERM, then SIGKILL after `wait_s`."""
        self._stop.set()
        proc = self.proc
        for limit, then in ((own_exit_s, "terminate"), (wait_s, "kill"), (5.0, "kill")):
            if proc is None:
                break
            try:
                proc.wait(limit)
                break
            except subprocess.TimeoutExpired:
                getattr(proc, then)()
        self._thread.join(5)
