"""Rank-0 metrics logger: fans records out to the sinks, drives the progress bar, and the event log.

`metrics.jsonl` holds one object per logged step; `events.jsonl` one object per failure-handling
event (the failover manager of a later stage writes those; the simulator replays them).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from megatron_mecefo.metrics.config import LoggingConfig
from megatron_mecefo.metrics.sinks import JsonlSink, MetricSink, TensorBoardSink, WandbSink


class MetricsLogger:
    """Collects per-step metrics on rank 0. On other ranks every method is a no-op."""

    def __init__(
        self,
        cfg: LoggingConfig,
        run_dir: str | Path,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int = 0,
        run_config: dict[str, Any] | None = None,
    ):
        self.cfg = cfg
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._sinks: list[MetricSink] = []
        self._events: JsonlSink | None = None
        self._bar = None
        if not enabled:
            return
        self._sinks.append(JsonlSink(self.run_dir / "metrics.jsonl"))
        self._events = JsonlSink(self.run_dir / "events.jsonl")
        if cfg.tensorboard:
            self._sinks.append(TensorBoardSink(self.run_dir / "tensorboard"))
        if cfg.wandb:
            self._sinks.append(
                WandbSink(
                    project=cfg.wandb_project,
                    mode=cfg.wandb_mode,
                    run_dir=str(self.run_dir),
                    config=run_config or {},
                )
            )
        if cfg.progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def log_step(self, record: dict[str, Any]) -> None:
        """Record one step (`step` key required)."""
        if not self.enabled:
            return
        step = int(record["step"])
        if step % self.cfg.log_interval == 0 or "val_loss" in record:
            for sink in self._sinks:
                sink.write(record)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(
                loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}"
            )
        elif self.cfg.print_interval and (
            step % self.cfg.print_interval == 0 or "val_loss" in record
        ):
            self.print(_format_line(record))

    def log_event(self, event_type: str, **fields: Any) -> None:
        """Append a failure-handling event (`type`, `time_s` added) to events.jsonl."""
        if self._events is not None:
            self._events.write({"type": event_type, "time_s": time.time(), **fields})

    def print(self, line: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        for sink in self._sinks:
            sink.close()
        if self._events is not None:
            self._events.close()
        self._sinks, self._events, self._bar = [], None, None


def _format_line(record: dict[str, Any]) -> str:
    parts = [f"step {record['step']:>6}", f"loss {record['loss']:.4f}"]
    if "val_loss" in record:
        parts.append(f"val_loss {record['val_loss']:.4f}")
    parts += [
        f"lr {record['lr']:.2e}",
        f"gnorm {record['grad_norm']:.3f}",
        f"{record['tokens_per_s']:.0f} tok/s",
    ]
    if record.get("mfu") is not None:
        parts.append(f"mfu {100 * record['mfu']:.1f}%")
    return " | ".join(parts)
