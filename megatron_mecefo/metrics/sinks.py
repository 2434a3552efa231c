"""Metric sinks: JSONL (always), TensorBoard and W&B (optional, imported lazily).

A sink receives one flat dict of scalars per logged step, and failover events (events.jsonl
lines, read by `EventTail`) through `write_event`: TensorBoard and W&B chart them next to the
metrics; metrics.jsonl does not repeat them. Sinks never raise on a logging hiccup after start-up;
a missing optional package is a clear `ConfigError` at start-up instead.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

from megatron_mecefo.errors import ConfigError


class MetricSink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...
    def write_event(self, event: dict[str, Any], step: int) -> None: ...
    def close(self) -> None: ...


class EventTail:
    """New lines of `events.jsonl` since the last call (the coordinator appends to it; this file
    is read, never written, here). A partial last line waits for the next call."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._offset = 0

    def read_new(self) -> list[dict[str, Any]]:
        try:
            if self.path.stat().st_size <= self._offset:
                return []
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                chunk = fh.read()
        except OSError:
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        events = []
        for line in complete.decode(errors="replace").splitlines():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and "type" in obj:
                events.append(obj)
        return events


def event_scalars(event: dict[str, Any]) -> dict[str, float]:
    """Chart values of one event: `failover/<type>` = its latency in ms, or 1 (a tick)."""
    latency = event.get("latency_ms")
    value = float(latency) if isinstance(latency, (int, float)) else 1.0
    return {f"failover/{event['type']}": value}


def event_text(event: dict[str, Any]) -> str:
    parts = [f"{event['type']} at step {event.get('step')}"]
    if event.get("dp_rank") is not None:
        parts.append(f"replica {event['dp_rank']}")
    if event.get("latency_ms") is not None:
        parts.append(f"{event['latency_ms']:.0f} ms")
    if event.get("detail"):
        parts.append(str(event["detail"]))
    return ", ".join(parts)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible as strings
    return value


class JsonlSink:
    """Append one JSON object per line; flushed each write so a crash loses nothing logged."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps({k: _json_safe(v) for k, v in record.items()}) + "\n")

    def write_event(self, event: dict[str, Any], step: int) -> None:
        pass  # events.jsonl is the record of events; metrics.jsonl does not repeat them

    def close(self) -> None:
        self._fh.close()


class TensorBoardSink:
    """Scalars under `log_dir`; the record's `step` is the global step."""

    def __init__(self, log_dir: str | os.PathLike):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "logging.tensorboard=true needs the tensorboard package: "
                "pip install 'megatron-mecefo[tensorboard]'"
            ) from None
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, step)

    def write_event(self, event: dict[str, Any], step: int) -> None:
        for key, value in event_scalars(event).items():
            self._writer.add_scalar(key, value, step)
        self._writer.add_text("failover/events", event_text(event), step)

    def close(self) -> None:
        self._writer.close()


def wandb_run_id(run_dir: str | os.PathLike, explicit: str | None = None) -> str:
    """A W&B run id that stays the same for the same run: the explicit one, else the run's id
    from `identity.json` (kept across restarts, requeues and resumes of this run dir; a new run
    in the same dir gets a new one), else a hash of the run dir's absolute path."""
    if explicit:
        return explicit
    try:
        run_id = json.loads((Path(run_dir) / "identity.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        run_id = None
    if run_id:
        return f"mecefo-{run_id}"
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return f"mecefo-{digest}"


class WandbSink:
    """Weights & Biases run (offline by default) with a stable id and `resume="allow"`: a
    requeued or resumed job (or a new leader after a failover) continues the same W&B run."""

    def __init__(
        self,
        *,
        project: str,
        mode: str,
        run_dir: str,
        config: dict[str, Any],
        run_id: str | None = None,
    ):
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "logging.wandb=true needs the wandb package: pip install 'megatron-mecefo[wandb]'"
            ) from None
        self.run_id = wandb_run_id(run_dir, run_id)
        self._run = wandb.init(
            project=project,
            mode=mode,
            dir=run_dir,
            config=config,
            id=self.run_id,
            resume="allow",
            name=Path(run_dir).name,
        )

    def write(self, record: dict[str, Any]) -> None:
        self._run.log({k: v for k, v in record.items() if k != "step"}, step=int(record["step"]))

    def write_event(self, event: dict[str, Any], step: int) -> None:
        values: dict[str, Any] = dict(event_scalars(event))
        values["failover/event"] = event_text(event)
        self._run.log(values, step=step, commit=False)  # committed with the step's metrics

    def close(self) -> None:
        self._run.finish()
