"""Liveness evidence from the node agents: tells a *slow* rank from a *gone* one.

A trainer's own heartbeat is a thread in its interpreter: a C extension that holds the GIL (an
index build, a big unpickle) or an overloaded host can starve it for seconds while the process is
perfectly alive. So heartbeat silence is only a suspicion. Each node's agent, a small process that
shares no interpreter with the trainers, publishes one key per node (`node/<i>`, one writer per
node) with what the kernel says of each of its ranks: pid, incarnation, scheduler state and CPU
time. The coordinator turns a silent heartbeat into a verdict:

- GONE: the process is stopped (SIGSTOP, `T`), a zombie, or absent, or the agent itself is silent
  (node lost) - dead at the soft timeout;
- SLOW: the agent sees the process running or sleeping - dead only at the hard timeout;
- UNKNOWN: no agent reports on this rank (e.g. threads as ranks in tests) - dead at the soft
  timeout, as before.

This module has no torch import: the agent imports it cheaply.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

GONE_STATES = frozenset("TtZX")
"""/proc states of a process that will not beat again by itself: stopped, traced, zombie, dead."""


FRESH_MARGIN_S = 0.5
"""An agent report vouches for a silent rank only if made this long after the rank fell silent
(agents report every 0.1 s; the margin absorbs the coordinator's read period)."""


class Verdict(enum.Enum):
    GONE = "gone"
    SLOW = "slow"
    UNKNOWN = "unknown"


def node_key(node: int) -> str:
    """JSON {"seq": n, "ranks": {rank: [incarnation, pid, state, cpu_ticks(, beats, progress)]}}
    of one node; the last two when the rank beats through its agent (`local_beat.py`)."""
    return f"node/{node}"


def proc_state(pid: int) -> tuple[str, int] | None:
    """(scheduler state letter, utime + stime in clock ticks) of `pid`, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()  # the command name may hold spaces or parens
    if len(fields) < 13:
        return None
    return fields[0], int(fields[11]) + int(fields[12])


def node_report(
    seq: int | str, procs: dict[int, tuple[int, int]], beats: dict[int, dict] | None = None
) -> str:
    """The node key's value for `procs` (rank -> (incarnation, pid)), read from /proc now, with
    each rank's beat counter and progress from `beats` (`local_beat.read_beats`) where given."""
    ranks = {}
    for rank, (incarnation, pid) in procs.items():
        st = proc_state(pid)
        entry = [incarnation, pid, st[0] if st else "X", st[1] if st else -1]
        beat = (beats or {}).get(rank)
        if beat is not None:
            entry += [beat["beats"], beat["progress"]]
        ranks[str(rank)] = entry
    return json.dumps({"seq": seq, "ranks": ranks})


@dataclass
class _Node:
    seq: int = -1
    changed: float = 0.0
    ranks: dict[str, list] = field(default_factory=dict)


class NodeWatch:
    """The coordinator's view of the agents' reports (fed by `update`, asked by `verdict`)."""

    def __init__(self, agent_timeout_s: float):
        self.agent_timeout_s = agent_timeout_s
        self.nodes: dict[int, _Node] = {}
        self.node_of: dict[int, int] = {}  # rank -> node, from the reports

    def update(self, node: int, raw: bytes | str, now: float) -> None:
        self.update_report(node, json.loads(raw), now)

    def update_report(self, node: int, report: dict, now: float) -> None:
        """`update` with the report already decoded."""
        st = self.nodes.setdefault(node, _Node())
        if report["seq"] != st.seq:
            st.seq, st.changed, st.ranks = report["seq"], now, report["ranks"]
            for rank in st.ranks:
                self.node_of[int(rank)] = node

    def silent_s(self, node: int, now: float) -> float | None:
        """Seconds since `node`'s agent last moved its report (None: it never reported)."""
        st = self.nodes.get(node)
        return None if st is None else now - st.changed

    def touch(self, node: int, now: float) -> None:
        """Restart one node's age (it was just given to a standby that has yet to report)."""
        if node in self.nodes:
            self.nodes[node].changed = now

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
        entry = self.nodes[node].ranks.get(str(rank))
        return entry is None or entry[0] > incarnation or entry[2] in GONE_STATES

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
        if age > self.agent_timeout_s:
            return Verdict.GONE, f"its node's agent is silent too ({age:.1f} s)"
        entry = st.ranks.get(str(rank))
        if entry is None or entry[0] > incarnation:
            return Verdict.GONE, "its agent no longer runs this incarnation"
        if entry[0] < incarnation:
            return Verdict.UNKNOWN, "its agent has not reported this incarnation yet"
        state = entry[2]
        if state in GONE_STATES:
            return Verdict.GONE, f"process {entry[1]} is in state {state}"
        if st.changed < silent_since + FRESH_MARGIN_S:
            return Verdict.UNKNOWN, f"its agent has not reported since it fell silent ({age:.1f} s)"
        return Verdict.SLOW, f"process {entry[1]} is alive (state {state})"
