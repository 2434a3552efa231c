"""The trainer's heartbeat thread: proves liveness to the coordinator independently of the
training step, publishes step progress (for hang detection), and caches the latest generation and
abort flag so the step's hot path never asks the store.

If the coordinator cannot be reached for `coordinator_timeout_s`, or it aborts the job, the thread
ends the process itself (`os._exit`): the main thread may be blocked in a collective, and a rank
must never hang on a dead coordinator.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from megatron_mecefo.errors import ExitCode
from megatron_mecefo.failover import keys
from megatron_mecefo.training.stop import StopFlag


class Heartbeat(threading.Thread):
    """Daemon thread; its own store client (TCPStore clients are not shared across threads)."""

    def __init__(
        self,
        address: str,
        rank: int,
        *,
        interval_s: float,
        coordinator_timeout_s: float,
        stop_flag: StopFlag | None = None,
    ):
        super().__init__(name=f"mecefo-heartbeat-{rank}", daemon=True)
        self.address = address
        self.rank = rank
        self.interval_s = interval_s
        self.coordinator_timeout_s = coordinator_timeout_s
        self.latest_gen = 0
        """Latest generation the coordinator published (refreshed every beat)."""
        self.progress = "idle"
        """`<incarnation>:<step>:<phase>`, set by the main thread; published when it changes."""
        self.beats = 0
        self.stop_flag = stop_flag or StopFlag()
        """A local stop request (SIGUSR1) is posted to the store; a posted one sets the flag."""
        self._stop_posted = False
        self._stop_event = threading.Event()  # not `_stop`: that is a Thread method
        self._store = keys.connect(address, coordinator_timeout_s)
        self._store.add(keys.heartbeat(rank), 1)

    def run(self) -> None:
        last_ok = time.monotonic()
        published = None
        while not self._stop_event.wait(self.interval_s):
            try:
                self._store.add(keys.heartbeat(self.rank), 1)
                if self.progress != published:
                    current = self.progress
                    self._store.set(keys.progress(self.rank), current)
                    published = current
                self.latest_gen = keys.get_int(self._store, keys.GEN)
                if self._store.check([keys.ABORT]):
                    reason = self._store.get(keys.ABORT).decode()
                    self._exit(ExitCode.JOB_ABORTED, f"the coordinator aborted the job: {reason}")
                self._sync_stop()
                self.beats += 1
                last_ok = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - any store failure counts as unreachable
                if time.monotonic() - last_ok > self.coordinator_timeout_s:
                    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    self._exit(
                        ExitCode.COORDINATOR_LOST,
                        f"coordinator unreachable for {self.coordinator_timeout_s:.1f} s ({first})",
                    )
                self._reconnect()

    def _sync_stop(self) -> None:
        if self.stop_flag.is_set and not self._stop_posted:
            self._store.set(keys.STOP, f"rank {self.rank}: {self.stop_flag.reason}")
            self._stop_posted = True
        elif not self.stop_flag.is_set and self._store.check([keys.STOP]):
            self.stop_flag.request(self._store.get(keys.STOP).decode())
            self._stop_posted = True

    def _reconnect(self) -> None:
        try:
            self._store = keys.connect(self.address, min(1.0, self.coordinator_timeout_s))
        except Exception:  # noqa: BLE001 - still unreachable; the timeout above decides
            pass

    def _exit(self, code: ExitCode, message: str) -> None:
        print(f"error: rank {self.rank}: {message}", file=sys.stderr, flush=True)
        os._exit(int(code))

    def stop(self) -> None:
        self._stop_event.set()
