"""Rank-0 metrics logger: fans per-step records out to the sinks and drives the progress bar.

`metrics.jsonl` holds one object per logged step. Failure-handling events are not logged here:
`events.jsonl` is written by a separate process through
`megatron_mecefo.metrics.events.EventWriter`, which owns that schema (the simulator replays it);
with TensorBoard or W&B on, the writing rank forwards its new lines to them (`sinks.EventTail`).
The printed step line: step, loss, lr, grad norm, ms/iter, tokens/s, memory, replicas alive and
degraded micro-batches (the last two under failover).
"""

from __future__ import annotations

import json
import resource
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_mecefo.metrics.config import LoggingConfig
from megatron_mecefo.metrics.sinks import (
    EventTail,
    JsonlSink,
    MetricSink,
    TensorBoardSink,
    WandbSink,
)


class MetricsLogger:
    """Collects per-step metrics on rank 0. On other ranks every method is a no-op.

    Under failover the writing rank changes when the leader dies: every candidate gets a logger
    with `writer` (is this process the leader now?); sinks open, in append mode, on the first
    record it writes.
    """

    def __init__(
        self,
        cfg: LoggingConfig,
        run_dir: str | Path,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int = 0,
        run_config: dict[str, Any] | None = None,
        writer: Callable[[], bool] | None = None,
    ):
        self.cfg = cfg
        self._enabled = enabled
        self._writer = writer
        self.run_dir = Path(run_dir)
        self._sinks: list[MetricSink] = []
        self._bar = None
        self._opened = False
        self._run_config = run_config
        self._events: EventTail | None = None
        self._held: dict[str, Any] | None = None  # last record seen while not the writer
        # events of earlier steps were forwarded by an earlier try (plain runs: before the step
        # this run starts at) or by an earlier leader (failover: before this writer's first step)
        self._event_floor: int | None = start_step if writer is None else None
        if enabled and writer is None:
            self._open_sinks()
            if cfg.progress_bar and sys.stderr.isatty():
                from tqdm import tqdm

                self._bar = tqdm(
                    total=total_steps, initial=start_step, unit="step", dynamic_ncols=True
                )

    @property
    def enabled(self) -> bool:
        """Whether this process writes now."""
        active = self._enabled and (self._writer is None or self._writer())
        if active and not self._opened:
            self._open_sinks()
        return active

    def _open_sinks(self) -> None:
        cfg, run_config = self.cfg, self._run_config
        self._opened = True
        self._sinks.append(JsonlSink(self.run_dir / "metrics.jsonl"))
        if cfg.tensorboard:
            self._sinks.append(TensorBoardSink(self.run_dir / "tensorboard"))
        if cfg.wandb:
            self._sinks.append(
                WandbSink(
                    project=cfg.wandb_project,
                    mode=cfg.wandb_mode,
                    run_dir=str(self.run_dir),
                    config=run_config or {},
                    run_id=cfg.wandb_run_id,
                )
            )
        if cfg.tensorboard or cfg.wandb:
            self._events = EventTail(self.run_dir / "events.jsonl")

    def log_step(self, record: dict[str, Any]) -> None:
        """Record one step (`step` key required)."""
        if not self.enabled:
            if self._enabled:  # a candidate keeps its last record (every member has the same)
                self._held = record
            return
        if self._held is not None:  # just took over: the old leader may have died before
            self._backfill(self._held, int(record["step"]))  # writing the step before this one
            self._held = None
        step = int(record["step"])
        if self._event_floor is None:
            self._event_floor = step
        self._forward_events(step)
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
            self.print(_format_line(record, memory_in_use()))

    def _backfill(self, held: dict[str, Any], step: int) -> None:
        """Write `held` (this rank's copy of the previous step) if metrics.jsonl stops short of
        it: the leader that died after the step committed never logged it."""
        if not held["step"] < step or held["step"] % self.cfg.log_interval:
            return
        if last_logged_step(self.run_dir / "metrics.jsonl") < held["step"]:
            for sink in self._sinks:
                sink.write(held)

    def _forward_events(self, step: int) -> None:
        """New events.jsonl lines to the sinks (not those before `_event_floor`)."""
        if self._events is None:
            return
        for event in self._events.read_new():
            if int(event.get("step", step)) < (self._event_floor or 0):
                continue
            for sink in self._sinks:
                sink.write_event(event, step)

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
        self._sinks, self._bar = [], None


def _format_line(record: dict[str, Any], memory: str | None = None) -> str:
    """`step 10 | loss 5.9325 | lr 1.10e-03 | gnorm 0.943 | 54.2 ms/iter | 37910 tok/s |
    mem 0.4 GiB rss | replicas 4 | degraded 0` (mfu when known; replicas under failover).
    `launch/slurm/pretrain.sbatch` reads "ms/iter" to time its stop before the limit."""
    parts = [f"step {record['step']:>6}", f"loss {record['loss']:.4f}"]
    if "val_loss" in record:
        parts.append(f"val_loss {record['val_loss']:.4f}")
    parts += [
        f"lr {record['lr']:.2e}",
        f"gnorm {record['grad_norm']:.3f}",
    ]
    if record.get("step_time_s") is not None:
        parts.append(f"{1000 * record['step_time_s']:.1f} ms/iter")
    parts.append(f"{record['tokens_per_s']:.0f} tok/s")
    if record.get("mfu") is not None:
        parts.append(f"mfu {100 * record['mfu']:.1f}%")
    if memory:
        parts.append(f"mem {memory}")
    if record.get("replicas_alive") is not None:
        parts.append(f"replicas {record['replicas_alive']}")
    parts.append(f"degraded {record.get('degraded_microbatches', 0)}")
    return " | ".join(parts)


def memory_in_use() -> str:
    """Peak GPU memory allocated by this process when CUDA is in use, else its peak RSS."""
    torch = sys.modules.get("torch")  # never import torch just to log
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return f"{rss_kib / 2**20:.1f} GiB rss"


def last_logged_step(path: Path) -> int:
    """The step of the last complete row of a metrics file (-1 if none); rows are appended in
    step order, so it is the highest step logged."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - 65536))
            lines = fh.read().splitlines()
    except OSError:
        return -1
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return -1
