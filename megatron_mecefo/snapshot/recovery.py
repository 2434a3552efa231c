"""The recovery order: load the newest valid state among {own snapshot, parity rebuild, disk}.

A rank that starts without a live peer to copy from (a fresh job start, or every replica lost at
once) asks `Recovery`. It lists the candidates from headers and commit markers only, newest
first (a snapshot before a disk checkpoint of the same step: no disk I/O), then loads the first
that verifies. Only state of this run's identity is a candidate (`training.identity`: run id,
config hash, lineage; a snapshot of another run is logged and ignored). The TP ranks of a replica
agree on each candidate (same step, every shard loaded) before using it. Each skipped candidate
is logged with a one-line reason; nothing corrupt or foreign is ever loaded. A snapshot the
node's snapshot process rebuilt from parity says so in a marker file.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_mecefo.checkpoint import layout
from megatron_mecefo.checkpoint.manager import CheckpointManager, find_resume
from megatron_mecefo.errors import CheckpointError, SnapshotCorruptError
from megatron_mecefo.snapshot.paths import REBUILT_MARKER, SMP_ENV
from megatron_mecefo.snapshot.slots import SlotPair
from megatron_mecefo.training import state as train_state
from megatron_mecefo.training.identity import StateIdentity


@dataclass(frozen=True)
class Candidate:
    source: str  # "snapshot" | "parity" | "disk"
    step: int
    where: str
    found: Any = None  # for disk: (folder, marker as listed, None if corrupt) from find_resume


class Recovery:
    """The recovery order for one rank; `agree` reduces a value over the replica's TP ranks.

    `identity` is what the state must be (`identity.resolve`). `resume` (default
    `checkpoint.resume`) applies to the first load; later loads (in-job recoveries) continue the
    current line (`auto`), so an explicit rollback is not repeated mid-job."""

    def __init__(
        self,
        cfg,
        *,
        rank: int,
        snapshot_dir: Path | None,
        identity: StateIdentity,
        resume: str | None = None,
        agree_min: Callable[[int], int] = lambda x: x,
        log: Callable[[str], None] = print,
    ):
        self.cfg = cfg
        self.rank = rank
        self.identity = identity
        self.resume = cfg.checkpoint.resume if resume is None else resume
        self.pair = SlotPair(snapshot_dir, rank) if snapshot_dir is not None else None
        self.snapshot_dir = snapshot_dir
        self.agree_min = agree_min
        self.log = log
        self.used: Candidate | None = None
        self.skipped: list[str] = []
        self._listed: list[Candidate] | None = None

    def candidates(self) -> list[Candidate]:
        """Newest first; at equal steps, memory before disk. Reads slot headers and commit
        markers only (a checkpoint's files are hashed when it is loaded). Listed once: the next
        `load` uses this list."""
        if self._listed is None:
            self._listed = self._list()
        return self._listed

    def _list(self) -> list[Candidate]:
        found: list[Candidate] = []
        if self.resume == "never":
            return found
        self._wait_for_smp()
        if self.pair is not None and self.resume == "auto":
            rebuilt = self._rebuilt_step()
            for head, _ in self.pair.clean():
                why = self.identity.snapshot_mismatch(head.meta)
                if why is not None:  # another run's (or line's) state: not a candidate
                    self.skipped.append(f"snapshot step {head.step}: {why}")
                    self.log(f"skipping snapshot step {head.step}: {why}")
                    continue
                source = "parity" if head.step == rebuilt else "snapshot"
                found.append(Candidate(source, head.step, str(self.snapshot_dir)))
        disk = find_resume(
            self.cfg.checkpoint, self.cfg.run_dir, self.identity, resume=self.resume, log=self.log
        )
        for folder, marker in disk:
            step = int(marker["next_step"]) if marker else int(folder.name.removeprefix("step_"))
            found.append(Candidate("disk", step, str(folder), (folder, marker)))
        unique = {(c.source, c.step): c for c in found}.values()  # both slots may hold a step
        return sorted(unique, key=lambda c: (-c.step, c.source == "disk"))

    def load(self, engine, ckpt: CheckpointManager, at_most: int | None = None) -> int | None:
        """Load the newest state every rank of the `agree_min` group can load; returns its next
        step, or None when no rank has any state (a fresh start). `at_most`: ignore newer steps
        (failover with the distributed optimizer brings every replica to one step).

        All ranks run the same rounds: they agree on the newest step s anyone might still load
        (the minimum of each rank's best), each loads its own candidate of step s, and if any
        rank failed they all drop every candidate >= s and go on. So TP shards (or, without
        failover, all replicas) always end on one step.

        Raises:
            CheckpointError: some rank has state but no step could be loaded by all of them.
        """
        remaining = [c for c in self.candidates() if at_most is None or c.step <= at_most]
        self._listed = None  # a later load lists again (state may have been written since)
        self.resume = "auto"  # a later load (an in-job recovery) continues the current line
        had_state = int(bool(remaining))
        tried: list[str] = []
        while True:
            best = max((c.step for c in remaining), default=-1)
            step = self.agree_min(best)
            if step < 0:
                if -self.agree_min(-had_state) == 1:  # some rank had state: never start over
                    raise CheckpointError(
                        "no saved state that every rank can load"
                        + (f"; tried {', '.join(tried)}" if tried else "")
                        + (f" ({'; '.join(self.skipped)})" if self.skipped else "")
                        + "; to start from scratch instead, set checkpoint.resume=never"
                    )
                return None
            t0 = time.perf_counter()
            # memory first (local, no collective), then disk, which every rank must load together
            for kind in ("memory", "disk"):
                mine = [
                    c
                    for c in remaining
                    if c.step == step and (c.source == "disk") == (kind == "disk")
                ]
                if kind == "disk" and self.agree_min(int(bool(mine))) == 0:
                    break
                cand = mine[0] if mine else None
                ok, why = (
                    (False, "not held by this rank")
                    if cand is None
                    else self._try(engine, ckpt, cand)
                )
                if cand is not None and not ok:
                    tried.append(f"{cand.source} step {step}")
                    self._skip(cand, why)
                if self.agree_min(int(ok)) == 1:
                    self.used = cand
                    self.log(
                        f"recovered the state of step {step} from {_describe(cand)} in "
                        f"{1000 * (time.perf_counter() - t0):.0f} ms"
                        + (f" (skipped: {'; '.join(self.skipped)})" if self.skipped else "")
                    )
                    return step
                if ok:
                    self._skip(cand, "another rank could not load its shard of this step")
            remaining = [c for c in remaining if c.step < step]

    def _wait_for_smp(self, timeout_s: float = 300.0) -> None:
        """Under mecefo-launch the node's snapshot process may be rebuilding this node's
        snapshot from parity: wait until it reports ready."""
        if self.snapshot_dir is None or os.environ.get(SMP_ENV) != "1":
            return
        marker = Path(self.snapshot_dir) / "smp.ready"
        deadline = time.monotonic() + timeout_s
        while not marker.exists():
            if time.monotonic() > deadline:
                self.log(f"the snapshot process did not report ready in {timeout_s:.0f} s")
                return
            time.sleep(0.05)

    def _try(self, engine, ckpt: CheckpointManager, cand: Candidate) -> tuple[bool, str | None]:
        try:
            if cand.source == "disk":
                folder, listed = cand.found
                marker = layout.validate(folder)  # the marker again, and every file's checksum
                if marker != listed:
                    raise CheckpointError(f"{folder}: {layout.MARKER} changed since it was listed")
                ckpt.resume(engine, (folder, marker))
            else:
                state = self.pair.read_at(
                    cand.step,
                    verify=self.cfg.snapshot.verify_on_load,
                    check=self.identity.snapshot_mismatch,  # on the CRC-verified header
                    into=_model_tensors(engine),  # straight into the model: no copy between
                )
                body_step = train_state.next_step_of(state)
                if body_step != cand.step:
                    raise SnapshotCorruptError(
                        f"the header says step {cand.step}, the state it holds step {body_step}"
                    )
                _check_shapes(engine, state)
                train_state.load_state_dict(engine, state)
            return True, None
        except (SnapshotCorruptError, CheckpointError) as exc:
            return False, str(exc)

    def _skip(self, cand: Candidate, why: str) -> None:
        line = f"{cand.source} step {cand.step}: {why}"
        self.skipped.append(line)
        self.log(f"skipping {line}")

    def _rebuilt_step(self) -> int | None:
        marker = Path(self.snapshot_dir) / REBUILT_MARKER
        try:
            return int(json.loads(marker.read_text())["step"])
        except (OSError, ValueError, KeyError):
            return None


def _describe(cand: Candidate) -> str:
    return {
        "snapshot": f"this node's shared-memory snapshot ({cand.where})",
        "parity": f"a snapshot rebuilt from parity ({cand.where})",
        "disk": f"disk checkpoint {cand.where}",
    }[cand.source]


def _model_tensors(engine) -> dict[tuple, Any]:
    """The model's own tensors by their key path in a state dict (`("model", name)`): a
    snapshot's weights are copied straight into them. They are overwritten only after the slot
    verified, and a load that fails after that is followed by a full load or an error."""
    return {("model", name): t for name, t in engine.ddp.module.state_dict().items()}


def _check_shapes(engine, state: dict) -> None:
    """A snapshot of another model shape is an error with a clear message, not a crash."""
    current = engine.ddp.module.state_dict()
    for name, tensor in state["model"].items():
        have = current.get(name)
        if have is not None and hasattr(have, "shape") and tuple(have.shape) != tuple(tensor.shape):
            raise SnapshotCorruptError(
                f"snapshot tensor {name} has shape {tuple(tensor.shape)}, the model has "
                f"{tuple(have.shape)} (written by a different model config)"
            )
