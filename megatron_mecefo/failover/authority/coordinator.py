"""The membership coordinator: the single authority that declares ranks dead and publishes
generations.

It is a client of the job's store (served by `mecefo-coordinator`, `store_host.py`, which runs
it as a child, `coordinator_cli.py`, and restarts it when it dies). Every 50 ms it reads
registrations and death reports (every 100 ms heartbeats, progress markers and the agents' node
reports), takes the liveness verdicts of `failover/liveness/detector.py` (exited, silent, hung),
and publishes a new *generation* (the alive replicas, `records.GenerationRecord`) after a short
grace window, so simultaneous failures land in one decision. A replica is alive only if all its
TP x PP ranks are. Restarted replicas join the next generation once all their ranks have registered.
It gives lost nodes to standbys (`spare_pool.py`) and writes `events.jsonl` (`event_log.py`).

All of its state lives in the store, so a restarted coordinator `restore`s it (generation,
members, incarnations, evictions, job step, events written) while the trainers go on.

Split brain: the coordinator is the only authority (one at a time: each instance takes an epoch
and stops when a newer one exists). Trainers that lose the store exit (COORDINATOR_LOST); a
replica it removed is fenced (evicted by its agent, then rejoins).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from megatron_mecefo.control import keys
from megatron_mecefo.control.records import (
    GenerationRecord,
    Registration,
    post_event,
    publish_generation,
    read_generation,
)
from megatron_mecefo.failover.authority.event_log import EventLog
from megatron_mecefo.failover.authority.spare_pool import SparePool
from megatron_mecefo.failover.liveness.detector import (
    Detector,
    DetectorConfig,
    RankLog,
    parse_progress,
)

PAUSE_S = 1.0
"""A gap between two ticks longer than this means the coordinator itself was not running (starved,
stopped, restarted): the heartbeat ages it measured are not evidence, so they restart from now."""


class Coordinator:
    """The membership authority; `tick()` is one round of detection and decisions, `run()` the
    loop of the coordinator process."""

    def __init__(self, store, world_size: int, cfg: DetectorConfig, *, log=print):
        self.store = store
        self.world = world_size
        self.cfg = cfg
        self.log = log
        self.replica_size: int | None = None
        """Ranks of one replica (TP x PP), from the first registration."""
        self.gen = 0
        self.members: tuple[int, ...] = ()
        self.detector = Detector(store, world_size, cfg, log=log)
        self.started = time.monotonic()
        self.pending: dict[int, tuple[float, str]] = {}  # rank -> (failure epoch, reason)
        self.first_detection: float | None = None
        self.aborted: str | None = None
        self.events = EventLog(store, log=log)
        self._reg_seq = -1
        self.ticks = 0
        """Ticks run so far."""
        self.recovering_since: float | None = None  # every replica lost: waiting for restarts
        self._recovery: dict | None = None
        self._recover_failure_epoch: float | None = None
        self.spares = SparePool(store, cfg.agent_timeout_s, log=log)
        self._registrations = RankLog(store, keys.REG_LOG, keys.registration, self.ranks)
        self._member_set: tuple[tuple, frozenset] = ((), frozenset())
        self._admitted_at: dict[tuple[int, int], int] = {}  # (rank, inc) of a replacement -> step
        self._last_tick: float | None = None  # when the previous tick ended
        self._stale_inc: dict[int, int] = {}  # rank -> a dead incarnation still listed a member
        self.epoch = 0
        self._removal_gen = False  # the current generation removed replicas

    # ------------------------------------------------------------------ helpers
    @property
    def ranks(self):
        """Rank -> `RankState` (the detector's view, which decisions update too)."""
        return self.detector.ranks

    @property
    def job_step(self) -> int:
        return self.detector.job_step

    @property
    def num_replicas(self) -> int:
        return self.world // (self.replica_size or 1)

    @property
    def reads_heartbeats_next(self) -> bool:
        """Whether the next tick reads heartbeats and progress (every other tick, and every
        tick before the first generation)."""
        return (self.ticks + 1) % 2 == 0 or self.gen == 0

    def replica_ranks(self, replica: int) -> list[int]:
        size = self.replica_size or 1
        return list(range(replica * size, (replica + 1) * size))

    def _member_ranks(self) -> list[int]:
        return [r for rep in self.members for r in self.replica_ranks(rep)]

    # ------------------------------------------------------------------ the loop
    def run(self, should_stop: Callable[[], bool] = lambda: False) -> str:
        """Tick every `poll_s` until `should_stop()`, a newer coordinator took over, or every
        node agent has left (after at least one came); returns which."""
        agents_seen = False
        while not should_stop():
            self.tick()
            if self.ticks % 20 == 0 and self.superseded():
                self.log("[coordinator] a newer coordinator took over; stopping")
                return "superseded"
            active = keys.get_int(self.store, keys.AGENTS_ACTIVE, 0)
            agents_seen = agents_seen or active > 0
            if agents_seen and active <= 0:
                return "agents gone"  # nothing left to coordinate
            time.sleep(self.cfg.poll_s)
        return "stopped"

    # ------------------------------------------------------------------ tick
    def tick(self) -> None:
        now = time.monotonic()
        # the gap since the previous tick *ended*: a tick that is merely long (many ranks) is
        # not a pause, and must not keep resetting the silence clocks
        if self._last_tick is not None and now - self._last_tick > PAUSE_S:
            why = f"the coordinator did not run for {now - self._last_tick:.1f} s"
            self.detector.forget_ages(now, why)
        try:
            self._tick(now)
        finally:
            self._last_tick = time.monotonic()

    def _tick(self, now: float) -> None:
        self.ticks += 1
        self._read_registrations()
        if self.ticks % 2 == 0 or self.gen == 0:
            self.detector.read_heartbeats(now)
            self.spares.read(now)
        if self.aborted or self.store.check([keys.DONE]):
            self.events.drain()  # finished: exits are not failures any more
            return
        if self.gen == 0:
            self._maybe_form_first_generation(now)
        else:
            if self.detector.track_job_step(now, self._member_ranks()):
                self.store.set(keys.JOB_STEP, str(self.job_step))
            self._suspect(self.detector.detect(now, self._member_ranks(), self.pending), now)
            self.detector.read_dead_reports()
            self._decide(now)
            self._replace_lost_nodes(now)
        self.events.drain()

    def _suspect(self, found: dict[int, tuple[float, str]], now: float) -> None:
        """Ranks the detector found dead join the pending decision (the grace window starts at
        the first)."""
        self.pending.update(found)
        if found and self.first_detection is None:
            self.first_detection = now

    def _read_registrations(self) -> None:
        seq = keys.get_int(self.store, keys.REG_SEQ, 0)
        if seq == self._reg_seq:
            return
        self._reg_seq = seq
        ranks = self._registrations.new_ranks()
        regs = self.store.multi_get([keys.registration(r) for r in ranks]) if ranks else []
        for rank, raw in zip(ranks, regs):
            st, reg = self.ranks[rank], Registration.from_json(raw)
            st.node = reg.node
            self.detector.node_ids.add(st.node)
            if reg.incarnation > st.incarnation >= 0:
                self._mark_replaced(rank, st.incarnation, reg.incarnation)
            if reg.incarnation != st.incarnation:
                st.incarnation = reg.incarnation
                st.hb_value, st.hb_changed = -1, time.monotonic()
            if self.replica_size is None:
                self.replica_size = reg.replica_size
                if self.world % self.replica_size:
                    self._abort(
                        f"world size {self.world} is not divisible by TP x PP {self.replica_size}"
                    )

    def _mark_replaced(self, rank: int, old: int, new: int) -> None:
        """A member rank re-registered: its old incarnation is gone even if nobody reported it
        (a race with the death report, or a node taken over by a standby while it still ran)."""
        if self.gen == 0 or rank not in self._member_ranks():
            return
        if self.ranks[rank].evicted_incarnation >= old:
            return
        if rank in self.pending:  # already detected: evict the old one, never the new one
            self._stale_inc.setdefault(rank, old)
            return
        self._stale_inc[rank] = old
        reported_inc, epoch = self.detector.reported.get(rank, (-1, 0.0))
        failed_at = epoch if reported_inc == old else time.time()
        self.pending[rank] = (failed_at, f"replaced by incarnation {new}")
        self.first_detection = self.first_detection or time.monotonic()

    def _replace_lost_nodes(self, now: float) -> None:
        by_node: dict[int, dict[int, int]] = {}
        for rank, st in self.ranks.items():
            if st.node is not None:
                by_node.setdefault(st.node, {})[rank] = st.incarnation

        if self.ticks % 10 == 0:  # a straggler's node to a standby (`keys.RETIRE`)
            self.spares.retire(
                now,
                self.detector.nodes,
                by_node,
                self.replica_ranks,
                self._member_ranks(),
                self.job_step,
            )
        self.spares.tick(
            now,
            self.detector.nodes,
            by_node,
            lambda node, at_loss: self._trains_again(at_loss),
            self.job_step,
        )

    def _trains_again(self, at_loss: dict[int, int]) -> bool:
        """Every rank of a replaced node (`at_loss`: rank -> incarnation lost) is a member again
        in a newer incarnation, and trains: its progress shows that incarnation past the job step
        it was admitted at (admission comes a state transfer and a step before any work)."""
        trains = True
        for r, inc in at_loss.items():  # every rank's admission noted, not only up to the first
            st = self.ranks[r]
            p_inc, p_step, phase = parse_progress(st.progress)
            if r // self.replica_size not in self.members or st.incarnation <= inc:
                trains = False
                continue
            admitted = self._admitted_at.setdefault((r, st.incarnation), self.job_step)
            if p_inc != st.incarnation or phase == "idle" or p_step <= admitted:
                trains = False
        return trains

    def _maybe_form_first_generation(self, now: float) -> None:
        if len(self.detector.registered()) == self.world and self.replica_size is not None:
            self._publish(tuple(range(self.num_replicas)), removed=(), added=(), reason="start")
        elif now - self.started > self.cfg.start_timeout_s:
            missing = [r for r in self.ranks if self.ranks[r].incarnation < 0]
            self._abort(f"ranks {missing} did not register within {self.cfg.start_timeout_s} s")

    # ------------------------------------------------------------------ decisions
    def _begin_recovery(self, now: float, why: str) -> None:
        """No member is left with state: wait for the restarted ranks, which load the newest
        saved state together (`_decide` forms the recovery generation)."""
        self.members = ()
        self.recovering_since = now
        self.store.set(keys.RECOVERING, "1")
        self._recover_failure_epoch = min((t for t, _ in self.pending.values()), default=None)
        self.pending.clear()
        self.first_detection = None
        self.log(
            f"[coordinator] {why}: waiting for the restarted ranks, which load the newest state "
            "(snapshot, parity rebuild or disk)"
        )

    def _rolled_back(self, now: float) -> bool:
        """A member of this generation found optimizer shards without an exact copy
        (`keys.rollback`): every member exits by itself to reload saved state, so the job
        recovers at once. Members are not evicted (one may still be committing a checkpoint the
        rollback needs) and none of their incarnations joins again. Checked only in a
        generation that removed replicas: no other loses shards."""
        if not self._removal_gen or not self.store.check([keys.rollback(self.gen)]):
            return False
        for rank in self._member_ranks():
            self.ranks[rank].evicted_incarnation = self.ranks[rank].incarnation
        self._removal_gen = False  # decided once
        self._begin_recovery(now, f"replicas {list(self.members)} roll back")
        return True

    def _wait_for_recovery(self, added: tuple[int, ...], now: float, wait_all_s: float) -> bool:
        """Whether the recovery generation must wait for more replicas: for all of them up to
        `wait_all_s`, and for one whose agent shows its restarted ranks running (a cold start on
        a loaded node) up to `start_timeout_s`: its saved state (a snapshot of optimizer shards
        no one else holds) may be what the recovery needs."""
        if len(added) == self.num_replicas:
            return False
        waited = now - self.recovering_since
        if not added or waited < wait_all_s:
            return True
        if waited >= self.cfg.start_timeout_s:
            return False
        watch = self.detector.nodes
        return any(
            all(
                watch.starting(r, self.ranks[r].evicted_incarnation, now)
                or self.ranks[r].incarnation > self.ranks[r].evicted_incarnation
                for r in self.replica_ranks(rep)
            )
            for rep in range(self.num_replicas)
            if rep not in added
        )

    def _decide(self, now: float) -> None:
        removed: tuple[int, ...] = ()
        recovery = self._recovery_settings()
        if self._rolled_back(now):
            return
        if self.pending and now - self.first_detection >= self.cfg.grace_s:
            dead_replicas = sorted({r // self.replica_size for r in self.pending})
            removed = tuple(r for r in dead_replicas if r in self.members)
            if removed and recovery["mode"] == "restart":  # checkpoint-restart: everyone goes
                removed = self.members
        added = tuple(rep for rep in range(self.num_replicas) if self._ready_to_join(rep, now))
        if self.recovering_since is not None and not removed:
            if self._wait_for_recovery(added, now, recovery["wait_all_s"]):
                return  # restart everyone together, so they resume from one state
        if not removed and not added:
            return
        survivors = set(self.members) - set(removed)
        members = tuple(sorted(survivors | set(added)))
        if removed:
            self._report_failures(removed, now)
        if removed and not survivors:  # joiners hold no state: every replica with state is lost
            members = ()
        if not members:
            if not recovery["recoverable"]:
                self._abort(
                    "every replica is lost and neither snapshots nor checkpoints are enabled, "
                    "so no state survives (set snapshot.interval or checkpoint.interval)"
                )
                return
            self._begin_recovery(now, "every replica is lost")
            return
        if self.recovering_since is not None:
            self.recovering_since = None
            self.store.set(keys.RECOVERING, "0")
            self.pending.clear()  # deaths of incarnations that left for the recovery
            self.first_detection = None
            self._publish(
                members,
                removed=(),
                added=added,
                reason="recover",
                failure_epoch_s=self._recover_failure_epoch,
            )
            return
        if len(members) < self.cfg.min_replicas:
            self._abort(f"only {len(members)} replicas left, below min_replicas")
            return
        failure_epoch = min((t for t, _ in self.pending.values()), default=None)
        self._publish(
            members,
            removed=removed,
            added=added,
            reason="failure" if removed else "join",
            failure_epoch_s=failure_epoch if removed else None,
        )
        if removed:
            self.pending.clear()
            self.first_detection = None

    def _recovery_settings(self) -> dict:
        if self._recovery is None and self.store.check([keys.RECOVERY]):
            self._recovery = json.loads(self.store.get(keys.RECOVERY))  # same from every rank
        return self._recovery or {"mode": "failover", "recoverable": False, "wait_all_s": 60.0}

    def _report_failures(self, removed: tuple[int, ...], now: float) -> None:
        """Evict every rank of each removed replica and post one `failure` and one `detection`
        event per replica that failed (a replica leaves whole, so it fails once however many of
        its ranks died), failures first and in time order."""
        detected = time.time()
        failed_replicas = {r // self.replica_size for r in self.pending}
        lost: list[tuple[float, int, str, list[int]]] = []  # (failed at, replica, why, ranks)
        for rep in removed:
            ranks = self.replica_ranks(rep)
            if rep not in failed_replicas:  # checkpoint-restart mode: restarted with the job
                for rank in ranks:
                    self.ranks[rank].evicted_incarnation = self.ranks[rank].incarnation
                    keys.set_eviction(self.store, rank, self.ranks[rank].incarnation)
                    self.log(f"[coordinator] rank {rank} (replica {rep}) restarts with the job")
                continue
            causes, reported = [], False
            for rank in ranks:
                inc = self._stale_inc.pop(rank, self.ranks[rank].incarnation)
                self.ranks[rank].evicted_incarnation = inc
                if keys.get_int(self.store, keys.evict(rank), -1) == inc:
                    reported = True  # a previous coordinator reported it already, then died
                    continue
                keys.set_eviction(self.store, rank, inc)
                if rank not in self.pending:  # healthy, but its pipeline is broken
                    self.log(f"[coordinator] rank {rank} (replica {rep}) leaves with its replica")
                    continue
                failed_at, reason = self.pending[rank]
                injected = keys.injected(rank, inc)
                if self.store.check([injected]):  # the true failure time of an injection
                    kind, _, epoch = self.store.get(injected).decode().partition(":")
                    failed_at, reason = min(failed_at, float(epoch)), f"injected {kind}: {reason}"
                    self.pending[rank] = (failed_at, reason)
                causes.append((failed_at, rank, reason))
                self.log(f"[coordinator] rank {rank} (replica {rep}) lost: {reason}")
            if reported or not causes:
                continue
            causes.sort()
            why = "; ".join(f"rank {r}: {reason}" for _, r, reason in causes)
            if len(ranks) > len(causes):
                why += f" (replica {rep} leaves whole: ranks {ranks})"
            lost.append((causes[0][0], rep, why, ranks))
        lost.sort()
        for failed_at, rep, why, ranks in lost:
            post_event(
                self.store, "failure", epoch_s=failed_at, detail=why,
                step=max(self.job_step, 0), dp_rank=rep, ranks=ranks,
            )  # fmt: skip
        for failed_at, rep, why, ranks in lost:
            post_event(
                self.store, "detection", epoch_s=detected, detail=why,
                latency_ms=1000 * max(0.0, detected - failed_at),
                step=max(self.job_step, 0), dp_rank=rep, ranks=ranks,
            )  # fmt: skip

    def _ready_to_join(self, replica: int, now: float) -> bool:
        if self._member_set[0] is not self.members:  # a set per members tuple: O(1) lookups
            self._member_set = (self.members, frozenset(self.members))
        if replica in self._member_set[1]:
            return False
        for rank in self.replica_ranks(replica):
            st = self.ranks[rank]
            if st.incarnation <= st.evicted_incarnation or st.incarnation < 0:
                return False
            if self.detector.reported.get(rank, (-1, 0.0))[0] == st.incarnation:
                return False  # this incarnation died before it could join
            if now - st.hb_changed > self.cfg.heartbeat_timeout_s or st.hb_value < 0:
                return False
        return True

    def _publish(
        self, members, *, removed, added, reason: str, failure_epoch_s: float | None = None
    ) -> None:
        self.gen += 1
        self.members = tuple(members)
        self._removal_gen = bool(removed)
        record = GenerationRecord(
            members=list(members),
            removed=list(removed),
            added=list(added),
            reason=reason,
            replica_size=self.replica_size,
            epoch_s=time.time(),
            failure_epoch_s=failure_epoch_s,
            step=max(self.job_step, 0),
            incarnations={
                str(r): self.ranks[r].incarnation
                for rep in members
                for r in self.replica_ranks(rep)
            },
        )
        publish_generation(self.store, self.gen, record, epoch=self.epoch)
        self.log(f"[coordinator] generation {self.gen}: members {list(members)} ({reason})")

    def _abort(self, reason: str) -> None:
        self.aborted = reason
        keys.raise_flag(self.store, keys.ABORT, reason)
        post_event(self.store, "abort", step=max(self.job_step, 0), dp_rank=None, detail=reason)
        self.log(f"[coordinator] aborting the job: {reason}")

    # ------------------------------------------------------------------ restart
    def restore(self) -> None:
        """Take over from a previous coordinator of this job: rebuild the state it kept in the
        store. Ranks whose listed incarnation died meanwhile are removed at the next decision."""
        now = time.monotonic()
        self.epoch = self.store.add(keys.COORD_EPOCH, 1)
        first_start = self.store.compare_set(keys.COORD_STARTED, "", str(time.time()))
        started = float(first_start.decode())
        self.started = now - max(0.0, time.time() - started)
        self._read_registrations()
        if self.store.check([keys.ABORT]):
            self.aborted = self.store.get(keys.ABORT).decode()
        self.detector.job_step = keys.get_int(self.store, keys.JOB_STEP, -1)
        for rank, st in self.ranks.items():
            st.evicted_incarnation = keys.get_int(self.store, keys.evict(rank), -1)
            st.hb_changed = st.progress_changed = now
        self.spares.restore(self.detector.node_ids)
        self.gen = keys.get_int(self.store, keys.GEN)
        if self.gen == 0:
            return
        record = read_generation(self.store, self.gen)
        self.members, self.replica_size = tuple(record.members), int(record.replica_size)
        self._removal_gen = bool(record.removed)
        if keys.get_int(self.store, keys.RECOVERING) == 1:  # the predecessor waited for restarts
            self.members, self.recovering_since = (), now
        listed = record.incarnations
        for rank in self._member_ranks():
            inc = int(listed.get(str(rank), self.ranks[rank].incarnation))
            if self.ranks[rank].incarnation != inc:  # restarted while no coordinator ran
                self._stale_inc[rank] = inc
                self.pending[rank] = (time.time(), "restarted while the coordinator was down")
                self.first_detection = now
        self.log(
            f"[coordinator] restored (epoch {self.epoch}): generation {self.gen}, members "
            f"{list(self.members)}, job step {self.job_step}, {len(self._stale_inc)} stale rank(s)"
        )

    def superseded(self) -> bool:
        """A newer coordinator took over (this one was paused, then resumed): stop deciding."""
        return keys.get_int(self.store, keys.COORD_EPOCH) != self.epoch

    def close(self) -> None:
        self.events.close()
