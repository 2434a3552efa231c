"""The `events.jsonl` schema: one `Event` type, its writer and its reader.

The process that handles failures writes `run_dir/events.jsonl` through `EventWriter`; the
simulator (`mecefo-sim replay`, `megatron_mecefo.sim.events`) reads it back with `read_events`.
One JSON object per line. Required fields:
  type        one of failure, detection, regroup, takeover, rejoin, restart, checkpoint, abort,
              recovery (a rank loaded saved state; extra `load_ms`: finding, reading and
              installing it), coordinator_restart, node_lost, node_replaced, step_redone (a step
              attempt the members voted not to commit: it is redone under the next plan; one
              per aborted attempt, `generation` = the attempt's, extra `attempt`), shard_adopt,
              rollback, and the numerical faults (`failover/trainer/rerun.py`): anomaly (a
              replica's NaN/Inf, `detail` says what), rerun, classified (extra `kind`: transient,
              data, persistent or corruption; data names `microbatches`, `samples`,
              `samples_skipped`), evicted (a straggler's node: extra `standby`, the agent it went
              to), healed (a corrupt replica committed again with a
              healthy peer's state), rebalanced (a straggler's share changed,
              `failover/trainer/straggler.py`)
  step        training step at which the event happened (int >= 0)
  dp_rank     DP rank concerned (int >= 0), or null for job-wide events (restart, checkpoint, ...);
              failure and rejoin events always name one
  time_s      seconds since the run started (float >= 0; `EventWriter` converts epoch times)
Optional (left out of the line when unset):
  generation  process-group generation after the event (int >= 0)
  latency_ms  latency the event measured, in milliseconds (number >= 0); on a detection or regroup
              event it is the time from the failure it answers (the simulator prefers it to the
              difference of `time_s`)
  ranks       global ranks concerned (list of int >= 0)
  detail      free text (e.g. "SIGKILL", "neighbor covers rank 2")
Any other key is kept in `Event.extra` and written back unchanged.

No torch or numpy here: the writer runs in a light process and the reader in the simulator.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_mecefo.errors import ConfigError

EVENT_TYPES = (
    "failure",
    "detection",
    "regroup",
    "takeover",
    "rejoin",
    "restart",
    "checkpoint",
    "abort",
    "recovery",
    "coordinator_restart",
    "node_lost",
    "node_replaced",
    "step_redone",
    "shard_adopt",
    "rollback",
    "anomaly",
    "rerun",
    "classified",
    "evicted",
    "healed",
    "rebalanced",
)

_REQUIRED = ("type", "step", "dp_rank", "time_s")
_OPTIONAL = ("generation", "latency_ms", "ranks", "detail")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float))


@dataclass(kw_only=True)
class Event:
    """One line of events.jsonl."""

    type: str
    """Event type, one of EVENT_TYPES."""
    step: int
    """Training step at which the event happened (>= 0)."""
    dp_rank: int | None
    """DP rank concerned, or None for job-wide events (failure and rejoin always name one)."""
    time_s: float
    """Seconds since the run started (>= 0), not an epoch time."""
    generation: int | None = None
    """Process-group generation after the event (>= 0), if the writer knows it."""
    latency_ms: float | None = None
    """Latency the event measured, in milliseconds (>= 0); for detection and regroup events the
    time from the failure they answer."""
    ranks: list[int] | None = None
    """Global ranks concerned (e.g. the ranks of the failed DP replica), if known."""
    detail: str = ""
    """Free text for humans (e.g. the signal that killed the rank)."""
    extra: dict = field(default_factory=dict)
    """Any other keys of the line; kept and written back unchanged."""

    def __post_init__(self) -> None:
        clash = sorted(set(self.extra) & set(_REQUIRED + _OPTIONAL))
        if clash:
            raise ValueError(f"Event.extra must not hold schema field(s) {', '.join(clash)}")

    def to_json(self) -> dict[str, Any]:
        """The line as a JSON object: required fields, the optionals that are set, then `extra`."""
        out: dict[str, Any] = {
            "type": self.type,
            "step": self.step,
            "dp_rank": self.dp_rank,
            "time_s": self.time_s,
        }
        if self.generation is not None:
            out["generation"] = self.generation
        if self.latency_ms is not None:
            out["latency_ms"] = self.latency_ms
        if self.ranks is not None:
            out["ranks"] = list(self.ranks)
        if self.detail:
            out["detail"] = self.detail
        out.update(self.extra)
        return out

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Event:
        """Validate one decoded line; errors are a one-line ConfigError starting with `where`
        (`file:line`). `obj` itself is not modified."""
        if not isinstance(obj, dict):
            raise ConfigError(f"{where}: each line must be a JSON object")
        missing = [k for k in _REQUIRED if k not in obj]
        if missing:
            raise ConfigError(f"{where}: missing field(s) {', '.join(missing)}")
        rest = dict(obj)
        kind, step, rank, time_s = (rest.pop(k) for k in _REQUIRED)
        if kind not in EVENT_TYPES:
            raise ConfigError(f"{where}: unknown type {kind!r} (allowed: {', '.join(EVENT_TYPES)})")
        if not isinstance(step, int) or step < 0:
            raise ConfigError(f"{where}: step must be an integer >= 0, got {step!r}")
        if rank is not None and (not isinstance(rank, int) or rank < 0):
            raise ConfigError(f"{where}: dp_rank must be an integer >= 0 or null, got {rank!r}")
        if not _is_number(time_s) or time_s < 0:
            raise ConfigError(f"{where}: time_s must be a number >= 0, got {time_s!r}")
        if kind in ("failure", "rejoin") and rank is None:
            raise ConfigError(f"{where}: a {kind} event needs a dp_rank")
        generation = rest.pop("generation", None)
        if generation is not None and (not isinstance(generation, int) or generation < 0):
            raise ConfigError(f"{where}: generation must be an integer >= 0, got {generation!r}")
        latency = rest.pop("latency_ms", None)
        if latency is not None and (
            not _is_number(latency) or not math.isfinite(latency) or latency < 0
        ):
            raise ConfigError(f"{where}: latency_ms must be a number >= 0, got {latency!r}")
        ranks = rest.pop("ranks", None)
        if ranks is not None and (
            not isinstance(ranks, list) or not all(isinstance(r, int) and r >= 0 for r in ranks)
        ):
            raise ConfigError(f"{where}: ranks must be a list of integers >= 0, got {ranks!r}")
        detail = rest.pop("detail", "")
        if not isinstance(detail, str):
            raise ConfigError(f"{where}: detail must be a string, got {detail!r}")
        return cls(
            type=kind,
            step=step,
            dp_rank=rank,
            time_s=float(time_s),
            generation=generation,
            latency_ms=None if latency is None else float(latency),
            ranks=None if ranks is None else list(ranks),
            detail=detail,
            extra=rest,
        )


class EventWriter:
    """Appends validated events to an events.jsonl file, one flushed line each.

    The file is opened in append mode, so successive writers (e.g. one per restart of the job)
    extend the same log; give each the same `run_start_s` to keep `time_s` on one clock.
    """

    def __init__(self, path: str | os.PathLike, run_start_s: float):
        """`run_start_s`: epoch time (`time.time()`) at which the run started."""
        self.path = Path(path)
        self.run_start_s = float(run_start_s)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", buffering=1)

    def write(
        self,
        type: str,
        *,
        step: int,
        dp_rank: int | None,
        time_s: float | None = None,
        **fields: Any,
    ) -> Event:
        """Validate and append one event; returns it (with `time_s` relative to the run start).

        `time_s` is an epoch time (default: now); it is stored as seconds since `run_start_s`,
        clamped at 0. `fields` are the optional schema fields (generation, latency_ms, ranks,
        detail) or any other JSON-serialisable keys. A bad value raises ConfigError and writes
        nothing.
        """
        epoch = time.time() if time_s is None else float(time_s)
        obj = {
            **fields,
            "type": type,
            "step": step,
            "dp_rank": dp_rank,
            "time_s": max(0.0, epoch - self.run_start_s),
        }
        event = Event.from_json(obj, f"{self.path} (write)")
        self._fh.write(json.dumps(event.to_json()) + "\n")
        self._fh.flush()
        return event

    def close(self) -> None:
        """Close the file (idempotent)."""
        if not self._fh.closed:
            self._fh.close()

    def __enter__(self) -> EventWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(path: str | os.PathLike) -> list[Event]:
    """Parse and validate an events.jsonl file (blank lines are skipped), sorted by time_s."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"events file not found: {p}")
    events = []
    for n, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not valid JSON ({exc.msg})") from None
        events.append(Event.from_json(obj, where))
    return sorted(events, key=lambda e: e.time_s)
