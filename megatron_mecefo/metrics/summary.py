"""`summary.json` of a whole job, not of the process that happens to write it.

Under failover the leader that writes the summary may be a restarted rank (or another replica)
that saw only the end of the job. What the job did is in `metrics.jsonl` (one row per committed
step, kept by every leader in turn) and in the events posted to the store (which the coordinator
copies into `events.jsonl`, asynchronously); `job_wide` rebuilds the summary from the metric rows
and from the posted events themselves, so it never depends on how far the coordinator has
written. `check_summary` is the reverse check (summary vs metrics.jsonl and events.jsonl), used by
the chaos soak and the tests.

events.jsonl outlives a launch (a resumed run appends to it), so the summary records where this
launch's events begin (`failover.events_start`, a byte offset) and the last event it counted
(`failover.events_seq`, the `seq` of each line); the check reads that span of the file.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

COUNTED = (
    ("failures", "failure"),
    ("regroups", "regroup"),
    ("rejoins", "rejoin"),
    ("steps_redone", "step_redone"),
    ("nodes_lost", "node_lost"),
    ("nodes_replaced", "node_replaced"),
    ("anomalies", "anomaly"),
    ("reruns", "rerun"),
    ("classified", "classified"),
    ("evictions", "evicted"),
    ("healed", "healed"),
    ("rebalanced", "rebalanced"),
)
"""Summary counters (failover.<key>) that are the number of events of a type."""

LATENCIES = (
    ("detection_ms", "detection"),
    ("regroup_ms", "regroup"),
    ("full_strength_ms", "node_replaced"),
)
"""Summary lists (failover.<key>) of the `latency_ms` of each event of a type, in event order.
`full_strength_ms`: from a node's failure until every rank of it is back on a standby
(`failover/authority/spare_pool.py`); its max and median are `full_strength_ms_max` / `_median`.
From the `rejoin` events too: `rejoin_bytes` (the state every rejoining rank received, summed) and
`rejoin_s` (the longest single transfer; None without one). The process that writes the summary
saw only its own regroups and transfers, so none of these is its own view."""


def read_rows(path: Path) -> list[dict]:
    """The complete JSON lines of a file (a line cut short by a crash is skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def file_size(path: Path) -> int:
    """Bytes in a file now (0 if it does not exist): where the next writer's lines will start."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def launch_events(run_dir: Path, start: int, last_seq: int | None = None) -> list[dict]:
    """One launch's events as written to events.jsonl: the lines from byte `start` on, up to
    `seq` `last_seq` (all of them when None)."""
    try:
        with open(Path(run_dir) / "events.jsonl", "rb") as fh:
            fh.seek(start)
            lines = fh.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if last_seq is None or event.get("seq", 0) <= last_seq:
            out.append(event)
    return out


def event_counts(events: list[dict]) -> dict[str, Any]:
    """The failover counters and latencies a list of events amounts to."""
    out: dict[str, Any] = {
        key: sum(1 for e in events if e.get("type") == kind) for key, kind in COUNTED
    }
    for key, kind in LATENCIES:
        out[key] = [
            round(e["latency_ms"], 1)
            for e in events
            if e.get("type") == kind and e.get("latency_ms") is not None
        ]
    full = out["full_strength_ms"]
    out["full_strength_ms_max"] = max(full) if full else None
    out["full_strength_ms_median"] = round(statistics.median(full), 1) if full else None
    rejoins = [e for e in events if e.get("type") == "rejoin"]
    out["rejoin_bytes"] = sum(int(e.get("bytes") or 0) for e in rejoins)
    transfers = [e["transfer_ms"] for e in rejoins if e.get("transfer_ms") is not None]
    out["rejoin_s"] = round(max(transfers) / 1000, 3) if transfers else None
    # micro-batches classified as bad data and skipped on purpose (not lost to a failure)
    out["microbatches_skipped"] = sum(
        len(e.get("microbatches") or [])
        for e in events
        if e.get("type") == "classified" and e.get("kind") == "data"
    )
    return out


def job_wide(
    summary: dict[str, Any],
    metrics_path: Path,
    *,
    start_step: int,
    expected_microbatches: int,
    events: list[dict] | None = None,
    events_seq: int = 0,
    events_start: int = 0,
) -> dict[str, Any]:
    """`summary` with its step counts and losses taken from the job's metric rows of steps >=
    `start_step` (where this launch began) and its failover counters from the launch's posted
    `events` (seq 1..`events_seq`), whose lines start at byte `events_start` of events.jsonl."""
    out = {**summary, "start_step": start_step}
    rows = sorted(
        (r for r in read_rows(metrics_path) if r.get("step", -1) >= start_step),
        key=lambda r: r["step"],
    )
    if rows:
        rates = [r["tokens_per_s"] for r in rows[1:] if "tokens_per_s" in r]
        vals = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
        mean_rate = sum(rates) / len(rates) if rates else summary.get("mean_tokens_per_s")
        out.update(
            steps=len(rows),
            first_loss=rows[0]["loss"],
            final_loss=rows[-1]["loss"],
            val_losses=vals,
            final_val_loss=vals[-1][1] if vals else None,
            mean_tokens_per_s=mean_rate,
        )
    fo = summary.get("failover")
    if isinstance(fo, dict):
        out["failover"] = {
            **fo,
            **(
                {
                    **event_counts(events),
                    "events": len(events),
                    "events_start": events_start,
                    "events_seq": events_seq,
                }
                if events is not None
                else {}
            ),
            "steps_degraded": sum(1 for r in rows if r.get("job_degraded")),
            # the shortfall against n x M micro-batches that no failover explains: a skipped
            # bad micro-batch (`microbatches_skipped`) was dropped on purpose
            "samples_lost": sum(
                max(0, expected_microbatches - r.get("global_microbatches", expected_microbatches))
                for r in rows
            )
            - (event_counts(events)["microbatches_skipped"] if events is not None else 0),
        }
    return out


def check_summary(run_dir: Path) -> list[str]:
    """Where summary.json disagrees with metrics.jsonl and events.jsonl (empty: it agrees).

    Each item is one line a person can act on, e.g. "steps 24 but metrics.jsonl has 40 steps".
    """
    run_dir = Path(run_dir)
    path = run_dir / "summary.json"
    if not path.exists():
        return ["summary.json is missing (the run is incomplete)"]
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError:
        return ["summary.json is not JSON"]
    start = summary.get("start_step") or 0
    rows = [r for r in read_rows(run_dir / "metrics.jsonl") if r.get("step", -1) >= start]
    out = []
    steps = len({r.get("step") for r in rows})
    if summary.get("steps") != steps:
        out.append(f"steps {summary.get('steps')} but metrics.jsonl has {steps} steps")
    if rows:
        first = min(rows, key=lambda r: r.get("step", -1))
        last = max(rows, key=lambda r: r.get("step", -1))
        for key, row in (("first_loss", first), ("final_loss", last)):
            if summary.get(key) != row.get("loss"):
                out.append(
                    f"{key} {summary.get(key)} but metrics' step {row.get('step')} has loss "
                    f"{row.get('loss')}"
                )
    fo = summary.get("failover")
    if not isinstance(fo, dict):
        return out
    events = launch_events(run_dir, fo.get("events_start") or 0, fo.get("events_seq"))
    if fo.get("events") is not None and len(events) != fo["events"]:
        out.append(
            f"failover.events = {fo['events']} but events.jsonl has {len(events)} of this "
            "launch's events"
        )
    expected = event_counts(events)
    for key, _ in COUNTED:
        if fo.get(key) != expected[key]:
            out.append(f"failover.{key} = {fo.get(key)} but events.jsonl has {expected[key]}")
    for key, kind in (("detection_ms", "detection"), ("full_strength_ms", "node_replaced")):
        if len(fo.get(key) or []) != len(expected[key]):
            out.append(
                f"failover.{key} has {len(fo.get(key) or [])} latencies but "
                f"events.jsonl has {len(expected[key])} {kind} events"
            )
    for key in (
        "full_strength_ms_max",
        "full_strength_ms_median",
        "rejoin_bytes",
        "rejoin_s",
        "microbatches_skipped",
    ):
        if fo.get(key) != expected[key]:
            out.append(f"failover.{key} = {fo.get(key)} but events.jsonl says {expected[key]}")
    degraded = sum(1 for r in rows if r.get("job_degraded"))
    if fo.get("steps_degraded") != degraded:
        out.append(
            f"failover.steps_degraded = {fo.get('steps_degraded')} but metrics say {degraded}"
        )
    if fo.get("samples_lost") != 0:
        out.append(f"failover.samples_lost = {fo.get('samples_lost')}")
    return out
