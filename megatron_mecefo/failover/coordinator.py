"""The membership coordinator: the single authority that declares ranks dead and publishes
generations.

It is a client of the job's store (served by `mecefo-coordinator`, `store_host.py`, which runs
this module as a child and restarts it when it dies). Every 50 ms it reads death reports (every
100 ms heartbeats, progress markers and the agents' node reports), declares ranks dead (reported
exit; heartbeat silence, judged with the agents' evidence: `liveness.py`; or a hang: not moving
while another member is ahead of it, for longer than max(floor, factor x step time)), and publishes
a new *generation* (the alive replicas) after a short grace window, so simultaneous failures land
in one decision. A replica is alive only if all its TP ranks are. Restarted replicas join the next
generation once all their ranks have registered. It also writes `events.jsonl` for the run.

All of its state lives in the store, so a restarted coordinator `restore`s it (generation,
members, incarnations, evictions, job step, events written) while the trainers go on.

Split brain: the coordinator is the only authority (one at a time: each instance takes an epoch
and stops when a newer one exists). Trainers that lose the store exit (COORDINATOR_LOST); a
replica it removed is fenced (evicted by its agent, then rejoins).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

from megatron_mecefo.failover import keys
from megatron_mecefo.failover.liveness import NodeWatch, Verdict, node_key
from megatron_mecefo.failover.local_beat import AGENT_STALL_S
from megatron_mecefo.failover.spares import SparePool
from megatron_mecefo.metrics.events import EventWriter

EVENT_WAIT_S = 5.0
"""How long a posted event number may lack its value before it is skipped (its poster died)."""
PAUSE_S = 1.0
"""A gap between two ticks longer than this means the coordinator itself was not running (starved,
stopped, restarted): the heartbeat ages it measured are not evidence, so they restart from now."""


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


@dataclasses.dataclass(kw_only=True)
class DetectorConfig:
    """Detection and membership knobs (flags of mecefo-coordinator / mecefo-launch)."""

    heartbeat_timeout_s: float = 3.0
    """Soft timeout: a rank whose heartbeat has not moved for this long is dead if its agent sees
    it stopped or gone, or its agent is silent too (SIGSTOP, node loss)."""
    heartbeat_hard_timeout_s: float = 60.0
    """Hard timeout: a silent rank whose agent still sees it alive (a starved interpreter, an
    overloaded host) is declared dead only after this long."""
    agent_timeout_s: float = 5.0
    """A node agent whose report has not moved for this long is gone (with its node)."""
    hang_timeout_floor_s: float = 10.0
    """Lower bound of the hang timeout (a rank computing while the others wait to reduce)."""
    hang_timeout_factor: float = 5.0
    """Hang timeout = max(floor, factor x the job's measured step time)."""
    grace_s: float = 0.2
    """After the first detection, wait this long to batch simultaneous failures."""
    start_timeout_s: float = 600.0
    """Abort if not every rank registered within this time at start."""
    min_replicas: int = 1
    """Abort the job (JOB_ABORTED) if fewer replicas than this would remain."""
    poll_s: float = 0.05
    """Tick period (heartbeats and progress are read every other tick)."""

    def __post_init__(self) -> None:
        for name in (
            "heartbeat_timeout_s",
            "heartbeat_hard_timeout_s",
            "agent_timeout_s",
            "hang_timeout_floor_s",
            "start_timeout_s",
            "poll_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.heartbeat_hard_timeout_s < self.heartbeat_timeout_s:
            raise ValueError("heartbeat_hard_timeout_s must be >= heartbeat_timeout_s")
        if self.grace_s < 0 or self.hang_timeout_factor <= 0 or self.min_replicas < 1:
            raise ValueError("grace_s must be >= 0, hang_timeout_factor > 0, min_replicas >= 1")


@dataclasses.dataclass
class _RankState:
    incarnation: int = -1
    hb_value: int = -1
    hb_changed: float = 0.0
    progress: str = ""
    progress_changed: float = 0.0
    evicted_incarnation: int = -1
    slow_since: float | None = None  # silent but alive (logged once per episode)
    node: int | None = None  # the node (agent) it runs on, from its registration
    hb_source: str = ""  # where hb_value was read: "agent" (node report) or "store" (own key)


class Coordinator:
    """The membership authority; `tick()` is one round of detection and decisions."""

    def __init__(self, store, world_size: int, cfg: DetectorConfig, *, log=print):
        self.store = store
        self.world = world_size
        self.cfg = cfg
        self.log = log
        self.tp: int | None = None
        self.gen = 0
        self.members: tuple[int, ...] = ()
        self.ranks = {r: _RankState() for r in range(world_size)}
        self.started = time.monotonic()
        self.pending: dict[int, tuple[float, str]] = {}  # rank -> (failure epoch, reason)
        self.first_detection: float | None = None
        self.job_step = -1
        self.step_changed = time.monotonic()
        self.step_time_s: float | None = None
        self.aborted: str | None = None
        self.writer: EventWriter | None = None
        self.next_event = 1
        self._reg_seq = -1
        self._ticks = 0
        self._dead_seq = -1
        self.reported: dict[int, tuple[int, float]] = {}  # rank -> (incarnation, failure epoch)
        self.recovering_since: float | None = None  # every replica lost: waiting for restarts
        self._recovery: dict | None = None
        self._recover_failure_epoch: float | None = None
        self.nodes = NodeWatch(cfg.agent_timeout_s)
        self.spares = SparePool(store, cfg.agent_timeout_s, log=log)
        self._node_ids: set[int] = set()
        self._log_pos: dict[str, int] = {}  # REG_LOG / DEAD_LOG -> characters read so far
        self._member_set: tuple[tuple, frozenset] = ((), frozenset())
        self._admitted_at: dict[tuple[int, int], int] = {}  # (rank, inc) of a replacement -> step
        self._all_silent = False  # every member silent at once (logged when it starts)
        self._last_tick: float | None = None  # when the previous tick ended
        self._front: tuple[int, int] | None = None  # furthest (step, phase) among members
        self._front_of: dict | None = None  # the progress map `_front` was computed from
        self._event_missing: dict[int, float] = {}  # event index -> first seen without a value
        self._stale_inc: dict[int, int] = {}  # rank -> a dead incarnation still listed a member
        self.epoch = 0

    # ------------------------------------------------------------------ helpers
    @property
    def num_replicas(self) -> int:
        return self.world // (self.tp or 1)

    def replica_ranks(self, replica: int) -> list[int]:
        tp = self.tp or 1
        return list(range(replica * tp, (replica + 1) * tp))

    def _member_ranks(self) -> list[int]:
        return [r for rep in self.members for r in self.replica_ranks(rep)]

    # ------------------------------------------------------------------ tick
    def tick(self) -> None:
        now = time.monotonic()
        # the gap since the previous tick *ended*: a tick that is merely long (many ranks) is
        # not a pause, and must not keep resetting the silence clocks
        if self._last_tick is not None and now - self._last_tick > PAUSE_S:
            self._forget_ages(now, f"the coordinator did not run for {now - self._last_tick:.1f} s")
        try:
            self._tick(now)
        finally:
            self._last_tick = time.monotonic()

    def _tick(self, now: float) -> None:
        self._ticks += 1
        self._read_registrations()
        if self._ticks % 2 == 0 or self.gen == 0:
            self._read_heartbeats(now)
            self.spares.read(now)
        if self.aborted or self.store.check([keys.DONE]):
            self._drain_events()  # finished: exits are not failures any more
            return
        if self.gen == 0:
            self._maybe_form_first_generation(now)
        else:
            self._track_job_step(now)
            self._detect(now)
            self._read_dead_reports()
            self._decide(now)
            self._replace_lost_nodes(now)
        self._drain_events()

    def _read_registrations(self) -> None:
        seq = keys.get_int(self.store, keys.REG_SEQ, 0)
        if seq == self._reg_seq:
            return
        self._reg_seq = seq
        ranks = self._logged_ranks(keys.REG_LOG, keys.registration)
        regs = self.store.multi_get([keys.registration(r) for r in ranks]) if ranks else []
        for rank, raw in zip(ranks, regs):
            st, reg = self.ranks[rank], json.loads(raw)
            if "node" in reg:
                st.node = int(reg["node"])
                self._node_ids.add(st.node)
            if reg["incarnation"] > st.incarnation >= 0:
                self._mark_replaced(rank, st.incarnation, reg["incarnation"])
            if reg["incarnation"] != st.incarnation:
                st.incarnation = reg["incarnation"]
                st.hb_value, st.hb_changed = -1, time.monotonic()
            if self.tp is None:
                self.tp = int(reg["tp"])
                if self.world % self.tp:
                    self._abort(f"world size {self.world} is not divisible by TP {self.tp}")

    def _logged_ranks(self, log_key: str, key_of) -> list[int]:
        """Ranks appended to `log_key` since the last read: one request, not one per rank. A store
        written without the log (an older writer) is scanned rank by rank instead."""
        if not self.store.check([log_key]):
            return [r for r in self.ranks if self.store.check([key_of(r)])]
        ranks, self._log_pos[log_key] = keys.new_log_entries(
            self.store, log_key, self._log_pos.get(log_key, 0)
        )
        return [r for r in ranks if r in self.ranks]

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
        reported_inc, epoch = self.reported.get(rank, (-1, 0.0))
        failed_at = epoch if reported_inc == old else time.time()
        self.pending[rank] = (failed_at, f"replaced by incarnation {new}")
        self.first_detection = self.first_detection or time.monotonic()

    def _replace_lost_nodes(self, now: float) -> None:
        by_node: dict[int, dict[int, int]] = {}
        for rank, st in self.ranks.items():
            if st.node is not None:
                by_node.setdefault(st.node, {})[rank] = st.incarnation

        self.spares.tick(
            now,
            self.nodes,
            by_node,
            lambda node, at_loss: self._trains_again(at_loss),
            self.job_step,
        )

    def _trains_again(self, at_loss: dict[int, int]) -> bool:
        """Every rank of a replaced node (`at_loss`: rank -> incarnation lost) is a member again
        in a newer incarnation, and trains: its progress shows that incarnation past the job step
        it was admitted at (admission comes a state transfer and a step before any work)."""
        for r, inc in at_loss.items():
            st = self.ranks[r]
            p_inc, p_step, phase = _parse_progress(st.progress)
            if r // self.tp not in self.members or st.incarnation <= inc:
                return False
            admitted = self._admitted_at.setdefault((r, st.incarnation), self.job_step)
            if p_inc != st.incarnation or phase == "idle" or p_step <= admitted:
                return False
        return True

    def _registered(self) -> list[int]:
        return [r for r, st in self.ranks.items() if st.incarnation >= 0]

    def _read_heartbeats(self, now: float) -> None:
        """Beats and progress: from the agents' node reports (aggregated, one multi_get for every
        node), and from the per-rank keys only for ranks no fresh report carries (no agent, the
        agent has yet to report this incarnation, or it stalled and its ranks beat directly)."""
        covered = self._read_node_reports(now)
        ranks = [r for r in self._registered() if r not in covered]
        if not ranks:
            return
        values = self.store.multi_get([keys.heartbeat(r) for r in ranks])
        progress = self.store.multi_get([keys.progress(r) for r in ranks])
        for rank, hb, prog in zip(ranks, values, progress):
            self._saw_beat(self.ranks[rank], "store", int(hb.decode()), prog.decode(), now)

    def _read_node_reports(self, now: float) -> set[int]:
        """Feed the agents' reports to `self.nodes`; the ranks whose beat a fresh one carried."""
        names = [node_key(n) for n in sorted(self._node_ids)]
        if not names:
            return set()
        if self.store.check(names):  # every node has reported: one request for all
            present = names
        else:
            present = [k for k in names if self.store.check([k])]
        covered = set()
        for name, raw in zip(present, self.store.multi_get(present) if present else []):
            node, report = int(name.rpartition("/")[2]), json.loads(raw)
            self.nodes.update_report(node, report, now)
            if self.nodes.silent_s(node, now) > AGENT_STALL_S:
                continue  # a stalled agent: its ranks beat to the store meanwhile
            for rank, entry in report["ranks"].items():
                st = self.ranks.get(int(rank))
                if st is None or len(entry) < 6 or entry[0] != st.incarnation:
                    continue  # no beat yet (or an older incarnation's): per-rank keys
                covered.add(int(rank))
                self._saw_beat(st, "agent", entry[4], entry[5], now)
        return covered

    @staticmethod
    def _saw_beat(st: _RankState, source: str, value: int, progress: str, now: float) -> None:
        """A counter that moved is a beat; one read from the other source only sets the base."""
        if source != st.hb_source:
            st.hb_source, st.hb_value = source, value
        elif value != st.hb_value:
            st.hb_value, st.hb_changed = value, now
        if progress != st.progress:
            st.progress, st.progress_changed = progress, now

    def _forget_ages(self, now: float, why: str) -> None:
        """Restart every silence clock from now (see PAUSE_S)."""
        self.log(f"[coordinator] {why}: heartbeat and progress ages restart from now")
        for st in self.ranks.values():
            st.hb_changed = st.progress_changed = now
        self.nodes.refresh(now)
        self.step_changed = now

    def _maybe_form_first_generation(self, now: float) -> None:
        if len(self._registered()) == self.world and self.tp is not None:
            self._publish(tuple(range(self.num_replicas)), removed=(), added=(), reason="start")
        elif now - self.started > self.cfg.start_timeout_s:
            missing = [r for r in self.ranks if self.ranks[r].incarnation < 0]
            self._abort(f"ranks {missing} did not register within {self.cfg.start_timeout_s} s")

    def _track_job_step(self, now: float) -> None:
        steps = [_parse_progress(self.ranks[r].progress)[1] for r in self._member_ranks()]
        step = max(steps, default=-1)
        if step > self.job_step:
            if self.job_step >= 0:
                dt = (now - self.step_changed) / (step - self.job_step)
                ema = self.step_time_s
                self.step_time_s = dt if ema is None else 0.8 * ema + 0.2 * dt
            self.job_step, self.step_changed = step, now
            self.store.set(keys.JOB_STEP, str(step))

    def hang_timeout_s(self) -> float:
        factor = self.cfg.hang_timeout_factor * (self.step_time_s or 0.0)
        return max(self.cfg.hang_timeout_floor_s, factor)

    # ------------------------------------------------------------------ detection
    def _detect(self, now: float) -> None:
        self._read_dead_reports()
        member_ranks = self._member_ranks()
        progress = {r: _parse_progress(self.ranks[r].progress) for r in member_ranks}
        soft = self.cfg.heartbeat_timeout_s
        all_silent = bool(member_ranks) and all(
            now - self.ranks[r].hb_changed > soft for r in member_ranks
        )
        if all_silent != self._all_silent:
            self._all_silent = all_silent
            if all_silent:
                self.log(
                    "[coordinator] every member is silent at once: a stalled control plane (store, "
                    "host) looks the same and acting gains nothing, so silence alone waits for the "
                    f"hard timeout ({self.cfg.heartbeat_hard_timeout_s:.0f} s)"
                )
        for rank in member_ranks:
            if rank in self.pending:
                continue
            st = self.ranks[rank]
            reason = None
            failed_at = time.time()
            inc, epoch = self.reported.get(rank, (-1, 0.0))
            if inc == st.incarnation:
                reason, failed_at = "process exited", epoch
            if reason is None:
                reason = self._silence(rank, st, now, all_silent=all_silent)
                if reason is not None:
                    failed_at -= now - st.hb_changed
            if reason is None and self._is_hung(rank, progress, now):
                reason = f"hung in step {progress[rank][1]} for {now - st.progress_changed:.1f} s"
                failed_at -= now - st.progress_changed
            if reason is not None:
                self.pending[rank] = (failed_at, reason)
                if self.first_detection is None:
                    self.first_detection = now

    def _silence(
        self, rank: int, st: _RankState, now: float, *, all_silent: bool = False
    ) -> str | None:
        """Why `rank`'s heartbeat silence makes it dead, or None while it does not (yet). When
        every member is silent at once, only the kernel's evidence (stopped, gone) or the hard
        timeout decides."""
        silent = now - st.hb_changed
        if silent <= self.cfg.heartbeat_timeout_s:
            st.slow_since = None
            return None
        if (
            all_silent
            and silent <= self.cfg.heartbeat_hard_timeout_s
            and not self.nodes.kernel_says_gone(rank, st.incarnation)
        ):
            return None
        verdict, why = self.nodes.verdict(rank, st.incarnation, now, silent_since=st.hb_changed)
        if verdict is Verdict.SLOW and silent <= self.cfg.heartbeat_hard_timeout_s:
            if st.slow_since is None:
                st.slow_since = now
                self.log(
                    f"[coordinator] rank {rank}: no heartbeat for {silent:.1f} s but {why}: slow, "
                    f"not dead (hard timeout {self.cfg.heartbeat_hard_timeout_s:.0f} s)"
                )
            return None
        return f"no heartbeat for {silent:.1f} s ({why})"

    def _read_dead_reports(self) -> None:
        seq = keys.get_int(self.store, keys.DEAD_SEQ, 0)
        if seq == self._dead_seq:
            return
        self._dead_seq = seq
        ranks = self._logged_ranks(keys.DEAD_LOG, keys.dead)
        for rank, raw in zip(ranks, self.store.multi_get([keys.dead(r) for r in ranks])):
            inc, _, epoch = raw.decode().partition(":")
            self.reported[rank] = (int(inc), float(epoch))

    def _is_hung(self, rank: int, progress: dict, now: float) -> bool:
        """Another member is ahead of `rank` (a later step, or the same step's reduction) and
        `rank` has not moved for the hang timeout. Everyone inside one long step is not a hang,
        nor is a state transfer (phase idle)."""
        _, step, phase = progress[rank]
        if phase == "idle":  # joining / regrouping: bounded by the trainers' regroup timeout
            return False
        if self._front_of is not progress:  # the furthest member: one pass per tick, not per rank
            self._front_of = progress
            self._front = max(
                ((s, _PHASE_ORDER.get(ph, -1)) for _, s, ph in progress.values()), default=None
            )
        ahead = self._front is not None and self._front > (step, _PHASE_ORDER.get(phase, -1))
        return ahead and now - self.ranks[rank].progress_changed > self.hang_timeout_s()

    # ------------------------------------------------------------------ decisions
    def _decide(self, now: float) -> None:
        removed: tuple[int, ...] = ()
        recovery = self._recovery_settings()
        if self.pending and now - self.first_detection >= self.cfg.grace_s:
            dead_replicas = sorted({r // self.tp for r in self.pending})
            removed = tuple(r for r in dead_replicas if r in self.members)
            if removed and recovery["mode"] == "restart":  # checkpoint-restart: everyone goes
                removed = self.members
        added = tuple(rep for rep in range(self.num_replicas) if self._ready_to_join(rep, now))
        if self.recovering_since is not None and not removed:
            waited = now - self.recovering_since
            if len(added) < self.num_replicas and (not added or waited < recovery["wait_all_s"]):
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
            self.members = ()
            self.recovering_since = now
            self._recover_failure_epoch = min((t for t, _ in self.pending.values()), default=None)
            self.pending.clear()
            self.first_detection = None
            self.log(
                "[coordinator] every replica is lost: waiting for the restarted ranks, which "
                "load the newest state (snapshot, parity rebuild or disk)"
            )
            return
        if self.recovering_since is not None:
            self.recovering_since = None
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
        detected = time.time()
        failed_replicas = {r // self.tp for r in self.pending}
        for rep in removed:
            for rank in self.replica_ranks(rep):
                st = self.ranks[rank]
                if rep not in failed_replicas:  # checkpoint-restart mode: restarted with the job
                    st.evicted_incarnation = st.incarnation
                    keys.set_eviction(self.store, rank, st.incarnation)
                    self.log(f"[coordinator] rank {rank} (replica {rep}) restarts with the job")
                    continue
                failed_at, reason = self.pending.get(rank, (detected, "TP peer of a lost rank"))
                inc = self._stale_inc.pop(rank, st.incarnation)
                st.evicted_incarnation = inc
                if keys.get_int(self.store, keys.evict(rank), -1) == inc:
                    continue  # a previous coordinator reported it already, then died
                injected = keys.injected(rank, inc)
                if self.store.check([injected]):  # the true failure time of an injection
                    kind, _, epoch = self.store.get(injected).decode().partition(":")
                    failed_at, reason = min(failed_at, float(epoch)), f"injected {kind}: {reason}"
                    self.pending[rank] = (failed_at, reason)
                self.pending.setdefault(rank, (failed_at, reason))
                keys.set_eviction(self.store, rank, inc)
                common = dict(step=max(self.job_step, 0), dp_rank=rep, ranks=[rank])
                keys.post_event(self.store, "failure", epoch_s=failed_at, detail=reason, **common)
                keys.post_event(
                    self.store,
                    "detection",
                    epoch_s=detected,
                    latency_ms=1000 * max(0.0, detected - failed_at),
                    detail=reason,
                    **common,
                )
                self.log(f"[coordinator] rank {rank} (replica {rep}) lost: {reason}")

    def _ready_to_join(self, replica: int, now: float) -> bool:
        if self._member_set[0] is not self.members:  # a set per members tuple: O(1) lookups
            self._member_set = (self.members, frozenset(self.members))
        if replica in self._member_set[1]:
            return False
        for rank in self.replica_ranks(replica):
            st = self.ranks[rank]
            if st.incarnation <= st.evicted_incarnation or st.incarnation < 0:
                return False
            if self.reported.get(rank, (-1, 0.0))[0] == st.incarnation:
                return False  # this incarnation died before it could join
            if now - st.hb_changed > self.cfg.heartbeat_timeout_s or st.hb_value < 0:
                return False
        return True

    def _publish(
        self, members, *, removed, added, reason: str, failure_epoch_s: float | None = None
    ) -> None:
        self.gen += 1
        self.members = tuple(members)
        record = {
            "members": list(members),
            "removed": list(removed),
            "added": list(added),
            "reason": reason,
            "tp": self.tp,
            "epoch_s": time.time(),
            "failure_epoch_s": failure_epoch_s,
            "step": max(self.job_step, 0),
            # which incarnation of each rank the generation is for: a restarted rank must not
            # try to form an older generation that still lists its dead predecessor
            "incarnations": {
                str(r): self.ranks[r].incarnation
                for rep in members
                for r in self.replica_ranks(rep)
            },
        }
        self.store.set(keys.gen_record(self.gen), json.dumps(record))
        self.store.set(keys.GEN, str(self.gen))
        self.log(f"[coordinator] generation {self.gen}: members {list(members)} ({reason})")

    def _abort(self, reason: str) -> None:
        self.aborted = reason
        keys.raise_flag(self.store, keys.ABORT, reason)
        keys.post_event(
            self.store, "abort", step=max(self.job_step, 0), dp_rank=None, detail=reason
        )
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
        self.job_step = keys.get_int(self.store, keys.JOB_STEP, -1)
        for rank, st in self.ranks.items():
            st.evicted_incarnation = keys.get_int(self.store, keys.evict(rank), -1)
            st.hb_changed = st.progress_changed = now
        self.spares.restore(self._node_ids)
        self.gen = keys.get_int(self.store, keys.GEN)
        if self.gen == 0:
            return
        record = json.loads(self.store.get(keys.gen_record(self.gen)))
        self.members, self.tp = tuple(record["members"]), int(record["tp"])
        listed = record.get("incarnations", {})
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

    # ------------------------------------------------------------------ events
    def _drain_events(self) -> None:
        if self.writer is None:
            if not self.store.check([keys.RUN_DIR]):
                return
            run_dir, _, start = self.store.get(keys.RUN_DIR).decode().rpartition("|")
            path = Path(run_dir) / "events.jsonl"
            ours = keys.get_int(self.store, keys.JOB_EVENTS_START)  # earlier launches end here
            self.next_event = max(self.next_event, _last_seq(path, ours) + 1)
            self.writer = EventWriter(path, float(start))
        last = keys.get_int(self.store, keys.EVENT_SEQ, 0)
        while self.next_event <= last:
            key = keys.event(self.next_event)
            if not self.store.check([key]):  # posted counter first, value next: next tick
                since = self._event_missing.setdefault(self.next_event, time.monotonic())
                if time.monotonic() - since < EVENT_WAIT_S:
                    return
                self.log(
                    f"[coordinator] event {self.next_event} was never written (its poster "
                    f"died between the two store calls); skipping it"
                )
                self.next_event += 1
                continue
            ev = json.loads(self.store.get(key))
            epoch = ev.pop("epoch_s")
            ev_type = ev.pop("type")
            # `seq` lets a restarted coordinator skip what its predecessor wrote before dying
            self.writer.write(ev_type, time_s=epoch, seq=self.next_event, **ev)
            self.next_event += 1

    def close(self) -> None:
        try:
            self._drain_events()
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
        if self.writer is not None:
            self.writer.close()


def _last_seq(path: Path, start: int = 0) -> int:
    """The `seq` of the last complete line of an events file after byte `start` (0 if none)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(start, fh.tell() - 65536))
            lines = fh.read().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line).get("seq", 0))
        except (ValueError, AttributeError):
            continue
    return 0


_PHASE_ORDER = {"idle": -1, "compute": 0, "reduce": 1}


def _parse_progress(text: str) -> tuple[int, int, str]:
    """`<inc>:<step>:<phase>` -> (inc, step, phase); unknown -> (-1, -1, 'idle')."""
    parts = text.split(":")
    if len(parts) != 3:
        return -1, -1, "idle"
    return int(parts[0]), int(parts[1]), parts[2]


_FLAGS = (
    ("heartbeat_timeout_s", "MECEFO_HEARTBEAT_TIMEOUT_S"),
    ("heartbeat_hard_timeout_s", "MECEFO_HEARTBEAT_HARD_TIMEOUT_S"),
    ("agent_timeout_s", "MECEFO_AGENT_TIMEOUT_S"),
    ("hang_timeout_floor_s", "MECEFO_HANG_TIMEOUT_FLOOR_S"),
    ("hang_timeout_factor", "MECEFO_HANG_TIMEOUT_FACTOR"),
    ("grace_s", "MECEFO_GRACE_S"),
    ("start_timeout_s", "MECEFO_START_TIMEOUT_S"),
)


def add_detector_flags(p: argparse.ArgumentParser) -> None:
    """The DetectorConfig flags, each defaulting to its MECEFO_* environment variable."""
    d = DetectorConfig()
    for name, env in _FLAGS:
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, type=float, default=_env_float(env, getattr(d, name)), help=f"${env}")
    p.add_argument(
        "--min-replicas", type=int, default=int(os.environ.get("MECEFO_MIN_REPLICAS", 1))
    )


def detector_config(args: argparse.Namespace) -> DetectorConfig:
    """Raises ValueError on a bad value."""
    fields = {name: getattr(args, name) for name, _ in _FLAGS}
    return DetectorConfig(**fields, min_replicas=args.min_replicas)


def detector_argv(args: argparse.Namespace) -> list[str]:
    """The flags that give the same DetectorConfig (handed to a restarted coordinator)."""
    out = [f"--{name.replace('_', '-')}={getattr(args, name)!r}" for name, _ in _FLAGS]
    return [*out, f"--min-replicas={args.min_replicas}"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m megatron_mecefo.failover.coordinator",
        description="The membership coordinator of one job, a client of its store (started and "
        "restarted by mecefo-coordinator; not meant to be run by hand).",
    )
    p.add_argument("--store", required=True, help="HOST:PORT of the job's store")
    p.add_argument("--world-size", type=int, required=True, help="trainer processes in the job")
    add_detector_flags(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = detector_config(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    store = keys.connect(args.store, 30.0)
    stop = {"flag": False}

    def _stop(signum, frame):
        stop["flag"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    coord = Coordinator(store, args.world_size, cfg, log=lambda m: print(m, flush=True))
    coord.restore()
    agents_seen = False
    parent = os.getppid()
    try:
        while not stop["flag"] and os.getppid() == parent:  # never outlive the store's host
            coord.tick()
            if coord._ticks % 20 == 0 and coord.superseded():
                coord.log("[coordinator] a newer coordinator took over; stopping")
                return 0
            active = keys.get_int(store, keys.AGENTS_ACTIVE, 0)
            agents_seen = agents_seen or active > 0
            if agents_seen and active <= 0:
                break  # every agent is gone: nothing left to coordinate
            time.sleep(cfg.poll_s)
    finally:
        coord.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
