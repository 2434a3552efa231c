"""What a piece of saved state is: run id, config hash and lineage (DESIGN.md section 9).

Snapshots and checkpoints carry a `StateIdentity`; recovery accepts state only when it is the
current run's, of the current config and on the current lineage (`relation`). A run directory
holds the identity in `identity.json` (written before step 0, owned by this module); every rank
resolves the same identity before recovery (`checkpoint/resume.py`). This module loads no state
and imports no torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

IDENTITY_FILE = "identity.json"
"""In the run directory: {"run_id", "config_hash", "lineage", "config"} of the current run."""

# Config that does not change what a state is: where things go, how often they are saved, the
# parallel layout (resuming under another DP/TP size is supported) and how long the run goes on.
_NOT_TRAJECTORY = (
    "run_dir",
    "overwrite",
    "checkpoint",
    "snapshot",
    "recovery",
    "logging",
    "failover",
    "parallel",
    "training.max_steps",
    "training.eval_interval",
    "training.eval_microbatches",
    "training.micro_batch_size",  # the global batch below is what the trajectory depends on
    "training.num_microbatches",
    "data.demo_dir",
    "data.cache_dir",
)


def trajectory_config(cfg: Any, dp_size: int) -> dict[str, Any]:
    """The part of the run config that defines the trajectory (model, data, optimiser, MeCeFO),
    with the global batch (micro-batch size x micro-batches x DP size) in place of its factors."""
    from megatron_mecefo.config.loader import to_dict

    out = to_dict(cfg)
    for dotted in _NOT_TRAJECTORY:
        *parents, leaf = dotted.split(".")
        node = out
        for key in parents:
            node = node.get(key, {})
        node.pop(leaf, None)
    t = cfg.training
    out.setdefault("training", {})["global_batch_size"] = (
        t.micro_batch_size * t.num_microbatches * dp_size
    )
    return out


def config_hash(cfg: Any, dp_size: int) -> str:
    """16 hex digits of SHA-256 over `trajectory_config` (key order does not matter)."""
    text = json.dumps(trajectory_config(cfg, dp_size), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def new_id() -> str:
    return uuid.uuid4().hex[:12]


def _start(entry: str) -> int:
    """First step of a lineage entry `<id>@<step>`."""
    return int(entry.rpartition("@")[2])


@dataclasses.dataclass(frozen=True)
class StateIdentity:
    """What the state of this run is. Equal on every rank of a job."""

    run_id: str
    """Random id of the run, kept across resumes of the same run directory."""
    config_hash: str
    """`config_hash` of the run config."""
    lineage: tuple[str, ...]
    """The chain of lines this one descends from, oldest first, each `<id>@<first step>`; the
    last is the current line. An explicit resume (a rollback or branch) appends a new entry."""
    config: dict[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)
    """The `trajectory_config` that `config_hash` digests (for messages; not compared)."""

    @classmethod
    def fresh(cls, config_hash: str, config: dict | None = None) -> StateIdentity:
        return cls(new_id(), config_hash, (f"{new_id()}@0",), config)

    @property
    def lineage_id(self) -> str:
        return self.lineage[-1]

    def branch(self, parent: tuple[str, ...], step: int) -> StateIdentity:
        """A new line that starts at `step` from a state of the line `parent`."""
        return dataclasses.replace(self, lineage=(*parent, f"{new_id()}@{step}"))

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "config_hash": self.config_hash, "lineage": self.lineage}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StateIdentity:
        """Raises ValueError (or KeyError/TypeError) for a malformed identity."""
        lineage = tuple(str(x) for x in d["lineage"])
        if not lineage or not d["run_id"] or not d["config_hash"]:
            raise ValueError(f"incomplete state identity {d}")
        for entry in lineage:
            _start(entry)
        return cls(str(d["run_id"]), str(d["config_hash"]), lineage)

    def describe(self) -> str:
        return f"run {self.run_id} / config {self.config_hash} / lineage {self.lineage_id}"

    # ------------------------------------------------------------------ snapshots
    def slot_meta(self) -> dict[str, str]:
        """What a snapshot slot header records (covered by the slot's CRC)."""
        return {"run_id": self.run_id, "config_hash": self.config_hash, "lineage": self.lineage_id}

    def snapshot_mismatch(self, meta: dict[str, Any]) -> str | None:
        """None if a snapshot with header `meta` is this run's current state, else why not."""
        if meta == self.slot_meta():
            return None
        theirs = (
            f"run {meta.get('run_id', '?')} / config {meta.get('config_hash', '?')} / "
            f"lineage {meta.get('lineage', '?')}"
        )
        return f"snapshot of {theirs}, this run is {self.describe()}: ignored"

    # ------------------------------------------------------------------ checkpoints
    def relation(self, saved: dict[str, Any] | None, step: int) -> str:
        """How a checkpoint of identity `saved` (a `to_dict`) taken at `step` relates to us:

        - `current`: this run, this config, this line;
        - `ancestor`: a state of a line this one branched from, at or before the branch point
          (an explicit resume's folder; config may differ: the branch chose it);
        - `changed`: this line, but written with another config;
        - `abandoned`: this run, a line that was rolled back (never resumed);
        - `foreign`: another run;
        - `unidentified`: no (readable) identity.
        """
        try:
            theirs = StateIdentity.from_dict(saved) if saved is not None else None
        except (ValueError, KeyError, TypeError):
            theirs = None
        if theirs is None:
            return "unidentified"
        line = theirs.lineage_id
        if line == self.lineage_id:
            if theirs.run_id != self.run_id:
                return "foreign"
            return "current" if theirs.config_hash == self.config_hash else "changed"
        for i, entry in enumerate(self.lineage[:-1]):
            if entry == line and step <= _start(self.lineage[i + 1]):
                return "ancestor"
        return "abandoned" if theirs.run_id == self.run_id else "foreign"


# ---------------------------------------------------------------------- the run directory's file
def read_file(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The run directory's identity record, or None (a new run directory, or unreadable)."""
    try:
        record = json.loads((Path(run_dir) / IDENTITY_FILE).read_text())
        StateIdentity.from_dict(record)
        return record
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_file(run_dir: str | os.PathLike, identity: StateIdentity) -> None:
    path = Path(run_dir) / IDENTITY_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({**identity.to_dict(), "config": identity.config}, indent=1))
    tmp.replace(path)


def config_changes(old: dict | None, new: dict, limit: int = 4) -> str:
    """`training.lr: 0.003 -> 0.001, ...`: what differs between two trajectory configs."""
    if not old:
        return ""
    diffs: list[str] = []

    def walk(a: Any, b: Any, prefix: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                walk(a.get(key), b.get(key), f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix[:-1]}: {a} -> {b}")

    walk(old, new, "")
    more = f", ... ({len(diffs)} keys)" if len(diffs) > limit else ""
    return ", ".join(diffs[:limit]) + more
