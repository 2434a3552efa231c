"""What one trainer knows of the control plane: its store client, its heartbeat (latest generation,
job done) and the generation records, read once each.

Every wait of the trainer side asks this object whether the world moved on: a newer generation
that drops a member (`membership_lost`), a job that finished (`job_done`), a newer generation to
retarget (`wait_newer_generation`). On the hot path it asks the heartbeat's cached copies, never
the store.
"""

from __future__ import annotations

import time
from typing import Any

from megatron_mecefo.control import keys, local_beat
from megatron_mecefo.control.records import GenerationRecord
from megatron_mecefo.errors import QuorumTimeoutError


class Superseded(Exception):
    """A newer generation was published while we waited; retarget it."""

    def __init__(self, gen: int):
        super().__init__(f"superseded by generation {gen}")
        self.gen = gen


class JobDone(Exception):
    """The job finished while this rank waited (to join, or for a group to form)."""


class ControlPlane:
    """One trainer's view of the job's store (see the module docstring)."""

    def __init__(self, address: str, timeout_s: float, *, incarnation: int):
        self.address = address
        self.store = keys.connect(address, timeout_s)
        self.incarnation = incarnation
        self.hb: Any = None
        """The heartbeat thread (`liveness/heartbeat.py`), once registered."""
        self.next_step = 0
        """The step this replica's state is ready for (progress reports it while idle)."""
        self._records: dict[int, GenerationRecord] = {}
        self._done_checked = 0.0

    @property
    def latest_gen(self) -> int:
        """The newest generation the heartbeat saw (its copy lags by up to a beat)."""
        return self.hb.latest_gen if self.hb is not None else 0

    def record(self, gen: int) -> GenerationRecord:
        """Generation `gen`'s record: from the agent's folder when it fetched it for the node
        (aggregated heartbeats), else from the store."""
        if gen not in self._records:
            beat_dir = self.hb.beat_dir if self.hb is not None else None
            raw = local_beat.read_record(beat_dir, gen) if beat_dir is not None else None
            if raw is None:
                raw = self.store.get(keys.gen_record(gen))
            self._records[gen] = GenerationRecord.from_json(raw)
        return self._records[gen]

    def set_phase(self, phase: str, step: int | None = None) -> None:
        """Progress for the coordinator's hang detection: `<incarnation>:<step>:<phase>`."""
        if self.hb is not None:
            s = self.next_step if step is None else step
            self.hb.progress = f"{self.incarnation}:{s}:{phase}"

    def job_done(self) -> bool:
        """The job finished (the leader set DONE): from the agent's control file, else asked of
        the store at most every 0.2 s."""
        if self.hb is not None and self.hb.job_done:
            return True
        now = time.monotonic()
        if now - self._done_checked > 0.2:
            self._done_checked = now
            return self.store.check([keys.DONE])
        return False

    def membership_lost(self, generation: int, members: tuple[int, ...]) -> str | None:
        """Why a generation newer than `generation` dropped one of its `members`, or None.

        Every generation since counts, not only the newest: a failure generation may be
        superseded by a join that lists the same replicas again before this rank looks (a lost
        node replaced by a standby within a beat), and the peers it waits for are new processes
        (new incarnations) that never entered this reduction."""
        latest = self.latest_gen
        if latest <= generation:
            return None
        for gen in range(generation + 1, latest + 1):
            alive = set(self.record(gen).members)
            gone = [r for r in members if r not in alive]
            if gone:
                return f"generation {gen} removed replicas {gone}"
        before = self.record(generation).incarnations
        changed = sorted(
            int(rank)
            for rank, inc in self.record(latest).incarnations.items()
            if rank in before and before[rank] != inc
        )
        return f"generation {latest} has new incarnations of ranks {changed}" if changed else None

    def check_superseded(self, gen: int, deadline: float, timeout_s: float) -> None:
        """Raise `Superseded` if a newer generation exists, `JobDone` if the job ended, and
        `QuorumTimeoutError` past `deadline`."""
        latest = self.latest_gen
        if latest > gen:
            raise Superseded(latest)
        if self.job_done():  # a late joiner: the others finished meanwhile
            raise JobDone()
        if time.monotonic() > deadline:
            raise QuorumTimeoutError(f"generation {gen} did not form within {timeout_s} s")

    def wait_newer_generation(self, gen: int, deadline: float) -> int:
        """The first generation newer than `gen` (after a group of `gen` failed to form or a
        transfer broke); bounded by `deadline`."""
        while True:
            latest = self.latest_gen
            if latest <= gen:  # the heartbeat's copy lags by up to a beat: ask the store
                latest = keys.get_int(self.store, keys.GEN)
            if latest > gen:
                return latest
            if self.job_done():
                raise JobDone()
            if time.monotonic() > deadline:
                raise QuorumTimeoutError(f"no new generation after {gen} failed to form")
            time.sleep(0.02)
