"""State transfer at a regroup: members agree on the newest training state among them, and the
members that lack it (a restarted or replacement replica) receive it from a live peer.

The state is model, optimizer, RNG and step (`training/state.py`), sent over the new
generation's group on a side channel of p2p sends. When no member holds any state (every replica
was lost at once) the recovery order runs locally (snapshot, parity rebuild, disk); when even that
finds nothing the job is aborted with one reason. A transfer that breaks (a peer died mid-send)
retargets the next generation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from megatron_mecefo.control import keys
from megatron_mecefo.control.records import post_event
from megatron_mecefo.errors import JobAbortedError, ShardsLostError
from megatron_mecefo.failover.trainer.collectives import wait_work
from megatron_mecefo.failover.trainer.plane import ControlPlane, Superseded
from megatron_mecefo.failover.trainer.shards import sync_shards
from megatron_mecefo.mcore.checkpointing import is_sharded
from megatron_mecefo.training import state as train_state
from megatron_mecefo.training.membership import Membership


class StateSync:
    """This replica's training state as the failover protocol sees it, and its transfer."""

    def __init__(
        self,
        plane: ControlPlane,
        membership: Membership,
        *,
        rank: int,
        backend: str,
        has_state: bool,
        log=print,
    ):
        self.plane = plane
        self.membership = membership
        self.rank = rank
        self.backend = backend
        self.has_state = has_state
        """This process holds the job's state (a first incarnation, or one that received it)."""
        self.log = log
        self.recover: Callable[..., int | None] | None = None
        """(at_most=None) -> next step or None: the recovery order (snapshot, parity, disk), used
        when no member holds live state (every replica was lost at once)."""
        self.before_transfer: Callable[[], None] | None = None
        """Called by a sender or receiver just before a transfer (failure injection at rejoin)."""
        self.rejoin_bytes = 0
        self.rejoin_s: float | None = None
        self.can_recover = False
        """Snapshots or checkpoints are enabled (a rollback has somewhere to go)."""
        self.recovered = False
        """This process loaded its state from the recovery order (snapshot, parity, disk)."""
        self.posts_shard_events = True
        """This rank posts the `shard_adopt` event of its DP group (one per replica position:
        the manager sets it for position 0)."""
        self._started = time.monotonic()

    def _lost(self) -> str | None:
        m = self.membership
        return self.plane.membership_lost(m.generation, m.members)

    def sync(self, engine: Any, gen: int, deadline: float) -> None:
        """Agree on the newest state among members; send it to any member that lacks it; with
        the distributed optimizer, bring its shards to their holders (`shards.py`)."""
        best = self._sync_state(engine, gen, deadline)
        if is_sharded(engine.optimizer):
            self._sync_shards(engine, best, gen, deadline)

    def _sync_shards(self, engine: Any, best: int, gen: int, deadline: float) -> None:
        m = self.membership

        def collective(tensor: torch.Tensor) -> None:
            if not m.collectives.all_reduce(tensor, m.group):
                raise Superseded(self.plane.wait_newer_generation(gen, deadline))

        moved = sync_shards(
            engine.optimizer,
            m,
            best=best,
            mine=self._mine(),
            p2p=lambda work, what: self._p2p(work, what, gen, deadline),
            collective=collective,
            abort=self._abort,
            lost_handler=lambda lost: self._shards_lost(lost, best, gen),
        )
        # posted before the gather: a gather that fails is redone in the next generation, where
        # nothing moves any more
        if moved["bytes"] and m.position == 0 and self.posts_shard_events:
            post_event(
                self.plane.store,
                "shard_adopt",
                step=best,
                dp_rank=None,
                generation=gen,
                bytes=moved["bytes"],
                transfer_ms=1000 * moved["seconds"],
                detail=(
                    f"optimizer shards placed on members {list(m.members)}: "
                    f"{moved['bytes'] / 1e6:.2f} MB moved in {1000 * moved['seconds']:.0f} ms"
                ),
            )
        if moved["bytes"]:
            self.log(
                f"[failover] rank {self.rank}: optimizer shards placed for members "
                f"{list(m.members)} ({moved['bytes'] / 1e6:.2f} MB moved in "
                f"{1000 * moved['seconds']:.0f} ms); this replica holds "
                f"{sorted(engine.optimizer.held)}"
            )
        m.begin_attempt()
        if not engine.optimizer.gather_params():
            raise Superseded(self.plane.wait_newer_generation(gen, deadline))

    def _shards_lost(self, lost: list[int], best: int, gen: int) -> None:
        """No exact copy of optimizer shards `lost` is left at step `best` (every holder died at
        once). Roll every rank back to the newest saved state, or stop; never guess."""
        what = (
            f"optimizer shards {lost} have no exact copy at step {best}: every replica that held "
            "them was lost at once"
        )
        if self.recovered or not self.can_recover:
            why = (
                "the recovered state does not cover them either"
                if self.recovered
                else "neither snapshots nor checkpoints are enabled"
            )
            self._abort(f"{what}, and {why}")
        store = self.plane.store
        if store.add(keys.rollback(gen), 1) == 1:
            post_event(
                store,
                "rollback",
                step=best,
                dp_rank=None,
                generation=gen,
                detail=f"{what}: every rank restarts from the newest snapshot or checkpoint",
            )
        self.log(f"[failover] rank {self.rank}: {what}; rolling back to the newest saved state")
        raise ShardsLostError(what)

    def _sync_state(self, engine: Any, gen: int, deadline: float) -> int:
        """The newest state step among members, after sending it to those that lack it."""
        m = self.membership
        best, steps = self._exchange_steps(self._mine(), gen, deadline)
        if best < 0 and self.recover is not None:  # every replica was lost: recovery order
            t0 = time.monotonic()
            # a rollback to redo an update (`rerun.py`) must not load the state it produced
            bound = keys.get_int(self.plane.store, keys.ROLLBACK_BOUND, -1)
            recovered = self.recover(bound) if bound >= 0 else self.recover()
            if recovered is not None:
                self.plane.next_step, self.has_state = recovered, True
                self.recovered = True
                post_event(
                    self.plane.store,
                    "recovery",
                    step=recovered,
                    dp_rank=m.replica,
                    ranks=[self.rank],
                    generation=gen,
                    latency_ms=1000 * (time.monotonic() - self._started),
                    load_ms=1000 * (time.monotonic() - t0),
                    detail=f"no live replica: loaded step {recovered} locally",
                )
            best, steps = self._exchange_steps(self._mine(), gen, deadline)
            if self.recovered and is_sharded(engine.optimizer):
                best, steps = self._one_recovered_step(best, steps, gen, deadline)
        if best < 0:  # a joiner whose only source died mid-transfer, with nothing saved
            self._abort(
                "no live replica holds the training state to rejoin from, and none is saved"
            )
        if m.size == 1:
            return best
        source = int((steps == best).nonzero()[0])
        receivers = [i for i in range(m.size) if int(steps[i]) < best]
        if not receivers:
            return best
        if self.before_transfer is not None and (m.position == source or m.position in receivers):
            self.before_transfer()
        if m.position == source:
            self._send(engine, best, receivers, gen, deadline)
        elif m.position in receivers:
            self._receive(engine, best, source, gen, deadline)
        return best

    def _one_recovered_step(self, best: int, steps: torch.Tensor, gen: int, deadline: float):
        """Every replica recovered its own newest state; with the distributed optimizer each holds
        only its shards, so all must stand on one step: those ahead load the oldest step any
        member recovered (a snapshot keeps two slots), a few rounds at most."""
        for _ in range(3):
            have = [int(s) for s in steps if int(s) >= 0]
            low = min(have, default=-1)
            if low == best:
                break
            if self._mine() > low:
                self.log(
                    f"[failover] rank {self.rank}: another replica recovered step {low} only; "
                    f"loading step {low} instead of {self._mine()} (sharded optimizer state)"
                )
                step = self.recover(low)
                self.plane.next_step = step if step is not None else -1
                self.has_state = step is not None
            best, steps = self._exchange_steps(self._mine(), gen, deadline)
        return best, steps

    def _mine(self) -> int:
        return self.plane.next_step if self.has_state else -1

    def _abort(self, reason: str) -> None:
        store = self.plane.store
        if store.compare_set(keys.ABORT, "", reason).decode() == reason:
            store.append(keys.FLAGS, f"{keys.ABORT};")
            post_event(store, "abort", step=self.plane.next_step, dp_rank=None, detail=reason)
        raise JobAbortedError(reason)

    def _exchange_steps(self, mine: int, gen: int, deadline: float) -> tuple[int, torch.Tensor]:
        """Every member's state step (-1: none) and the newest one."""
        m = self.membership
        steps = torch.zeros(m.size, dtype=torch.int64)  # summed: each member fills its own slot
        steps[m.position] = mine
        if m.size > 1 and not m.collectives.all_reduce(steps, m.group):
            raise Superseded(self.plane.wait_newer_generation(gen, deadline))
        return int(steps.max()), steps

    def _p2p(self, work, what: str, gen: int, deadline: float) -> None:
        if wait_work(work, what, backend=self.backend, lost=self._lost, p2p=True) is not None:
            raise Superseded(self.plane.wait_newer_generation(gen, deadline))

    def _send(self, engine, best: int, receivers: list[int], gen: int, deadline: float) -> None:
        m = self.membership
        # sharded optimizer: its step count only; the shards follow from their holders
        payload = train_state.to_bytes(train_state.state_dict(engine, best, shards=False))
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        for dst in receivers:
            for tag, tensor in ((1, size), (2, payload)):
                self._p2p(m.group.send([tensor], dst, tag), "state send", gen, deadline)
        self.log(
            f"[failover] rank {self.rank}: sent state of step {best} "
            f"({payload.numel() / 1e6:.2f} MB) to replicas {[m.members[i] for i in receivers]}"
        )

    def _receive(self, engine, best: int, source: int, gen: int, deadline: float) -> None:
        m = self.membership
        t0 = time.monotonic()
        size = torch.zeros(1, dtype=torch.int64)
        self._p2p(m.group.recv([size], source, 1), "state receive", gen, deadline)
        payload = torch.empty(int(size), dtype=torch.uint8)
        self._p2p(m.group.recv([payload], source, 2), "state receive", gen, deadline)
        self.plane.next_step = train_state.load_state_dict(engine, train_state.from_bytes(payload))
        self.has_state = True
        elapsed = time.monotonic() - t0
        self.rejoin_bytes, self.rejoin_s = int(payload.numel()), elapsed
        post_event(
            self.plane.store,
            "rejoin",
            step=self.plane.next_step,
            dp_rank=m.replica,
            ranks=[self.rank],
            generation=gen,
            latency_ms=1000 * (time.monotonic() - self._started),
            bytes=int(payload.numel()),
            transfer_ms=1000 * elapsed,
            detail=(
                f"state of step {best} from replica {m.members[source]}: "
                f"{payload.numel() / 1e6:.2f} MB in {1000 * elapsed:.0f} ms "
                f"({payload.numel() / 1e6 / max(elapsed, 1e-9):.1f} MB/s)"
            ),
        )
