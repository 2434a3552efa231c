"""Where metrics go (JSONL always; TensorBoard and W&B optional)."""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(kw_only=True)
class LoggingConfig:
    """Metric sinks and console output (rank 0 only)."""

    log_interval: int = 1
    """Write a metrics.jsonl record every this many steps."""
    progress_bar: bool = True
    """tqdm progress bar with loss and tokens/s on rank 0 (auto-off when stderr is not a TTY)."""
    print_interval: int = 25
    """Also print a plain log line every this many steps (for logs without a TTY); 0 disables."""
    tensorboard: bool = False
    """Write TensorBoard scalars under run_dir/tensorboard (needs the `tensorboard` extra)."""
    wandb: bool = False
    """Log to Weights & Biases (needs the `wandb` extra)."""
    wandb_project: str = "megatron-mecefo"
    """W&B project."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """W&B mode; offline unless configured (sync later with `wandb sync`)."""
    wandb_run_id: str | None = None
    """W&B run id; None: derived from the run's id in run_dir/identity.json, so that a requeued,
    resumed or failed-over job continues the same W&B run (resume="allow")."""

    def __post_init__(self) -> None:
        if self.log_interval < 1 or self.print_interval < 0:
            raise ValueError("log_interval must be >= 1 and print_interval >= 0")
