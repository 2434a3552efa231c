"""The trainer's heartbeat thread: proves liveness to the coordinator independently of the
training step, publishes step progress (for hang detection), and caches the latest generation and
abort flag so the step's hot path never asks the store.

Two transports. Under `mecefo-launch` (`MECEFO_BEAT_DIR` set) the beat goes to the node agent,
which aggregates its node's beats into one store key and hands back generation, abort and stop
(`local_beat.py`): the store sees no per-rank request. Without an agent it beats to the store.

If the coordinator cannot be reached for `coordinator_timeout_s`, or it aborts the job, the thread
ends the process itself (`os._exit`): the main thread may be blocked in a collective, and a rank
must never hang on a dead coordinator. Aggregated, a rank whose agent stalls (its control file
frozen for `local_beat.AGENT_STALL_S`) beats to the store itself until the agent moves again, so
a paused or starved agent makes no live rank look dead.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from megatron_mecefo.control import keys, local_beat
from megatron_mecefo.errors import ExitCode
from megatron_mecefo.training import boundary
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
        incarnation: int = 0,
        beat_dir: str | None = None,
    ):
        super().__init__(name=f"mecefo-heartbeat-{rank}", daemon=True)
        self.address = address
        self.rank = rank
        self.interval_s = interval_s
        self.coordinator_timeout_s = coordinator_timeout_s
        self.latest_gen = 0
        """Latest generation the coordinator published (refreshed every beat)."""
        self.job_done = False
        """The job finished (DONE), as the agent's control file said (aggregated only)."""
        self.progress = "idle"
        """`<incarnation>:<step>:<phase>`, set by the main thread; published when it changes."""
        self.beats = 0
        self.stop_flag = stop_flag or StopFlag()
        """A local stop request (SIGUSR1) is posted to the store; a posted one sets the flag."""
        self._stop_posted = False
        self._stop_event = threading.Event()  # not `_stop`: that is a Thread method
        self.incarnation = incarnation
        self.beat_dir = Path(beat_dir) if beat_dir else None
        """The agent's channel folder (aggregated heartbeats), or None: beat to the store."""
        self._control_seq: int | None = None
        self._control_moved = time.monotonic()
        self._published: str | None = None
        # the per-rank key exists in both modes: the coordinator reads it until the agent's node
        # report carries this incarnation's beat
        self._store = keys.connect(address, coordinator_timeout_s)
        self._store.add(keys.heartbeat(rank), 1)
        if self.beat_dir is not None:
            try:
                self._beat_local()
            except OSError:  # the folder is gone for now (its agent recreates it): the thread
                pass  # beats to the store until it is back (`_beat_through_agent`)

    def run(self) -> None:
        last_ok = time.monotonic()
        while not self._stop_event.wait(self.interval_s):
            self.beats += 1
            if self.beat_dir is not None and self._beat_through_agent():
                continue
            try:
                self._beat_store()
                last_ok = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - any store failure counts as unreachable
                if time.monotonic() - last_ok > self.coordinator_timeout_s:
                    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    self._exit(
                        ExitCode.COORDINATOR_LOST,
                        f"coordinator unreachable for {self.coordinator_timeout_s:.1f} s "
                        f"({first}); {boundary.describe()}",
                    )
                self._reconnect()

    def _beat_local(self) -> None:
        stop = self.stop_flag.reason if self.stop_flag.is_set else None
        local_beat.write_beat(
            self.beat_dir, self.rank, self.incarnation, self.beats, self.progress, stop
        )

    def _beat_through_agent(self) -> bool:
        """Aggregated: beat to the agent's folder and take the job's state from its control
        file. False when the agent has not moved that file for `local_beat.AGENT_STALL_S` (the
        agent is paused, starved or gone): this beat then goes to the store, as without an
        agent, so a live rank never looks dead because its agent does."""
        try:
            self._beat_local()
        except OSError:  # the folder is gone: the agent stopped, or recreates it next tick
            return False
        control = local_beat.read_control(self.beat_dir)
        now = time.monotonic()
        if control is not None and control.seq != self._control_seq:
            self._control_seq, self._control_moved = control.seq, now
            self.latest_gen = max(self.latest_gen, control.gen)
            self.job_done = self.job_done or control.done
            if control.abort is not None:
                self._exit(
                    ExitCode.JOB_ABORTED, f"the coordinator aborted the job: {control.abort}"
                )
            if control.stop is not None and not self.stop_flag.is_set:
                self.stop_flag.request(control.stop)
                self._stop_posted = True
        return now - self._control_moved <= local_beat.AGENT_STALL_S

    def _beat_store(self) -> None:
        self._store.add(keys.heartbeat(self.rank), 1)
        if self.progress != self._published:
            current = self.progress
            self._store.set(keys.progress(self.rank), current)
            self._published = current
        self.latest_gen = max(self.latest_gen, keys.get_int(self._store, keys.GEN))
        if self._store.check([keys.ABORT]):
            reason = self._store.get(keys.ABORT).decode()
            self._exit(ExitCode.JOB_ABORTED, f"the coordinator aborted the job: {reason}")
        self._sync_stop()

    def _sync_stop(self) -> None:
        if self.stop_flag.is_set and not self._stop_posted:
            keys.raise_flag(self._store, keys.STOP, f"rank {self.rank}: {self.stop_flag.reason}")
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
