"""Disk-checkpoint settings of `checkpoint/` (pure dataclass; here, below `checkpoint/`, so that
`config.run` composes it without an upward import)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    """When and where `dist_checkpointing` checkpoints are written, and whether a run resumes."""

    dir: str | None = None
    """Checkpoint root; null = `<run_dir>/checkpoints`."""
    interval: int = 0
    """Save every this many steps (and after the last step); 0 = never save."""
    keep_latest: int = 2
    """Committed checkpoints kept; older ones (and abandoned partial folders) are deleted."""
    async_save: bool = True
    """Write in background processes while training goes on; the commit marker is written once
    every rank's files are on disk."""
    resume: str = "auto"
    """auto: continue from the newest valid checkpoint under `dir` if there is one; never: start
    fresh; or the path of one step folder to load."""

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError(f"checkpoint.interval must be >= 0 steps, got {self.interval}")
        if self.keep_latest < 1:
            raise ValueError(f"checkpoint.keep_latest must be >= 1, got {self.keep_latest}")
        if not self.resume:
            raise ValueError("checkpoint.resume must be auto, never or a checkpoint folder")
