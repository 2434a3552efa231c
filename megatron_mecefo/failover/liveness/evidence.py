"""Liveness evidence from the node agents: tells a *slow* rank from a *gone* one.

A trainer's own heartbeat is a thread in its interpreter: a C extension that holds the GIL (an
index build, a big unpickle) or an overloaded host can starve it for seconds while the process is
perfectly alive. So heartbeat silence is only a suspicion. Each node's agent, a small process that
shares no interpreter with the trainers, publishes one key per node (`records.NodeReport`, one
writer per node) with what the kernel says of each of its ranks: pid, incarnation, scheduler state
and CPU time. The coordinator turns a silent heartbeat into a verdict:

- GONE: the process is stopped (SIGSTOP, `T`), a zombie, or absent, or its node is lost - dead at
  the soft timeout;
- SLOW: the agent sees the process running or sleeping - dead only at the hard timeout;
- UNKNOWN: no agent reports on this rank (e.g. threads as ranks in tests) - dead at the soft
  timeout, as before.

A node is lost when its agent's report has not moved for `agent_timeout_s` (tcp store), or, on an
etcd store, when the lease of the agent that last reported for it expired (`NodeWatch.leases`,
from `failover/node/node_lease.py`'s keys): etcd itself says the agent is gone.

No torch import.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from megatron_mecefo.control.records import NodeReport, RankEntry

GONE_STATES = frozenset("TtZX")
"""/proc states of a process that will not beat again by itself: stopped, traced, zombie, dead."""


FRESH_MARGIN_S = 0.5
"""An agent report vouches for a silent rank only if made this long after the rank fell silent
(agents report every 0.1 s; the margin absorbs the coordinator's read period)."""


class Verdict(enum.Enum):
    GONE = "gone"
    SLOW = "slow"
    UNKNOWN = "unknown"


@dataclass
class _Node:
    seq: int | str = -1
    changed: float = 0.0
    ranks: dict[int, RankEntry] = field(default_factory=dict)


class NodeWatch:
    """The coordinator's view of the agents' reports (fed by `update`, asked by `verdict`)."""

    def __init__(self, agent_timeout_s: float):
        self.agent_timeout_s = agent_timeout_s
        self.nodes: dict[int, _Node] = {}
        self.node_of: dict[int, int] = {}  # rank -> node, from the reports
        self.leases: set[int] | None = None
        """etcd: the agent ids whose lease key exists (None: no leases, judge by silence)."""
        self._touched: dict[int, float] = {}  # node -> when it was given to a standby

    def update(self, node: int, report: NodeReport, now: float) -> None:
        st = self.nodes.setdefault(node, _Node())
        if report.seq != st.seq:
            st.seq, st.changed, st.ranks = report.seq, now, report.ranks
            for rank in st.ranks:
                self.node_of[rank] = node

    def silent_s(self, node: int, now: float) -> float | None:
        """Seconds since `node`'s agent last moved its report (None: it never reported)."""
        st = self.nodes.get(node)
        return None if st is None else now - st.changed

    def touch(self, node: int, now: float) -> None:
        """Restart one node's age (it was just given to a standby that has yet to report)."""
        if node in self.nodes:
            self.nodes[node].changed = now
            self._touched[node] = now

    def lost(self, node: int, now: float) -> str | None:
        """Why `node` is lost (its agent's lease expired, or it is silent), or None. A node just
        given to a standby is not lost again for `agent_timeout_s` (its first report)."""
        st = self.nodes.get(node)
        if st is None:
            return None
        owner = _owner(st.seq)
        if self.leases is not None and owner is not None:
            if now - self._touched.get(node, float("-inf")) <= self.agent_timeout_s:
                return None
            return None if owner in self.leases else f"agent {owner}'s etcd lease expired"
        age = now - st.changed
        return f"its agent is silent ({age:.1f} s)" if age > self.agent_timeout_s else None

    def refresh(self, now: float) -> None:
        """Forget the ages seen so far (the coordinator itself was paused or just restarted)."""
        for st in self.nodes.values():
            st.changed = now

    def kernel_says_gone(self, rank: int, incarnation: int) -> bool:
        """The agent's last report shows this incarnation stopped, a zombie, absent, or replaced:
        evidence of its own, whatever the report's age (unlike a report that merely stopped)."""
        node = self.node_of.get(rank)
        if node is None:
            return False
        entry = self.nodes[node].ranks.get(rank)
        return entry is None or entry.incarnation > incarnation or entry.state in GONE_STATES

    def starting(self, rank: int, newer_than: int, now: float) -> bool:
        """The agent's last report shows a live process of `rank` in an incarnation newer than
        `newer_than` (restarted, not yet registered), and that agent is not lost."""
        node = self.node_of.get(rank)
        if node is None or self.lost(node, now) is not None:
            return False
        entry = self.nodes[node].ranks.get(rank)
        return (
            entry is not None
            and entry.incarnation > newer_than
            and (entry.state not in GONE_STATES)
        )

    def verdict(
        self, rank: int, incarnation: int, now: float, *, silent_since: float = float("-inf")
    ) -> tuple[Verdict, str]:
        """What the agent's evidence says of `rank`'s current incarnation, with a reason. Only a
        report the agent made after the rank fell silent (`silent_since`) can vouch for it: a
        node that died whole leaves a last report that still shows its ranks alive."""
        node = self.node_of.get(rank)
        if node is None:
            return Verdict.UNKNOWN, "no agent reports on it"
        st = self.nodes[node]
        age = now - st.changed
        lost = self.lost(node, now)
        if lost is not None:
            return Verdict.GONE, f"its node is lost: {lost}"
        entry = st.ranks.get(rank)
        if entry is None or entry.incarnation > incarnation:
            return Verdict.GONE, "its agent no longer runs this incarnation"
        if entry.incarnation < incarnation:
            return Verdict.UNKNOWN, "its agent has not reported this incarnation yet"
        if entry.state in GONE_STATES:
            return Verdict.GONE, f"process {entry.pid} is in state {entry.state}"
        if st.changed < silent_since + FRESH_MARGIN_S:
            return Verdict.UNKNOWN, f"its agent has not reported since it fell silent ({age:.1f} s)"
        return Verdict.SLOW, f"process {entry.pid} is alive (state {entry.state})"


def _owner(seq: int | str) -> int | None:
    """The agent id in a node report's seq (`"<agent id>:<report seq>"`, `agent.py`)."""
    head, sep, _ = str(seq).partition(":")
    return int(head) if sep and head.isdigit() else None
