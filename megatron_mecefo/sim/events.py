"""Replay of a real run's `events.jsonl` as a simulator trace.

The schema (`Event`, `EVENT_TYPES`) and its reader (`read_events`) belong to the writer, in
`megatron_mecefo.metrics.events`; they are re-exported here for the simulator. Only failure and
rejoin events shape the replayed trace: each failure of a DP rank is a failure of that group, and
its repair time runs until that rank's next rejoin (forever if none). Detection and regroup events
are reported as measured latencies (the event's own `latency_ms` when it carries one, else the
time since the failure).
"""

from __future__ import annotations

import math

import numpy as np

from megatron_mecefo.metrics.events import EVENT_TYPES, Event, read_events
from megatron_mecefo.sim.failures import FailureTrace

__all__ = ["EVENT_TYPES", "Event", "events_to_trace", "measured_latencies", "read_events"]


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
    """Mean failure->detection and failure->regroup latencies (s) observed in the run.

    For each failure, the next detection (regroup) event counts: its `latency_ms` if it carries
    one, else its `time_s` minus the failure's.
    """
    out: dict[str, list[float]] = {"detection_s": [], "regroup_s": []}
    for i, ev in enumerate(events):
        if ev.type != "failure":
            continue
        for kind, key in (("detection", "detection_s"), ("regroup", "regroup_s")):
            nxt = next((e for e in events[i + 1 :] if e.type == kind), None)
            if nxt is None:
                continue
            if nxt.latency_ms is not None:
                out[key].append(nxt.latency_ms / 1000.0)
            else:
                out[key].append(nxt.time_s - ev.time_s)
    return {k: float(np.mean(v)) for k, v in out.items() if v}
