"""Metric sinks: JSONL (always), TensorBoard and W&B (optional, imported lazily).

A sink receives one flat dict of scalars per logged step. Sinks never raise on a logging hiccup
after start-up; a missing optional package is a clear `ConfigError` at start-up instead.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

from megatron_mecefo.errors import ConfigError


class MetricSink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


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

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Weights & Biases run (offline by default)."""

    def __init__(self, *, project: str, mode: str, run_dir: str, config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "logging.wandb=true needs the wandb package: pip install 'megatron-mecefo[wandb]'"
            ) from None
        self._run = wandb.init(project=project, mode=mode, dir=run_dir, config=config)

    def write(self, record: dict[str, Any]) -> None:
        self._run.log({k: v for k, v in record.items() if k != "step"}, step=int(record["step"]))

    def close(self) -> None:
        self._run.finish()
