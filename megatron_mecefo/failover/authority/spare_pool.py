"""Spare nodes, the coordinator's side.

A standby agent (`mecefo-launch --standby`) runs no rank; it lists its id in `standby/log` once
and bumps `standby/<id>` every tick. When a working node is lost (`NodeWatch.lost`: its agent's
report has not moved for `agent_timeout_s`, or on etcd its agent's lease expired: the agent died,
alone or with its ranks), the pool gives the node to a free standby: `node_owner/<node>` and
`assign/<id>`. The standby starts the node's ranks with new incarnations; they join from a live
peer like any restarted rank, so degraded takeover only covers the seconds in between. Events:
`node_lost` when the node is declared lost, `node_replaced` (latency from the failure) once every
rank of the node is a member again. The state lives in the store (`replace/<node>`), so a
restarted coordinator goes on with a replacement in flight.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from megatron_mecefo.control import keys
from megatron_mecefo.control.records import post_event
from megatron_mecefo.failover.liveness.evidence import NodeWatch


class SparePool:
    """Free standbys and lost nodes; `tick` decides, given which nodes are back at full strength."""

    def __init__(self, store, agent_timeout_s: float, *, log: Callable[[str], None]):
        self.store = store
        self.agent_timeout_s = agent_timeout_s
        self.log = log
        self.standbys: dict[int, tuple[str, float]] = {}  # agent id -> (seq, when it moved)
        self.lost: dict[int, dict] = {}  # node -> {"standby", "failure_epoch_s", "incarnations"}
        self._ids: list[int] = []  # agents that stood by (keys.STANDBY_LOG)
        self._log_pos = 0

    def restore(self, nodes: set[int]) -> None:
        for node in nodes:
            if self.store.check([keys.replacement(node)]):
                self.lost[node] = json.loads(self.store.get(keys.replacement(node)))

    def read(self, now: float) -> None:
        """Refresh the standbys' liveness: the standby log's new ids, then one multi_get."""
        ids, self._log_pos = keys.new_log_entries(self.store, keys.STANDBY_LOG, self._log_pos)
        self._ids = sorted(set(self._ids) | set(ids))
        if not self._ids:
            return
        names = [keys.standby(i) for i in self._ids]
        for agent_id, raw in zip(self._ids, self.store.multi_get(names)):
            seq = json.loads(raw)["seq"]
            if self.standbys.get(agent_id, ("", 0.0))[0] != seq:
                self.standbys[agent_id] = (seq, now)

    def free(self, now: float) -> list[int]:
        """Standbys that beat recently and were given no node."""
        return [
            i
            for i, (_, changed) in sorted(self.standbys.items())
            if now - changed <= self.agent_timeout_s and not self.store.check([keys.assign(i)])
        ]

    def tick(
        self,
        now: float,
        watch: NodeWatch,
        incarnations: dict[int, dict[int, int]],
        full_strength: Callable[[int, dict[int, int]], bool],
        step: int,
    ) -> None:
        """`incarnations`: node -> {rank: incarnation} now; `full_strength(node, at_loss)`: every
        rank of `node` is a member again with an incarnation newer than at the loss."""
        for node, ranks in incarnations.items():
            why = None if node in self.lost else watch.lost(node, now)
            if why is None:
                continue
            silent = watch.silent_s(node, now) or 0.0  # its last report: when it failed
            rec = {"standby": None, "failure_epoch_s": time.time() - silent, "incarnations": ranks}
            self.lost[node] = rec
            self._save(node)
            post_event(
                self.store,
                "node_lost",
                step=max(step, 0),
                dp_rank=None,
                ranks=sorted(ranks),
                epoch_s=rec["failure_epoch_s"],
                detail=f"node {node}: {why}; last report {silent:.1f} s ago",
            )
            self.log(f"[coordinator] node {node} lost ({why}; last report {silent:.1f} s ago)")
        for node, rec in list(self.lost.items()):
            if rec["standby"] is None and watch.lost(node, now) is None:
                self.log(f"[coordinator] node {node}'s agent is back; it restarts its own ranks")
                del self.lost[node]
                self.store.delete_key(keys.replacement(node))
                continue
            if rec["standby"] is None:
                free = self.free(now)
                if not free:
                    continue  # its ranks stay down (degraded) until a standby or the node returns
                rec["standby"] = free[0]
                watch.touch(node, now)  # not lost again before the standby's first report
                self.store.set(keys.node_owner(node), str(free[0]))
                self.store.set(keys.assign(free[0]), str(node))
                self._save(node)
                self.log(f"[coordinator] node {node} given to standby agent {free[0]}")
            elif full_strength(node, {int(r): i for r, i in rec["incarnations"].items()}):
                latency_s = time.time() - rec["failure_epoch_s"]
                post_event(
                    self.store,
                    "node_replaced",
                    step=max(step, 0),
                    dp_rank=None,
                    ranks=sorted(int(r) for r in rec["incarnations"]),
                    latency_ms=1000 * latency_s,
                    detail=f"node {node} back at full strength on standby agent {rec['standby']}",
                )
                self.log(
                    f"[coordinator] node {node} replaced: full strength after {latency_s:.1f} s"
                )
                watch.touch(node, now)
                del self.lost[node]
                self.store.delete_key(keys.replacement(node))

    def _save(self, node: int) -> None:
        self.store.set(keys.replacement(node), json.dumps(self.lost[node]))
