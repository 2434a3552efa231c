"""The `events.jsonl` schema written by real runs, and its replay as a simulator trace.

One JSON object per line. Required fields:
  type     one of failure, detection, regroup, takeover, rejoin, restart, checkpoint
  step     training step at which the event happened (int >= 0)
  dp_rank  DP rank concerned (int >= 0), or null for job-wide events (restart, checkpoint)
  time_s   seconds since the run started (float >= 0)
Optional: generation (int), latency_s (float), detail (str); other keys are kept but ignored.
Only failure and rejoin events shape the replayed trace; the rest are reported as measured
latencies.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_mecefo.errors import ConfigError
from megatron_mecefo.sim.failures import FailureTrace

EVENT_TYPES = ("failure", "detection", "regroup", "takeover", "rejoin", "restart", "checkpoint")


@dataclass(kw_only=True)
class Event:
    """One line of events.jsonl."""

    type: str
    """Event type (see EVENT_TYPES)."""
    step: int
    """Training step."""
    dp_rank: int | None
    """DP rank concerned, or None for job-wide events."""
    time_s: float
    """Seconds since the run started."""
    extra: dict = field(default_factory=dict)
    """Other fields (generation, latency_s, detail, ...)."""


def _parse_line(text: str, where: str) -> Event:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: each line must be a JSON object")
    missing = [k for k in ("type", "step", "dp_rank", "time_s") if k not in obj]
    if missing:
        raise ConfigError(f"{where}: missing field(s) {', '.join(missing)}")
    kind, step, rank, time_s = (
        obj.pop("type"),
        obj.pop("step"),
        obj.pop("dp_rank"),
        obj.pop("time_s"),
    )
    if kind not in EVENT_TYPES:
        raise ConfigError(f"{where}: unknown type {kind!r} (allowed: {', '.join(EVENT_TYPES)})")
    if not isinstance(step, int) or step < 0:
        raise ConfigError(f"{where}: step must be an integer >= 0, got {step!r}")
    if rank is not None and (not isinstance(rank, int) or rank < 0):
        raise ConfigError(f"{where}: dp_rank must be an integer >= 0 or null, got {rank!r}")
    if not isinstance(time_s, (int, float)) or time_s < 0:
        raise ConfigError(f"{where}: time_s must be a number >= 0, got {time_s!r}")
    if kind in ("failure", "rejoin") and rank is None:
        raise ConfigError(f"{where}: a {kind} event needs a dp_rank")
    return Event(type=kind, step=step, dp_rank=rank, time_s=float(time_s), extra=obj)


def read_events(path: str | os.PathLike) -> list[Event]:
    """Parse and validate an events.jsonl file (blank lines are skipped)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"events file not found: {p}")
    events = []
    for n, line in enumerate(p.read_text().splitlines(), start=1):
        if line.strip():
            events.append(_parse_line(line, f"{p}:{n}"))
    return sorted(events, key=lambda e: e.time_s)


def events_to_trace(events: list[Event], *, horizon_s: float = math.inf) -> FailureTrace:
    """Failures of the run as a trace; a failure's repair time is until that rank's next rejoin."""
    times, groups, repairs = [], [], []
    for i, ev in enumerate(events):
        if ev.type != "failure":
            continue
        rejoin = next(
            (e.time_s for e in events[i + 1 :] if e.type == "rejoin" and e.dp_rank == ev.dp_rank),
            math.inf,
        )
        times.append(ev.time_s)
        groups.append(ev.dp_rank)
        repairs.append(rejoin - ev.time_s)
    return FailureTrace(
        times_s=np.array(times, dtype=float),
        groups=np.array(groups, dtype=np.int64),
        repair_s=np.array(repairs, dtype=float),
        horizon_s=horizon_s,
    )


def measured_latencies(events: list[Event]) -> dict[str, float]:
    """Mean failure->detection and failure->regroup latencies (s) observed in the run."""
    out: dict[str, list[float]] = {"detection_s": [], "regroup_s": []}
    for i, ev in enumerate(events):
        if ev.type != "failure":
            continue
        for kind, key in (("detection", "detection_s"), ("regroup", "regroup_s")):
            nxt = next((e for e in events[i + 1 :] if e.type == kind), None)
            if nxt is not None:
                out[key].append(nxt.time_s - ev.time_s)
    return {k: float(np.mean(v)) for k, v in out.items() if v}
