"""Regroup at a step boundary: form a generation's DP group and bring every member to one state.

A generation's group is built directly on a `PrefixStore` (`groups.py`), because
`torch.distributed.new_group` would need the dead rank. Building it runs in a helper thread while
this one watches for a newer generation (retarget it), the end of the job, and the regroup
timeout. The old group is retired (NCCL: aborted; gloo: released from a daemon thread once its
bounded work ends). Then `transfer.StateSync` sends the newest state to members that lack it.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from megatron_mecefo.control import keys
from megatron_mecefo.control.records import post_event
from megatron_mecefo.errors import FencedError
from megatron_mecefo.failover.trainer import groups
from megatron_mecefo.failover.trainer.plane import ControlPlane, Superseded
from megatron_mecefo.failover.trainer.transfer import StateSync
from megatron_mecefo.training.membership import Membership


class Regroup:
    """Forms generations for one trainer (see the module docstring)."""

    def __init__(
        self,
        plane: ControlPlane,
        membership: Membership,
        sync: StateSync,
        *,
        rank: int,
        position: int,
        backend: str,
        group_timeout_s: float,
        regroup_timeout_s: float,
        log=print,
    ):
        self.plane = plane
        self.membership = membership
        self.sync = sync
        self.rank, self.position = rank, position
        self.backend = backend
        self.group_timeout_s = group_timeout_s
        self.regroup_timeout_s = regroup_timeout_s
        self.log = log
        self.count = 0
        """Generations formed by this process."""
        self._graveyard: list[Any] = []  # NCCL groups whose abort hung: never destroyed

    def adopt(self, engine, gen: int, key: str, *, is_leader) -> None:
        """Form generation `gen` (or a newer one if it is superseded meanwhile) on store prefix
        `key`, and sync state. `is_leader()` says whether this rank posts the regroup event."""
        replica = self.membership.replica
        deadline = time.monotonic() + self.regroup_timeout_s
        t0 = time.monotonic()
        self.plane.set_phase("idle")
        while True:
            members = tuple(self.plane.record(gen).members)
            if replica not in members:
                raise FencedError(
                    f"replica {replica} is not in generation {gen} (declared dead); "
                    "exiting so the agent restarts it to rejoin"
                )
            try:
                group = self._build_group(key, members, gen, deadline)
                self._install(gen, members, group)
                self.sync.sync(engine, gen, deadline)
                break
            except Superseded as newer:
                gen, key = newer.gen, f"pg/{newer.gen}"
        self.count += 1
        self.log(
            f"[failover] rank {self.rank}: generation {gen}, members {list(members)}, "
            f"formed in {1000 * (time.monotonic() - t0):.0f} ms"
        )
        record = self.plane.record(gen)
        if is_leader() and gen > 1:
            failed_at = record.failure_epoch_s
            post_event(
                self.plane.store,
                "regroup",
                step=self.plane.next_step,
                dp_rank=(record.removed or record.added or [None])[0],
                generation=gen,
                **({"latency_ms": 1000 * (time.time() - failed_at)} if failed_at else {}),
                detail=f"{record.reason}: members {list(members)}, removed "
                f"{record.removed}, added {record.added}",
            )

    def _build_group(self, key: str, members: tuple[int, ...], gen: int, deadline: float):
        if len(members) == 1:
            return None
        pos, size = members.index(self.membership.replica), len(members)
        timeout = timedelta(seconds=self.group_timeout_s)
        result: dict[str, Any] = {}

        def build() -> None:
            try:
                client = keys.connect(self.plane.address, self.regroup_timeout_s, torch_client=True)
                # one DP group per position in the replica (TP rank, PP stage)
                prefix = dist.PrefixStore(f"{key}/tp{self.position}", client)
                result["group"] = groups.new_group(self.backend, prefix, pos, size, timeout)
            except Exception as exc:  # noqa: BLE001 - surfaced below
                result["error"] = exc

        thread = threading.Thread(target=build, name=f"mecefo-group-{gen}", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.01)
            self.plane.check_superseded(gen, deadline, self.regroup_timeout_s)
        if "error" in result:
            self.log(
                f"[failover] rank {self.rank}: building generation {gen} failed: "
                f"{result['error']}; waiting for the coordinator"
            )
            raise Superseded(self.plane.wait_newer_generation(gen, deadline))
        return result["group"]

    def _install(self, gen: int, members: tuple[int, ...], group) -> None:
        m = self.membership
        old, m.group = m.group, None
        if old is not None:  # NCCL: aborted and destroyed; gloo: released in a thread (groups.py)
            groups.retire_group(old, self.backend, self._graveyard, log=self.log)
        del old
        m.generation, m.members, m.group = gen, members, group
        m.begin_attempt()
