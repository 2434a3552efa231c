"""The checkpoint hook: resume at start, save every `interval` steps (async), commit, prune.

A failed save never stops training: it is reported and the next interval tries again. A folder
whose save did not complete (no commit marker) or whose files fail their checksums is never
loaded; `resume: auto` falls back to the next older valid checkpoint and says why.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_mecefo.checkpoint import layout
from megatron_mecefo.checkpoint.config import CheckpointConfig
from megatron_mecefo.errors import CheckpointError
from megatron_mecefo.training.hooks import TrainHook


def checkpoint_root(cfg: CheckpointConfig, run_dir: str) -> Path:
    return Path(cfg.dir) if cfg.dir else Path(run_dir) / "checkpoints"


def find_resume(cfg: CheckpointConfig, run_dir: str, log=None) -> tuple[Path, dict] | None:
    """The checkpoint `cfg.resume` selects (None: start fresh).

    Raises:
        CheckpointError: `resume` names a folder that is not a valid checkpoint.
    """
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        return layout.newest_valid(checkpoint_root(cfg, run_dir), log)
    folder = Path(cfg.resume)
    return folder, layout.validate(folder)


class CheckpointManager(TrainHook):
    """Saves from the ranks `saves_here()` selects (all ranks of the default process group of the
    saving replica), at the same loop points on each of them."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir: str,
        *,
        max_steps: int,
        tp_size: int,
        saves_here: Callable[[], bool] = lambda: True,
        log: Callable[[str], None] = print,
    ):
        self.cfg = cfg
        self.root = checkpoint_root(cfg, run_dir)
        self.max_steps = max_steps
        self.tp_size = tp_size
        self.saves_here = saves_here
        self.log = log
        self._saves = None
        self.stats: dict[str, Any] = {"saved": [], "failed": 0, "save_block_s": [], "resumed": None}

    @property
    def enabled(self) -> bool:
        return self.cfg.interval > 0

    # ------------------------------------------------------------------ resume
    def resume(self, engine, found: tuple[Path, dict] | None) -> int:
        """Load `found` (from `find_resume`: validated once, before the engine was built);
        returns the next step to run (0 when there is nothing to resume)."""
        from megatron_mecefo.mcore import checkpointing

        if found is None:
            return 0
        folder, marker = found
        same_tp = marker.get("tp") == self.tp_size
        if not same_tp:
            self.log(
                f"checkpoint {folder.name} was written with TP={marker.get('tp')}, this run has "
                f"TP={self.tp_size}: weights and optimizer are resharded, RNG states start fresh"
            )
        try:
            next_step = checkpointing.load(engine, str(folder), with_rng=same_tp)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            raise CheckpointError(f"cannot load {folder}: {_last_line(exc)}") from exc
        self.stats["resumed"] = {"folder": str(folder), "next_step": next_step}
        self.log(f"resumed from {folder} at step {next_step}")
        return next_step

    # ------------------------------------------------------------------ hook
    def after_step(self, engine, result, record: dict[str, Any]) -> None:
        next_step = result.step + 1
        if record.get("stop_requested"):  # the final checkpoint of a stop, even with interval 0
            self.save(engine, next_step)
            return
        if not self.enabled:
            return
        self._poll(blocking=False)
        if next_step % self.cfg.interval == 0 or next_step == self.max_steps:
            self.save(engine, next_step)

    def on_train_end(self, engine, summary: dict[str, Any]) -> None:
        self._poll(blocking=True)
        if self._saves is not None:
            self._saves.close()
            self._saves = None
        summary["checkpoint"] = {
            "saved_steps": self.stats["saved"],
            "failed_saves": self.stats["failed"],
            "resumed": self.stats["resumed"],
            "mean_save_block_s": (
                sum(self.stats["save_block_s"]) / len(self.stats["save_block_s"])
                if self.stats["save_block_s"]
                else None
            ),
        }

    # ------------------------------------------------------------------ save
    def save(self, engine, next_step: int) -> None:
        """Write the checkpoint `step_<next_step>` (async when configured)."""
        from megatron_mecefo.mcore import checkpointing

        if not self.saves_here():
            return
        folder = layout.step_dir(self.root, next_step)
        start = time.perf_counter()
        try:
            if checkpointing.default_group_rank() == 0:
                folder.mkdir(parents=True, exist_ok=True)
            checkpointing.barrier()
            request = checkpointing.save(
                engine, str(folder), next_step, async_save=self.cfg.async_save
            )
        except Exception as exc:  # noqa: BLE001 - a failed save must not stop training
            self.stats["failed"] += 1
            self.log(f"warning: checkpoint at step {next_step} failed ({exc}); training goes on")
            return
        self.stats["save_block_s"].append(time.perf_counter() - start)
        if request is None:
            checkpointing.barrier()
            self._commit(folder, next_step, start)
        else:
            if self._saves is None:
                self._saves = checkpointing.AsyncSaves()
            self._saves.schedule(request, lambda: self._commit(folder, next_step, start))

    def _commit(self, folder: Path, next_step: int, start: float) -> None:
        from megatron_mecefo.mcore import checkpointing

        if checkpointing.default_group_rank() != 0:
            return
        layout.write_marker(folder, next_step, {"tp": self.tp_size, "epoch_s": time.time()})
        removed = layout.prune(self.root, self.cfg.keep_latest)
        self.stats["saved"].append(next_step)
        self.log(
            f"checkpoint {folder.name} committed ({time.perf_counter() - start:.1f} s"
            f"{', pruned ' + ', '.join(p.name for p in removed) if removed else ''})"
        )

    def _poll(self, *, blocking: bool) -> None:
        if self._saves is None:
            return
        try:
            self._saves.poll(blocking=blocking)
        except Exception as exc:  # noqa: BLE001 - a failed write is reported, never fatal
            self.stats["failed"] += 1
            self.log(f"warning: an async checkpoint write failed ({exc}); training goes on")


def _last_line(exc: BaseException) -> str:
    """The innermost one-line reason (torch wraps megatron's error in a multi-line report)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]
