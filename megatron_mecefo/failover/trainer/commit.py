"""The commit vote: every member applies the same verdict, and an update is applied only if the
whole membership reduced.

Per step attempt (g, step, a): members whose reduction succeeded vote; the one that completes the
vote sets `decision/g/step/a = commit:<next gen>` with compare-and-set; a member that failed (or
sees g lose a member) sets `abort:<next gen>` instead. The first write wins. TP = 1 votes with one
tiny all-reduce of the members' success flags (every member issues it, so the collective sequence
never diverges); with TP x PP > 1 a store counter over every rank of every member (one position's
all-reduce cannot vouch for the replica's other ranks). A requested stop rides on the decision
(`commit:<gen>:stop`), so every member stops after the same step.

A member whose local loss or gradients hold NaN/Inf (`training/anomaly.py`) reduced fine but votes
the step down with an anomaly: it first sets `anomaly/g/step/a/<replica>`, and a vote in which
every member reduced and some flagged is decided at once as `abort:<g>:anomaly` (no wait for a
new membership, no group rebuild); `suspects` names the flagged replicas, the same on every
member, for the rerun (`rerun.py`).

On the straggler watch's steps (`straggler.py`), each rank also sets its pace before it votes;
after a commit every member reads every pace (`last_paces`), the same on every member.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable

import torch

from megatron_mecefo.control import keys
from megatron_mecefo.errors import QuorumTimeoutError
from megatron_mecefo.failover.trainer.plane import ControlPlane
from megatron_mecefo.training import boundary
from megatron_mecefo.training.membership import Membership
from megatron_mecefo.training.stop import StopFlag


class CommitVote:
    """One trainer's side of the vote (see the module docstring)."""

    def __init__(
        self,
        plane: ControlPlane,
        membership: Membership,
        *,
        rank: int,
        replica_size: int,
        stop_flag: StopFlag,
        failure_wait_s: float,
        regroup_timeout_s: float,
        log=print,
    ):
        self.plane = plane
        self.membership = membership
        self.rank, self.replica_size = rank, replica_size
        self.stop_flag = stop_flag
        self.failure_wait_s = failure_wait_s
        self.regroup_timeout_s = regroup_timeout_s
        self.log = log
        self.attempt = 0
        """Attempts of this step not committed so far, in the current generation."""
        self._attempt_gen = 0
        self.pending: tuple[int, str] | None = None
        """(generation, group key) to form before the next attempt, as the decision said."""
        self.stop_after: int | None = None
        """The step after which every member stops (a stop was requested)."""
        self.times_s: list[float] = []
        """Wall time of each vote (including the wait for the decision)."""
        self.before_vote: Callable[[int, int, int], None] | None = None
        """Called with (step, generation, attempt) just before this member votes: what it logs
        there survives a SIGKILL between the verdict and the update."""
        self.committed_as: tuple[int, int] = (0, 0)
        """(generation, attempt) of the last committed step."""
        self.last_anomaly: tuple[int, int, int] | None = None
        """(generation, step, attempt) of the last vote, if it was decided down for NaN/Inf."""
        self.last_corrupt: list[int] | None = None
        """Replicas whose state fingerprint differed from the majority's in the last vote (empty:
        no majority), or None."""
        self.last_fingerprint: int | None = None
        """This rank's state fingerprint in the last vote (None: that step was not
        fingerprinted)."""
        self.pace_of: Callable[[int], float | None] | None = None
        """step -> this rank's pace to share with this step's vote, or None (no sharing)."""
        self.last_paces: dict[int, float] | None = None
        """Global rank -> pace, read after the last vote if it committed a step that shared."""
        self._posted: dict[str, str] = {}
        """This rank's last key of each per-vote kind (pace, fingerprint): deleted when it sets
        the next one, so the store does not grow with the steps. Every member has read it by
        then: each vote ends after its readers read."""
        self._spent: deque[list[str]] = deque()
        """The shared keys of each step this rank voted on since its last commit, per committed
        step (decision, counters): the first member's rank deletes those of the commit two
        commits back, which nobody reads any more (a member votes on step s + 1 only once every
        member has read step s's decision)."""
        self._voted: list[str] = []

    def vote(
        self,
        step: int,
        ok: bool,
        anomaly: str | None = None,
        fingerprint: int | None = None,
        intact: bool | None = None,
    ) -> bool:
        """Same verdict on every member: commit iff every member's reduction succeeded, no
        member found NaN/Inf in its own results (`anomaly`: what it found) and, on a
        fingerprinted step (`fingerprint` given on every member), every member holds the same
        state."""
        t0 = time.perf_counter()
        m = self.membership
        if m.generation != self._attempt_gen:  # vote keys are per (generation, step, attempt)
            self._attempt_gen, self.attempt = m.generation, 0
        g, a = m.generation, self.attempt
        self.last_anomaly = self.last_corrupt = self.last_paces = None
        self.last_fingerprint = fingerprint
        if self.before_vote is not None:
            self.before_vote(step, g, a)
        pace = self.pace_of(step) if self.pace_of is not None else None
        if pace is not None:
            self._post("pace", keys.pace(g, step, a, self.rank), repr(pace))
        dkey = keys.decision(g, step, a)
        self._voted.append(dkey)
        if self.replica_size > 1:  # the store path's counters
            self._voted += [keys.vote(g, step, a), keys.anomalies(g, step, a)]
        latest = max(g, self.plane.latest_gen)
        verdict = None
        # the writer of the decision also decides a requested stop, so every member agrees on it
        commit = f"commit:{latest}:stop" if self.stop_flag.is_set else f"commit:{latest}"
        rerun = f"abort:{g}:anomaly"
        store = self.plane.store
        if ok and anomaly is not None:
            store.set(keys.anomaly(g, step, a, m.replica), anomaly)
        if self.replica_size == 1:
            prints = None
            if fingerprint is not None:  # every member gathers on the same steps
                mine = torch.tensor([fingerprint, _code(intact)], dtype=torch.int64)
                gathered = torch.zeros(2 * m.size, dtype=torch.int64)
                ok = m.all_gather(gathered, mine) and ok
                pairs = gathered.view(m.size, 2).tolist()
                prints = {r: (fp, code) for r, (fp, code) in zip(m.members, pairs, strict=True)}
            votes = torch.tensor([1.0 if ok else 0.0, 1.0 if anomaly else 0.0], dtype=torch.float64)
            if m.all_reduce(votes) and ok and int(votes[0].item()) == m.size:
                decided = rerun if votes[1].item() > 0 else _corrupt(g, prints) or commit
                verdict = store.compare_set(dkey, "", decided).decode()
        elif ok:
            if anomaly is not None:  # counted before the vote: the last voter sees it
                store.add(keys.anomalies(g, step, a), 1)
            if fingerprint is not None:
                name = keys.fingerprint(g, step, a, self.rank)
                self._post("fingerprint", name, f"{fingerprint}:{_code(intact)}")
            count = store.add(keys.vote(g, step, a), 1)
            if count == m.size * self.replica_size:
                flagged = keys.get_int(store, keys.anomalies(g, step, a)) > 0
                decided = rerun if flagged else self._corrupt_positions(g, step, a) or commit
                verdict = store.compare_set(dkey, "", decided).decode()
            else:
                verdict = self._await_decision(dkey, g, failed=False)
        if verdict is None:
            verdict = self._await_decision(dkey, g, failed=True)
        self.times_s.append(time.perf_counter() - t0)
        kind, next_gen, *flags = verdict.split(":")
        committed, next_gen = kind == "commit", int(next_gen)
        if committed:
            self.attempt, self.committed_as = 0, (g, a)
            self._sweep(m)
            if pace is not None:  # every member set its pace before it voted
                ranks = [
                    r * self.replica_size + p for r in m.members for p in range(self.replica_size)
                ]
                values = self.plane.store.multi_get([keys.pace(g, step, a, r) for r in ranks])
                self.last_paces = {r: float(v) for r, v in zip(ranks, values, strict=True)}
            boundary.note_committed(step)
            if "stop" in flags:
                self.stop_after = step
        elif flags and flags[0] == "corrupt":
            self.attempt += 1
            self.last_corrupt = [int(r) for r in flags[1].split(",") if r]
            self.log(
                f"[failover] rank {self.rank}: step {step} not committed (the state fingerprint "
                f"of replica(s) {self.last_corrupt or '?: no majority'} differs)"
            )
        elif "anomaly" in flags:
            self.attempt += 1
            self.last_anomaly = (g, step, a)
            self.log(
                f"[failover] rank {self.rank}: step {step} not committed (NaN/Inf on replica(s) "
                f"{self.suspects(g, step, a)}); rerunning"
            )
        else:
            self.attempt += 1
            why = m.failed or "another member's reduction failed"
            self.log(f"[failover] rank {self.rank}: step {step} not committed ({why}); redoing")
        if next_gen != g:
            self.pending = (next_gen, f"pg/{next_gen}")
        elif not committed and not flags:  # the group saw an error: rebuild it
            self.pending = (g, f"pg/{g}/s{step}a{a}")
        return committed

    def _sweep(self, m) -> None:
        """A step committed: forget (delete, on the first member's first rank) the shared keys
        of the commit two commits back (see `_spent`)."""
        self._spent.append(self._voted)
        self._voted = []
        if len(self._spent) <= 2:
            return
        old = self._spent.popleft()
        if self.rank == min(m.members) * self.replica_size:
            for key in old:
                self.plane.store.delete_key(key)

    def _post(self, kind: str, key: str, value: str) -> None:
        store = self.plane.store
        old = self._posted.get(kind)
        if old is not None and old != key:
            store.delete_key(old)
        store.set(key, value)
        self._posted[kind] = key

    def _corrupt_positions(self, g: int, step: int, a: int) -> str | None:
        """TP x PP > 1, the last voter: compare the fingerprints position by position (ranks
        that did not fingerprint this step set none: nothing to compare)."""
        store, m, size = self.plane.store, self.membership, self.replica_size
        odd: set[int] = set()
        for pos in range(size):
            names = [keys.fingerprint(g, step, a, r * size + pos) for r in m.members]
            if not store.check(names[:1]):
                return None
            values = [tuple(int(x) for x in v.split(b":")) for v in store.multi_get(names)]
            verdict = _corrupt(g, dict(zip(m.members, values, strict=True)))
            if verdict is not None:
                named = {int(r) for r in verdict.rsplit(":", 1)[1].split(",") if r}
                if not named:
                    return verdict  # no majority at a position: nobody can be named
                odd |= named
        return _decision_of(g, sorted(odd)) if odd else None

    def suspects(self, g: int, step: int, a: int) -> list[int]:
        """Replicas that voted (g, step, a) down for NaN/Inf (set before any vote was cast)."""
        store = self.plane.store
        return [r for r in self.membership.members if store.check([keys.anomaly(g, step, a, r)])]

    def _await_decision(self, dkey: str, g: int, *, failed: bool) -> str:
        store = self.plane.store
        start = time.monotonic()
        delay, last_gen_check = 0.0, 0.0
        while True:
            if store.check([dkey]):
                return store.get(dkey).decode()
            now = time.monotonic()
            if now - last_gen_check > 0.02:
                last_gen_check = now
                latest = keys.get_int(store, keys.GEN)
                if latest > g:
                    gone = set(self.membership.members) - set(self.plane.record(latest).members)
                    if gone:
                        return store.compare_set(dkey, "", f"abort:{latest}").decode()
                if failed and now - start > self.failure_wait_s:
                    return store.compare_set(dkey, "", f"abort:{max(g, latest)}").decode()
            if now - start > self.regroup_timeout_s:
                raise QuorumTimeoutError(
                    f"no commit decision for generation {g} within {self.regroup_timeout_s} s"
                )
            time.sleep(delay)
            delay = min(2 * delay or 1e-4, 2e-3)


def _code(intact: bool | None) -> int:
    return -1 if intact is None else int(intact)


def _corrupt(g: int, prints: dict[int, tuple[int, int]] | None) -> str | None:
    """The decision for members' (fingerprint, intact code) that disagree (None: the fingerprints
    agree, or none were taken): `abort:<g>:corrupt:<replicas that differ from the majority>`.
    Without a strict majority (2 replicas, a tie) the replicas whose state changed since their
    own last update (code 0: a flip at rest) are named, if that leaves someone intact; otherwise
    nobody is named (the vote cannot tell which is wrong)."""
    if not prints or len({fp for fp, _ in prints.values()}) == 1:
        return None
    value, n = Counter(fp for fp, _ in prints.values()).most_common(1)[0]
    if 2 * n > len(prints):
        return _decision_of(g, sorted(r for r, (fp, _) in prints.items() if fp != value))
    changed = sorted(r for r, (_, code) in prints.items() if code == 0)
    if changed and len(changed) < len(prints):
        return _decision_of(g, changed)
    return _decision_of(g, [])


def _decision_of(g: int, odd: list[int]) -> str:
    return f"abort:{g}:corrupt:{','.join(str(r) for r in odd)}"
