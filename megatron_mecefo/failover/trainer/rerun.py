"""Rerun and classify a step voted down for NaN/Inf or a spike (`commit.py`), inside the job.

Every member reads the same suspects from the store after the decision, so every member takes
the same decisions here without another vote:

1. a suspect's first anomaly at a step: `anomaly` + `rerun` events; the step is redone as is. If
   the redo commits, the fault was **transient** (`classified`, kind transient);
2. the same suspect again at the same step: the lowest member that is not a suspect recomputes the
   micro-batches the suspect ran (its record names them: its own, a straggler's share or a dead
   replica's) forward-only with its own (bitwise equal) parameters and posts their losses
   (`keys.rerun_verdict`); everyone waits for them (bounded) and judges them against the
   suspect's record (`training/anomaly.AnomalyGuard.record`, `reproduced`):
   - the fault does not reproduce on the peer (finite losses; for a loss spike, a mean within
     the suspect's limit): **persistent** on the suspect (a device fault). The suspect posts
     `evicted` and exits EVICTED (never restarted); the survivors take its micro-batches over
     through the usual failure path, and the step is redone without it;
   - it reproduces: **data**. The micro-batches at fault (non-finite, or above the limit) are
     skipped from now on (a zero-weight stand-in, `training/anomaly.py`), named in the
     `classified` event, and the step is redone;
   - a gradient-norm spike: a forward pass cannot judge a backward one, so it is never called a
     device fault: data, all of the suspect's micro-batches of that step;
   - no member left to check (every member flagged): data, unchecked: the micro-batches whose
     own loss the suspect found at fault, or, when its losses cannot tell (a gradient fault, a
     stage without losses), all it ran.
The peer recomputes with the parameters of the step being redone, which every replica holds:
no NaN was ever applied (the vote is taken before the update).

A vote decided down because a replica's state fingerprint differs from the majority's (silent
data corruption, `commit.py`) names that replica: it posts `anomaly` and `classified` (kind
corruption), and leaves with REJOIN, so its agent restarts it and it rejoins with a healthy
peer's state; the leader posts `healed` once a step commits with it back. The second time a
replica's state is found corrupt (counted in the store across incarnations), it is evicted.
With no majority (2 replicas, a tie), the vote names the replica whose state changed since its
own last update (a flip at rest, `commit._corrupt`); when that cannot tell either (both intact:
their updates differed), every replica rolls back to the saved state before that update and
redoes it, and the replica whose first result the redo does not reproduce is named (`_diverged`,
`_redone`). If they differ again, or nothing is saved, the job stops with DATA_ERROR rather than
train on replicas that disagree.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter

from megatron_mecefo.control import keys
from megatron_mecefo.control.records import post_event
from megatron_mecefo.errors import (
    CorruptStateError,
    DivergedUpdateError,
    EvictedError,
    NumericalFaultError,
    QuorumTimeoutError,
)


class AnomalyRerun:
    """One trainer's side of the rerun (see the module docstring)."""

    def __init__(
        self, plane, membership, vote, *, position: int, writes_events, timeout_s: float, log=print
    ):
        self.plane = plane
        self.position = position
        """This rank's place in its replica: position 0 posts the replica's own events."""
        self.membership = membership
        self.vote = vote
        self.writes_events = writes_events
        """() -> does this rank post the job's events (the leader)?"""
        self.timeout_s = timeout_s
        self.log = log
        self.seen: Counter[tuple[int, int]] = Counter()
        """(step, replica) -> anomalies so far."""
        self.pending: dict[int, list[int]] = {}
        """step -> suspects rerun once, transient if the step now commits."""
        self.classified: Counter[str] = Counter()
        self.healing: set[int] = set()
        """Replicas that left to rejoin with a healthy peer's state (corrupt state)."""
        self.can_roll_back = False
        """Snapshots or checkpoints are enabled: replicas whose updates differed can redo the
        update from saved state to tell which one computed it wrong."""
        self.resolved: tuple[int, list[str]] | None = None
        """(step, its divergence keys) once the leader named the wrong replica of a redone
        step: deleted at the next commit, when every member has read them."""

    def after_attempt(self, engine, step: int, committed: bool) -> None:
        """Called on every member after each attempt of `step`."""
        if committed:
            self._transient(step)
            self._healed(step)
            self._sweep_divergence(step)
            self._redone(step)
            return
        if self.vote.last_corrupt is not None:
            self._corrupt(step, self.vote.last_corrupt)
            return
        if self.vote.last_anomaly is None:
            return
        g, _, a = self.vote.last_anomaly
        suspects = self.vote.suspects(g, step, a)
        store = self.plane.store
        for r in suspects:
            self.seen[(step, r)] += 1
            if r == self.membership.replica and self.position == 0:
                what = self._record(g, step, a, r)["what"]
                post_event(store, "anomaly", step=step, dp_rank=r, generation=g, detail=what)
        first = [r for r in suspects if self.seen[(step, r)] == 1]
        again = [r for r in suspects if self.seen[(step, r)] >= 2]
        if first:
            self.pending.setdefault(step, []).extend(first)
            if self.writes_events():
                post_event(store, "rerun", step=step, dp_rank=first[0], replicas=first)
        if again:
            self._classify(engine, (g, step, a), again, suspects)

    def _record(self, g: int, step: int, a: int, replica: int) -> dict:
        return json.loads(self.plane.store.get(keys.anomaly(g, step, a, replica)))

    def _corrupt(self, step: int, odd: list[int]) -> None:
        store, m = self.plane.store, self.membership
        if not odd:
            self._diverged(step)
        detail = "state fingerprint differs from the majority's"
        if self.writes_events():
            for r in odd:
                post_event(store, "anomaly", step=step, dp_rank=r, detail=detail)
                self._post_classified(
                    step, [r], "corruption", f"{detail}: rejoins with a healthy peer's state"
                )
        self.healing |= set(odd)
        if m.replica not in odd:
            return
        times = store.add(keys.corruptions(m.replica, self.position), 1)
        if times >= 2:
            if self.position == 0:
                post_event(
                    store, "evicted", step=step, dp_rank=m.replica, detail=f"{detail}, twice"
                )
            raise EvictedError(
                f"replica {m.replica}: its state differed from the majority's twice; evicted"
            )
        raise CorruptStateError(
            f"replica {m.replica}: state fingerprint at step {step} differs from the majority's; "
            "rejoining with a healthy peer's state"
        )

    def _diverged(self, step: int) -> None:
        """No vote names the wrong replica: their states differ at the start of `step`, and each
        still equals what its own last update produced. Every member notes its fingerprint and
        the job rolls back to the newest saved state before that update (`ROLLBACK_BOUND`); the
        update is redone from there, and `_redone` names the replica whose first result the
        redo did not reproduce. Once only: the same divergence after the redo stops the job."""
        store, m = self.plane.store, self.membership
        mine = keys.divergence(step, m.replica, self.position)
        if store.check([mine]) or not self.can_roll_back:
            why = (
                "again after every replica redid the update from saved state (a persistent "
                "fault, or kernels that are not deterministic)"
                if store.check([mine])
                else "and nothing is saved to redo the update from (snapshots and checkpoints "
                "are off)"
            )
            raise NumericalFaultError(
                f"step {step}: the replicas' states differ, no majority names the wrong one "
                f"({len(m.members)} replicas), {why}; resume from the last checkpoint"
            )
        store.set(mine, str(self.vote.last_fingerprint))
        store.set(keys.diverged_at(step), "1")
        store.set(keys.ROLLBACK_BOUND, str(step - 1))  # every member: whoever restarts first
        detail = (
            f"the replicas' states differ after the update of step {step - 1} and neither changed "
            "at rest: every replica redoes it from saved state to tell which computed it wrong"
        )
        if self.writes_events():
            post_event(store, "rollback", step=step, dp_rank=None, detail=detail)
        raise DivergedUpdateError(f"step {step}: {detail}")

    def _redone(self, step: int) -> None:
        """`step` committed after a rollback that `_diverged` started there: a replica whose
        noted fingerprint (at any of its positions) differs from the one its rank now holds,
        which every replica agrees on, computed the update wrong the first time."""
        store, m = self.plane.store, self.membership
        if not self.can_roll_back or not store.check([keys.diverged_at(step)]):
            return  # one round trip on every commit; the per-position keys only after a rollback
        size = self.vote.replica_size
        names = {(r, p): keys.divergence(step, r, p) for r in m.members for p in range(size)}
        noted = [k for k, name in names.items() if store.check([name])]
        if not noted:
            return
        before = [int(v) for v in store.multi_get([names[k] for k in noted])]
        now = self._prints_now(step, noted)
        wrong = sorted({r for (r, p), fp in zip(noted, before) if fp != now[(r, p)]})
        blamed = wrong if len(wrong) < len({r for r, _ in noted}) else []
        if self.writes_events():
            store.delete_key(keys.ROLLBACK_BOUND)
            self.resolved = (step, [keys.diverged_at(step), *names.values()])
            if wrong and not blamed:
                post_event(
                    store,
                    "anomaly",
                    step=step,
                    dp_rank=None,
                    detail=f"no replica reproduced its update of step {step - 1} when redoing "
                    "it: the job goes on from the redone state",
                )
            for r in blamed:
                detail = f"its update of step {step - 1} differed from the redo from saved state"
                post_event(store, "anomaly", step=step, dp_rank=r, detail=detail)
                self._post_classified(step, [r], "corruption", f"{detail}; redone")
                post_event(store, "healed", step=step, dp_rank=r, detail="committed the redo")
        if m.replica in blamed:
            times = store.add(keys.corruptions(m.replica, self.position), 1)
            if times >= 2:
                if self.position == 0:
                    post_event(
                        store,
                        "evicted",
                        step=step,
                        dp_rank=m.replica,
                        detail="computed a wrong state twice",
                    )
                raise EvictedError(f"replica {m.replica}: its state was found wrong twice; evicted")

    def _sweep_divergence(self, step: int) -> None:
        """A commit after the redone step: every member voted in it, so each has read the
        divergence keys of that step (`_redone` runs before the next attempt)."""
        if self.resolved is None or step <= self.resolved[0]:
            return
        if self.writes_events():
            for name in self.resolved[1]:
                self.plane.store.delete_key(name)
        self.resolved = None

    def _prints_now(self, step: int, which: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
        """(replica, position) -> the fingerprint its rank voted with in the commit of `step`:
        with one rank per replica, this rank's own (the commit says they agree); otherwise
        each rank's, from the vote's keys (kept until two commits later)."""
        size = self.vote.replica_size
        if size == 1:
            return {k: self.vote.last_fingerprint for k in which}
        g, a = self.vote.committed_as
        values = self.plane.store.multi_get(
            [keys.fingerprint(g, step, a, r * size + p) for r, p in which]
        )
        return {k: int(v.split(b":")[0]) for k, v in zip(which, values, strict=True)}

    def _healed(self, step: int) -> None:
        back = sorted(r for r in self.healing if r in self.membership.members)
        for r in back:
            self.healing.discard(r)
            if self.writes_events():
                post_event(
                    self.plane.store,
                    "healed",
                    step=step,
                    dp_rank=r,
                    detail="rejoined with a healthy peer's state; committed with it",
                )

    def _transient(self, step: int) -> None:
        suspects = self.pending.pop(step, [])
        if suspects:
            self.classified["transient"] += 1
            if self.writes_events():
                self._post_classified(step, suspects, "transient", "did not reproduce on the rerun")

    def _classify(self, engine, attempt, again: list[int], suspects: list[int]) -> None:
        g, step, a = attempt
        healthy = [r for r in self.membership.members if r not in suspects]
        for r in again:
            if r in self.pending.get(step, []):
                self.pending[step].remove(r)
            check = self.seen[(step, r)]
            record = self._record(g, step, a, r)
            ran = list(dict.fromkeys(tuple(t) for t in record["tasks"]))  # slices: one each
            if healthy:
                losses = self._peer_check(engine, step, r, healthy[0], check, ran)
                again_there, at_fault = reproduced(record, losses)
                bad = [ran[i] for i in at_fault]
            else:  # unchecked: data
                again_there, bad = True, unchecked_faults(record, ran)
            if not again_there:
                self._persistent(step, r, record)
            else:
                self._data(engine, step, r, bad, record, checked=bool(healthy))

    def _peer_check(self, engine, step: int, suspect: int, checker: int, check: int, pairs):
        key = keys.rerun_verdict(step, suspect, check)
        store = self.plane.store
        if self.membership.replica == checker:
            losses = engine.forward_check(step, pairs)
            if losses is not None:  # the ranks with losses (last pipeline stage) post them
                store.set(key, json.dumps(losses))
        deadline = time.monotonic() + self.timeout_s
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise QuorumTimeoutError(
                    f"no recomputation of replica {suspect}'s step {step} by replica {checker} "
                    f"within {self.timeout_s} s (anomaly.check_timeout_s)"
                )
            time.sleep(0.01)
        return json.loads(store.get(key))

    def _persistent(self, step: int, suspect: int, record: dict) -> None:
        self.classified["persistent"] += 1
        detail = (
            f"{record['what']}: reproduced on the rerun; a healthy peer computed the same "
            "inputs without it"
        )
        if self.writes_events():
            self._post_classified(step, [suspect], "persistent", detail)
        if suspect == self.membership.replica:
            if self.position == 0:
                post_event(self.plane.store, "evicted", step=step, dp_rank=suspect, detail=detail)
            raise EvictedError(
                f"replica {suspect}: {record['what']} at step {step} reproduced on this rank only; "
                "evicted (the survivors take its micro-batches over)"
            )

    def _data(self, engine, step, suspect: int, bad: list, record: dict, *, checked: bool):
        """`bad`: (source replica, micro-batch) pairs, skipped from now on."""
        self.classified["data"] += 1
        for source, i in bad:
            engine.anomaly.skipped.add((step, source, i))
        mbs = engine.cfg.training.micro_batch_size
        samples = [engine.train_sampler.sample_indices(step, source, i) for source, i in bad]
        if self.writes_events():
            self._post_classified(
                step,
                [suspect],
                "data",
                f"{record['what']}: "
                + (
                    "reproduced on a healthy peer: skipped"
                    if checked
                    else "every member flagged it (no peer to check): skipped"
                ),
                microbatches=[list(p) for p in bad],
                samples=[s for ids in samples for s in ids],
                samples_skipped=len(bad) * mbs,
            )
        self.log(
            f"[failover] step {step}: micro-batches {bad} (source replica, index) that replica "
            f"{suspect} ran are bad data ({record['what']}, wherever computed); skipped"
        )

    def _post_classified(self, step: int, replicas: list[int], kind: str, detail: str, **extra):
        post_event(
            self.plane.store,
            "classified",
            step=step,
            dp_rank=replicas[0],
            replicas=replicas,
            kind=kind,
            detail=detail,
            **extra,
        )


def reproduced(record: dict, losses: list[float]) -> tuple[bool, list[int]]:
    """Does the fault in `record` (the suspect's `AnomalyGuard.record`) show in the `losses` a
    healthy peer computed for the suspect's micro-batches? And which micro-batches are at fault.
    A gradient-norm spike cannot be judged by a forward pass: it counts as reproduced (data), all
    micro-batches, so that no rank is evicted on a guess."""
    kind, limit = record["kind"], record.get("limit")
    if kind == "grad":
        return True, list(range(len(losses)))
    bad = [
        i
        for i, x in enumerate(losses)
        if not math.isfinite(x) or (kind == "loss" and limit is not None and x > limit)
    ]
    if kind == "loss" and limit is not None:
        mean = sum(losses) / len(losses) if losses else 0.0
        return not math.isfinite(mean) or mean > limit, bad
    return bool(bad), bad


def unchecked_faults(record: dict, ran: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """With no healthy peer to recompute them: the micro-batches of `ran` whose own loss in the
    suspect's `record` is non-finite or over a loss spike's limit; all of `ran` when its losses
    cannot tell (a gradient fault, a record without losses)."""
    losses, limit = record.get("losses"), record.get("limit")
    if not losses or record["kind"] == "grad" or len(losses) != len(record["tasks"]):
        return ran
    over = {
        tuple(t)
        for t, x in zip(record["tasks"], losses, strict=True)
        if not math.isfinite(x) or (record["kind"] == "loss" and limit is not None and x > limit)
    }
    return [p for p in ran if p in over] or ran
