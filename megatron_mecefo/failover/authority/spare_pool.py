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

A node that computes too slowly (the leader's `keys.RETIRE` request, `trainer/straggler.py`) is
given to a free standby the same way (`evicted`, then `node_replaced`); its own agent stops its
ranks and stands by for good (`assign/<its id>` = `keys.RETIRED`). With no standby free the
request is left: the straggler keeps its smaller share.
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
        self._no_standby_logged = False

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
                self._give(node, free[0], rec["incarnations"], rec["failure_epoch_s"])
                watch.touch(node, now)  # not lost again before the standby's first report
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

    def retire(
        self,
        now: float,
        watch: NodeWatch,
        incarnations: dict[int, dict[int, int]],
        replica_ranks: Callable[[int], list[int]],
        member_ranks: list[int],
        step: int,
    ) -> None:
        """Act on the leader's `keys.RETIRE` request, if any: give the nodes of the replicas it
        names to free standbys (see the module docstring), never a node that holds every live
        member (its state would go with it)."""
        if not self.store.check([keys.RETIRE]):
            return
        request = json.loads(self.store.get(keys.RETIRE))
        for replica, slower in sorted(request["replicas"].items()):
            ranks = set(replica_ranks(int(replica)))
            for node, at_node in sorted(incarnations.items()):
                if node in self.lost or not ranks & set(at_node):
                    continue
                if not set(member_ranks) - set(at_node):
                    return  # the only live state: it keeps its smaller share for now
                free = self.free(now)
                if not free:
                    if not self._no_standby_logged:
                        self.log(
                            f"[coordinator] replica {replica} computes {slower}x slower "
                            "per sample; no standby is free: it keeps a smaller share"
                        )
                        self._no_standby_logged = True
                    return  # the request stays: a standby may come
                self._give(node, free[0], at_node, time.time(), retired=True)
                watch.touch(node, now)
                why = f"replica {replica} computes {slower}x slower per sample than the others"
                post_event(
                    self.store,
                    "evicted",
                    step=max(step, request["step"]),
                    dp_rank=int(replica),
                    ranks=sorted(at_node),
                    standby=free[0],
                    detail=f"node {node}: {why} (a straggler); given to standby agent {free[0]}",
                )
                self.log(f"[coordinator] node {node} given to standby agent {free[0]}: {why}")
        self.store.delete_key(keys.RETIRE)

    def _give(
        self,
        node: int,
        standby: int,
        ranks: dict[int, int],
        failed_epoch_s: float,
        *,
        retired: bool = False,
    ) -> None:
        """`node` (its ranks' incarnations `ranks`) to `standby`; a retired node's agent never
        takes a node again."""
        if retired:
            self.store.set(keys.assign(int(self.store.get(keys.node_owner(node)))), keys.RETIRED)
        self.lost[node] = {
            "standby": standby,
            "failure_epoch_s": failed_epoch_s,
            "incarnations": ranks,
        }
        self.store.set(keys.node_owner(node), str(standby))
        self.store.set(keys.assign(standby), str(node))
        self._save(node)

    def _save(self, node: int) -> None:
        self.store.set(keys.replacement(node), json.dumps(self.lost[node]))
