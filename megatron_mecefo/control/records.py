"""The typed records the control plane keeps in the store: one home per format.

- `GenerationRecord` (`gen/<g>`): who trains in generation g; written by the coordinator, read by
  every trainer (through its agent's copy when heartbeats are aggregated) and by the agents.
- `Registration` (`reg/<rank>`): a trainer process announcing itself; read by the coordinator,
  the agents and `mecefo-inject`.
- `NodeReport` (`node/<i>`): what a node agent sees of its ranks (kernel state, and their beats
  when aggregated); read by the coordinator's liveness evidence.
- events (`ev/<i>`): posted by any process, drained by the coordinator into `events.jsonl`
  (whose schema is `metrics/events.py`).

JSON on the wire is unchanged from the first format of each record (a restarted coordinator, or
a tool, reads what an older writer wrote). No torch import.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from megatron_mecefo.control import keys
from megatron_mecefo.control.proc import proc_state


def _known_fields(cls, raw: bytes | str):
    """`cls` from a JSON object, ignoring keys it does not know (a newer writer's extras)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in json.loads(raw).items() if k in names})


@dataclasses.dataclass
class GenerationRecord:
    """Replicas of one membership generation, as the coordinator published it."""

    members: list[int]
    """Alive logical replicas (sorted)."""
    removed: list[int] = dataclasses.field(default_factory=list)
    added: list[int] = dataclasses.field(default_factory=list)
    reason: str = ""
    """start | failure | join | recover."""
    replica_size: int | None = None
    """Ranks of one replica (TP x PP)."""
    epoch_s: float = 0.0
    """When it was published."""
    failure_epoch_s: float | None = None
    """When the failure it answers happened (None: not a failure)."""
    step: int = 0
    """The job's step when it was published."""
    incarnations: dict[str, int] = dataclasses.field(default_factory=dict)
    """Global rank (as text) -> the incarnation the generation is for: a restarted rank must not
    form an older generation that still lists its dead predecessor."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> GenerationRecord:
        return _known_fields(cls, raw)

    def admits(self, rank: int, replica: int, incarnation: int) -> bool:
        """The generation lists `replica`, for this incarnation of `rank`."""
        listed = self.incarnations.get(str(rank), incarnation)
        return replica in self.members and listed == incarnation


class Fenced(RuntimeError):
    """A coordinator's write was refused: a newer coordinator took over (etcd store)."""


def publish_generation(store, gen: int, record: GenerationRecord, epoch: int | None = None) -> None:
    """The record first, then the counter that announces it. On an etcd store, with the
    coordinator's `epoch`, both are one transaction on the previous generation and that epoch:
    a stale coordinator (one that a newer one superseded) publishes nothing and gets `Fenced`."""
    if epoch is not None and hasattr(store, "txn_put"):
        ok = store.txn_put(
            {keys.GEN: str(gen - 1), keys.COORD_EPOCH: str(epoch)},
            {keys.gen_record(gen): record.to_json(), keys.GEN: str(gen)},
        )
        if not ok:
            raise Fenced(
                f"generation {gen} not published: generation {gen - 1} or coordinator epoch "
                f"{epoch} is no longer current"
            )
        return
    store.set(keys.gen_record(gen), record.to_json())
    store.set(keys.GEN, str(gen))


def read_generation(store, gen: int) -> GenerationRecord:
    return GenerationRecord.from_json(store.get(keys.gen_record(gen)))


@dataclasses.dataclass
class Registration:
    """A trainer process, as it announced itself at start."""

    incarnation: int
    pid: int
    host: str
    tp: int
    world: int
    node: int = 0
    """The node (agent) it runs on (`keys.NODE_RANK_ENV`)."""
    pp: int = 1
    """Pipeline stages of its replica."""

    @property
    def replica_size(self) -> int:
        """Ranks of its replica (TP x PP)."""
        return self.tp * self.pp

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Registration:
        return _known_fields(cls, raw)


def read_registration(store, rank: int) -> Registration | None:
    key = keys.registration(rank)
    return Registration.from_json(store.get(key)) if store.check([key]) else None


@dataclasses.dataclass
class RankEntry:
    """One rank in a node report: on the wire `[inc, pid, state, cpu(, beats, progress)]`."""

    incarnation: int
    pid: int
    state: str
    """/proc scheduler state letter; `X` when the process is gone."""
    cpu_ticks: int
    beats: int | None = None
    """The rank's heartbeat counter, when it beats through its agent."""
    progress: str | None = None
    """Its `<incarnation>:<step>:<phase>`, when it beats through its agent."""

    def to_list(self) -> list:
        out: list = [self.incarnation, self.pid, self.state, self.cpu_ticks]
        if self.beats is not None:
            out += [self.beats, self.progress]
        return out

    @classmethod
    def from_list(cls, entry: list) -> RankEntry:
        return cls(*entry[:4], *(entry[4:6] if len(entry) >= 6 else ()))


@dataclasses.dataclass
class NodeReport:
    """What one node agent sees of its ranks (`keys.node_key`), one writer per node."""

    seq: int | str
    """Moves every agent tick (`<agent id>:<n>`): a report that stops moving is a silent agent."""
    ranks: dict[int, RankEntry]

    def to_json(self) -> str:
        ranks = {str(r): e.to_list() for r, e in self.ranks.items()}
        return json.dumps({"seq": self.seq, "ranks": ranks})

    @classmethod
    def from_json(cls, raw: bytes | str) -> NodeReport:
        data = json.loads(raw)
        ranks = {int(r): RankEntry.from_list(e) for r, e in data["ranks"].items()}
        return cls(data["seq"], ranks)


def node_report(
    seq: int | str, procs: dict[int, tuple[int, int]], beats: dict[int, dict] | None = None
) -> str:
    """The node key's value for `procs` (rank -> (incarnation, pid)), read from /proc now, with
    each rank's beat counter and progress from `beats` (`local_beat.read_beats`) where given."""
    ranks = {}
    for rank, (incarnation, pid) in procs.items():
        st = proc_state(pid)
        entry = RankEntry(incarnation, pid, st[0] if st else "X", st[1] if st else -1)
        beat = (beats or {}).get(rank)
        if beat is not None:
            entry.beats, entry.progress = beat["beats"], beat["progress"]
        ranks[rank] = entry
    return NodeReport(seq, ranks).to_json()


def post_event(store, event_type: str, **fields: Any) -> None:
    """Queue one event for the coordinator's events.jsonl (`epoch_s` = when it happened). The
    counter moves before the value is written: a reader waits for a missing value (its poster
    may also have died in between)."""
    fields.setdefault("epoch_s", time.time())
    index = store.add(keys.EVENT_SEQ, 1)
    store.set(keys.event(index), json.dumps({"type": event_type, **fields}))


def posted_events(store, wait_s: float = 0.0) -> tuple[list[dict], int]:
    """Every event posted to the store so far, and the last one's sequence number: what
    events.jsonl holds once the coordinator has drained (reading the store does not wait for it).
    An event whose value is not written yet is waited for, at most `wait_s`."""
    last = keys.get_int(store, keys.EVENT_SEQ, 0)
    names = [keys.event(i) for i in range(1, last + 1)]
    deadline = time.monotonic() + wait_s
    while True:
        present = [k for k in names if store.check([k])]
        if len(present) == len(names) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return ([json.loads(v) for v in store.multi_get(present)] if present else []), last
