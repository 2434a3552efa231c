"""The snapshot hook: after every `snapshot.interval`-th committed step, copy this rank's training
state into its next shared-memory slot in a background thread.

The state tensors (parameters, optimizer moments) are not modified until the next optimizer
update, so the copy overlaps the next step's forward and backward; `Engine.before_update` waits
for it (the torchtitan staging pattern). The RNG states and the small non-tensor parts are taken
synchronously at the save point. The CRC and the "clean" mark follow in the same thread and do
not block training. Every slot header records the run's identity (run id, config hash, lineage).
This module does not load snapshots (`recovery`).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from megatron_mecefo.config.snapshot import SnapshotConfig
from megatron_mecefo.snapshot.slots import HEADER, SlotPair, plan_layout
from megatron_mecefo.training import state as train_state
from megatron_mecefo.training.hooks import TrainHook
from megatron_mecefo.training.identity import StateIdentity


class SnapshotHook(TrainHook):
    """Writes snapshots of one rank; every method is a no-op when `cfg.interval` is 0."""

    def __init__(
        self,
        cfg: SnapshotConfig,
        directory: Path | None,
        rank: int,
        *,
        max_steps: int,
        log,
        identity: StateIdentity | None = None,
    ):
        self.cfg = cfg
        self.meta = identity.slot_meta() if identity is not None else {}
        """What each slot header records (a snapshot without an identity is never resumed)."""
        self.rank = rank
        self.max_steps = max_steps
        self.log = log
        if cfg.enabled and directory is None:
            raise ValueError("snapshots are enabled but no snapshot directory was given")
        self.pair = SlotPair(directory, rank) if cfg.enabled else None
        self._staged = threading.Event()
        self._staged.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.stats: dict[str, Any] = {
            "saved": 0,
            "bytes": 0,
            "last_step": None,
            "copy_s": [],
            "blocked_s": 0.0,
            "failed": 0,
        }

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled

    def attach(self, engine) -> None:
        if self.enabled:
            engine.before_update.append(self.wait_staged)

    # ------------------------------------------------------------------ hook
    def after_step(self, engine, result, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        next_step = result.step + 1
        last = next_step == self.max_steps or record.get("stop_requested")
        if next_step % self.cfg.interval == 0 or last:
            self.save(engine, next_step)
            if last:
                self.wait_done()

    def on_train_end(self, engine, summary: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.wait_done()
        copies = self.stats["copy_s"]
        summary["snapshot"] = {
            "saved": self.stats["saved"],
            "failed": self.stats["failed"],
            "last_step": self.stats["last_step"],
            "bytes": self.stats["bytes"],
            "mean_copy_ms": 1000 * sum(copies) / len(copies) if copies else None,
            "blocked_s": self.stats["blocked_s"],
        }
        self.pair.close()

    # ------------------------------------------------------------------ save
    def save(self, engine, next_step: int) -> None:
        """Start the snapshot of `next_step` (waits for the previous one to finish first).

        Only the state dict (references to the live tensors, RNG states copied) is taken here;
        the layout, the copy and the CRC run in the background thread."""
        self.wait_done()
        state = train_state.state_dict(engine, next_step)
        self._staged.clear()

        def copy_and_seal() -> None:
            try:
                t0 = time.perf_counter()
                skeleton, refs, tensors, payload = plan_layout(state)
                slot = self.pair.target(self.meta)
                slot.begin(next_step, skeleton, refs, payload, self.meta)
                base = HEADER + len(skeleton)
                for ref, tensor in zip(refs, tensors):
                    slot.copy_tensor(base + ref.offset, tensor)
                self.stats["copy_s"].append(time.perf_counter() - t0)
                self._staged.set()
                slot.seal()
                self.stats["saved"] += 1
                self.stats["bytes"] = payload + len(skeleton)
                self.stats["last_step"] = next_step
            except BaseException as exc:  # noqa: BLE001 - reported at the next wait
                self._error = exc  # e.g. ENOSPC: /dev/shm is full (the slot stays dirty)
                self._staged.set()

        self._thread = threading.Thread(target=copy_and_seal, name="mecefo-snapshot", daemon=True)
        self._thread.start()

    def wait_staged(self) -> None:
        """Block until the running copy no longer reads the live state (before an update)."""
        if not self._staged.is_set():
            t0 = time.perf_counter()
            self._staged.wait()
            self.stats["blocked_s"] += time.perf_counter() - t0

    def wait_done(self) -> None:
        if self._thread is not None:
            self.wait_staged()
            self._thread.join()
            self._thread = None
        if self._error is not None:
            exc, self._error = self._error, None
            self.stats["failed"] += 1
            self.log(f"warning: a snapshot failed ({exc}); training goes on")
