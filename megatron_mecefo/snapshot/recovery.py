"""The recovery order: load the newest valid state among {own snapshot, parity rebuild, disk}.

A rank that starts without a live peer to copy from (a fresh job start, or every replica lost at
once) asks `Recovery`. It lists the candidates from headers and commit markers only, newest
first (a snapshot before a disk checkpoint of the same step: no disk I/O), then loads the first
that verifies. The TP ranks of a replica agree on each candidate (same step, every shard loaded)
before using it. Each skipped candidate is logged with a one-line reason; nothing corrupt is ever
loaded. A snapshot the node's snapshot process rebuilt from parity says so in a marker file.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_mecefo.checkpoint.manager import CheckpointManager, find_resume
from megatron_mecefo.errors import CheckpointError, SnapshotCorruptError
from megatron_mecefo.snapshot.paths import SMP_ENV
from megatron_mecefo.snapshot.slots import SlotPair
from megatron_mecefo.training import state as train_state

REBUILT_MARKER = "rebuilt.json"
"""Written by the snapshot process into a node folder it rebuilt from parity: {"step": S, ...}."""


@dataclass(frozen=True)
class Candidate:
    source: str  # "snapshot" | "parity" | "disk"
    step: int
    where: str
    found: Any = None  # for disk: (folder, marker) from layout.validate


class Recovery:
    """The recovery order for one rank; `agree` reduces a value over the replica's TP ranks."""

    def __init__(
        self,
        cfg,
        *,
        rank: int,
        snapshot_dir: Path | None,
        agree_min: Callable[[int], int] = lambda x: x,
        log: Callable[[str], None] = print,
    ):
        self.cfg = cfg
        self.rank = rank
        self.pair = SlotPair(snapshot_dir, rank) if snapshot_dir is not None else None
        self.snapshot_dir = snapshot_dir
        self.agree_min = agree_min
        self.log = log
        self.used: Candidate | None = None
        self.skipped: list[str] = []
        self._listed: list[Candidate] | None = None

    def candidates(self) -> list[Candidate]:
        """Newest first; at equal steps, memory before disk. Reads headers and markers only
        (and validates the disk checkpoint's checksums). Listed once: the next `load` uses
        this list, so a start that asks first does not hash the checkpoint twice."""
        if self._listed is None:
            self._listed = self._list()
        return self._listed

    def _list(self) -> list[Candidate]:
        found: list[Candidate] = []
        if self.cfg.checkpoint.resume == "never":
            return found
        self._wait_for_smp()
        if self.pair is not None and self.cfg.checkpoint.resume == "auto":
            rebuilt = self._rebuilt_step()
            for step in sorted(self.pair.clean_steps(), reverse=True):
                source = "parity" if step == rebuilt else "snapshot"
                found.append(Candidate(source, step, str(self.snapshot_dir)))
        disk = find_resume(self.cfg.checkpoint, self.cfg.run_dir, self.log)
        if disk is not None:
            found.append(Candidate("disk", int(disk[1]["next_step"]), str(disk[0]), disk))
        return sorted(found, key=lambda c: (-c.step, c.source == "disk"))

    def load(self, engine, ckpt: CheckpointManager) -> int | None:
        """Load the newest state every rank of the `agree_min` group can load; returns its next
        step, or None when no rank has any state (a fresh start).

        All ranks run the same rounds: they agree on the newest step s anyone might still load
        (the minimum of each rank's best), each loads its own candidate of step s, and if any
        rank failed they all drop every candidate >= s and go on. So TP shards (or, without
        failover, all replicas) always end on one step.

        Raises:
            CheckpointError: some rank has state but no step could be loaded by all of them.
        """
        remaining = self.candidates()
        self._listed = None  # a later load lists again (state may have been written since)
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
                ckpt.resume(engine, cand.found)
            else:
                state = self.pair.read_at(cand.step, verify=self.cfg.snapshot.verify_on_load)
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


def agree_min_over_default_group(device) -> Callable[[int], int]:
    """`agree_min` over the default process group (identity when it has one rank)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return lambda x: x

    def agree(value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)  # every rank of the group calls this in order
        return int(t.item())

    return agree
