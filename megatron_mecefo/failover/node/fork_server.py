"""The agent's side of the fork server: one pre-imported process per node that forks each
trainer rank (`warm_spare.py --serve`), so a rank starts, or restarts, without paying for the
interpreter and the torch/megatron imports (2-10 s of CPU each on a busy node).

Each trainer is re-parented to the agent while the agent is a child subreaper (only while it
waits for the trainer's reply), so the agent waits for it and reads its exit code, signal and
group as for a `subprocess.Popen` (`ForkedTrainer`). Whatever goes wrong (the server never
ready, an order unanswered within its deadline, the server dead) makes `start` return None, and
the agent starts the rank as a fresh process instead (`--start-method exec` does that always).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from megatron_mecefo.control.proc import ignore_stop_signal, set_child_subreaper, signal_group

REPLY_FD_ENV = "MECEFO_FORK_REPLY_FD"
"""The server's reply pipe (a file descriptor number): "ready" or why not, then one reply per
order, written by the forked trainer itself."""
CMDLINE_ROOM = 8192
"""Spaces on the server's command line: the room a forked trainer has to show its own."""
ORDER_TIMEOUT_S = 20.0
"""How long the agent waits for a forked trainer's reply before it starts the rank itself."""


class ForkedTrainer:
    """A trainer forked by the server and re-parented to this process: the part of the
    `subprocess.Popen` interface the agent uses."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its code is lost
                self.returncode = 255
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """Starts the server at once (it imports in the background); `start` forks a trainer."""

    def __init__(self, env: dict[str, str], log: Callable[[str], None]):
        self.log = log
        self.ready: bool | None = None  # None: not said yet
        self.why = ""
        self._buf = b""
        read_fd, write_fd = os.pipe()
        self._reply_fd = read_fd
        pad = " " * CMDLINE_ROOM
        # one OpenMP thread while it imports (more would start a thread pool, and a process
        # with threads is not forked); each trainer sets the number it is given
        self.threads = env.get("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_mecefo.warm_spare", "--serve", pad],
            env={**env, "OMP_NUM_THREADS": "1", REPLY_FD_ENV: str(write_fd)},
            stdin=subprocess.PIPE,
            text=True,
            pass_fds=(write_fd,),
            start_new_session=True,
            preexec_fn=ignore_stop_signal,
        )
        os.close(write_fd)

    def _read_reply(self, deadline: float, idle: Callable[[], None] | None) -> dict | None:
        """The next reply line, or None by `deadline` or when the server is gone."""
        while b"\n" not in self._buf:
            if self._reply_fd < 0:
                return None
            left = max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._reply_fd], [], [], min(left, 0.1))
            if not ready and time.monotonic() >= deadline:
                return None
            if not ready:
                if idle is not None:
                    idle()
                continue
            chunk = os.read(self._reply_fd, 4096)
            if not chunk:  # every writer closed: the server exited
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def wait_ready(self, timeout_s: float, idle: Callable[[], None] | None = None) -> bool:
        """Whether the server has imported and can fork, waiting up to `timeout_s` (`idle` runs
        every 0.1 s meanwhile, e.g. to renew a lease). A server still importing after a wait of
        `timeout_s` > 0 is given up; with 0 it is only not ready yet."""
        if self.ready is None:
            reply = self._read_reply(time.monotonic() + timeout_s, idle)
            if reply is None and timeout_s <= 0 and self.proc.poll() is None:
                return False
            self.ready = bool(reply and reply.get("ready"))
            if not self.ready:
                why = (reply or {}).get("why") or (
                    f"no answer in {timeout_s:.0f} s"
                    if self.proc.poll() is None
                    else f"it exited ({self.proc.returncode})"
                )
                self.log(f"the fork server cannot fork ({why}); ranks start as new processes")
                self.stop()
        return self.ready and self.proc.poll() is None

    def start(self, env: dict[str, str], args: list[str]) -> ForkedTrainer | None:
        """Fork a trainer with `env` on top of the server's and `args`; None if that failed."""
        if not self.ready or self.proc.poll() is not None:
            return None
        deadline = time.time() + ORDER_TIMEOUT_S
        order = {
            "env": {"OMP_NUM_THREADS": self.threads, **env},
            "args": list(args),
            "agent_pid": os.getpid(),
            "deadline": deadline,
        }
        set_child_subreaper(True)
        try:
            self.proc.stdin.write(json.dumps(order) + "\n")
            self.proc.stdin.flush()
            reply = self._read_reply(time.monotonic() + ORDER_TIMEOUT_S + 2.0, None)
        except OSError:  # BrokenPipeError: the server died
            reply = None
        finally:
            set_child_subreaper(False)
        if reply is None or "pid" not in reply:
            self.log("the fork server did not start a rank; starting it as a new process")
            self.ready = False
            self.stop()
            return None
        return ForkedTrainer(int(reply["pid"]))

    def died(self) -> bool:
        """It was serving and exited (killed, or it failed)."""
        return bool(self.ready) and self.proc.poll() is not None

    def stop(self) -> None:
        """Close the orders pipe (the server exits) and kill what is left of its group."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        signal_group(self.proc, signal.SIGKILL)
        self.proc.wait()
        if self._reply_fd >= 0:
            os.close(self._reply_fd)
            self._reply_fd = -1
