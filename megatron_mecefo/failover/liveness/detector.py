"""Who is dead now: the coordinator's liveness view of every rank, and its verdicts.

The `Detector` reads the beats and progress markers (from the agents' node reports, or from a
rank's own keys), the death reports, and judges each member rank: *exited* (its agent or itself
reported it), *silent* (no heartbeat for the soft timeout, judged with the agents' kernel
evidence: `evidence.py`; a rank that is only slow waits for the hard timeout), or *hung* (not
moving while another member is ahead of it, for max(floor, factor x step time)). It decides
nothing about membership: `failover/authority/coordinator.py` turns its findings into generations.
No torch import.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from megatron_mecefo.control import keys
from megatron_mecefo.control.local_beat import AGENT_STALL_S
from megatron_mecefo.control.records import NodeReport
from megatron_mecefo.failover.liveness.evidence import NodeWatch, Verdict


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
class RankState:
    """What the coordinator knows of one global rank."""

    incarnation: int = -1
    hb_value: int = -1
    hb_changed: float = 0.0
    progress: str = ""
    progress_changed: float = 0.0
    evicted_incarnation: int = -1
    slow_since: float | None = None  # silent but alive (logged once per episode)
    node: int | None = None  # the node (agent) it runs on, from its registration
    hb_source: str = ""  # where hb_value was read: "agent" (node report) or "store" (own key)


_PHASE_ORDER = {"idle": -1, "compute": 0, "reduce": 1}


def parse_progress(text: str) -> tuple[int, int, str]:
    """`<inc>:<step>:<phase>` -> (inc, step, phase); unknown -> (-1, -1, 'idle')."""
    parts = text.split(":")
    if len(parts) != 3:
        return -1, -1, "idle"
    return int(parts[0]), int(parts[1]), parts[2]


class RankLog:
    """The ranks appended to a store log (`keys.REG_LOG`, `keys.DEAD_LOG`) since the last read:
    one request, not one per rank. A store written without the log (an older writer) is scanned
    rank by rank instead."""

    def __init__(self, store, log_key: str, key_of: Callable[[int], str], ranks):
        self.store, self.log_key, self.key_of, self.ranks = store, log_key, key_of, ranks
        self.seen_chars = 0

    def new_ranks(self) -> list[int]:
        if not self.store.check([self.log_key]):
            return [r for r in self.ranks if self.store.check([self.key_of(r)])]
        ranks, self.seen_chars = keys.new_log_entries(self.store, self.log_key, self.seen_chars)
        return [r for r in ranks if r in self.ranks]


class Detector:
    """Liveness of every rank of one job, as the coordinator sees it (fed every other tick)."""

    def __init__(self, store, world_size: int, cfg: DetectorConfig, *, log=print):
        self.store = store
        self.cfg = cfg
        self.log = log
        self.ranks = {r: RankState() for r in range(world_size)}
        self.nodes = NodeWatch(cfg.agent_timeout_s)
        self.node_ids: set[int] = set()
        self.reported: dict[int, tuple[int, float]] = {}  # rank -> (incarnation, failure epoch)
        self.job_step = -1
        self.step_changed = time.monotonic()
        self.step_time_s: float | None = None
        self._deaths = RankLog(store, keys.DEAD_LOG, keys.dead, self.ranks)
        self._dead_seq = -1
        self._all_silent = False  # every member silent at once (logged when it starts)
        self._front: tuple[int, int] | None = None  # furthest (step, phase) among members
        self._front_of: dict | None = None  # the progress map `_front` was computed from

    # ------------------------------------------------------------------ reading
    def registered(self) -> list[int]:
        return [r for r, st in self.ranks.items() if st.incarnation >= 0]

    def read_heartbeats(self, now: float) -> None:
        """Beats and progress: from the agents' node reports (aggregated, one multi_get for every
        node), and from the per-rank keys only for ranks no fresh report carries (no agent, the
        agent has yet to report this incarnation, or it stalled and its ranks beat directly)."""
        covered = self._read_node_reports(now)
        self.nodes.leases = keys.leased_agents(self.store)  # etcd: the leases say who lives
        ranks = [r for r in self.registered() if r not in covered]
        if not ranks:
            return
        values = self.store.multi_get([keys.heartbeat(r) for r in ranks])
        progress = self.store.multi_get([keys.progress(r) for r in ranks])
        for rank, hb, prog in zip(ranks, values, progress):
            self.saw_beat(self.ranks[rank], "store", int(hb.decode()), prog.decode(), now)

    def _read_node_reports(self, now: float) -> set[int]:
        """Feed the agents' reports to `self.nodes`; the ranks whose beat a fresh one carried."""
        names = [keys.node_key(n) for n in sorted(self.node_ids)]
        if not names:
            return set()
        if self.store.check(names):  # every node has reported: one request for all
            present = names
        else:
            present = [k for k in names if self.store.check([k])]
        covered = set()
        for name, raw in zip(present, self.store.multi_get(present) if present else []):
            node, report = int(name.rpartition("/")[2]), NodeReport.from_json(raw)
            self.nodes.update(node, report, now)
            if self.nodes.silent_s(node, now) > AGENT_STALL_S:
                continue  # a stalled agent: its ranks beat to the store meanwhile
            for rank, entry in report.ranks.items():
                st = self.ranks.get(rank)
                if st is None or entry.beats is None or entry.incarnation != st.incarnation:
                    continue  # no beat yet (or an older incarnation's): per-rank keys
                covered.add(rank)
                self.saw_beat(st, "agent", entry.beats, entry.progress, now)
        return covered

    @staticmethod
    def saw_beat(st: RankState, source: str, value: int, progress: str, now: float) -> None:
        """A counter that moved is a beat; one read from the other source only sets the base."""
        if source != st.hb_source:
            st.hb_source, st.hb_value = source, value
        elif value != st.hb_value:
            st.hb_value, st.hb_changed = value, now
        if progress != st.progress:
            st.progress, st.progress_changed = progress, now

    def read_dead_reports(self) -> None:
        seq = keys.get_int(self.store, keys.DEAD_SEQ, 0)
        if seq == self._dead_seq:
            return
        self._dead_seq = seq
        ranks = self._deaths.new_ranks()
        for rank, raw in zip(ranks, self.store.multi_get([keys.dead(r) for r in ranks])):
            inc, _, epoch = raw.decode().partition(":")
            self.reported[rank] = (int(inc), float(epoch))

    def forget_ages(self, now: float, why: str) -> None:
        """Restart every silence clock from now (the coordinator itself was not running)."""
        self.log(f"[coordinator] {why}: heartbeat and progress ages restart from now")
        for st in self.ranks.values():
            st.hb_changed = st.progress_changed = now
        self.nodes.refresh(now)
        self.step_changed = now

    # ------------------------------------------------------------------ the job's pace
    def track_job_step(self, now: float, member_ranks: list[int]) -> bool:
        """Move `job_step` to the furthest member's step (and the step-time average); True if
        it moved."""
        steps = [parse_progress(self.ranks[r].progress)[1] for r in member_ranks]
        step = max(steps, default=-1)
        if step <= self.job_step:
            return False
        if self.job_step >= 0:
            dt = (now - self.step_changed) / (step - self.job_step)
            ema = self.step_time_s
            self.step_time_s = dt if ema is None else 0.8 * ema + 0.2 * dt
        self.job_step, self.step_changed = step, now
        return True

    def hang_timeout_s(self) -> float:
        factor = self.cfg.hang_timeout_factor * (self.step_time_s or 0.0)
        return max(self.cfg.hang_timeout_floor_s, factor)

    # ------------------------------------------------------------------ verdicts
    def detect(
        self, now: float, member_ranks: list[int], known: dict
    ) -> dict[int, tuple[float, str]]:
        """Member ranks (not already in `known`) that are dead now: rank -> (failure epoch time,
        reason)."""
        self.read_dead_reports()
        progress = {r: parse_progress(self.ranks[r].progress) for r in member_ranks}
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
        found = {}
        for rank in member_ranks:
            if rank in known:
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
                found[rank] = (failed_at, reason)
        return found

    def _silence(
        self, rank: int, st: RankState, now: float, *, all_silent: bool = False
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
