"""`summary.json` of a whole job, not of the process that happens to write it.

Under failover the leader that writes the summary may be a restarted rank (or another replica)
that saw only the end of the job. What the job did is in `metrics.jsonl` (one row per committed
step, kept by every leader in turn), in the events the coordinator collects, and in counters the
members keep in the store; `job_wide` rebuilds the summary from those. `check_summary` is the
reverse check (summary vs metrics and events), used by the chaos soak and the tests.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any


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


def job_wide(
    summary: dict[str, Any],
    metrics_path: Path,
    *,
    start_step: int,
    expected_microbatches: int,
) -> dict[str, Any]:
    """`summary` with its step counts and losses taken from the job's metric rows of steps >=
    `start_step` (where this launch began), and the failover counters made job-wide."""
    rows = sorted(
        (r for r in read_rows(metrics_path) if r.get("step", -1) >= start_step),
        key=lambda r: r["step"],
    )
    if not rows:
        return summary
    rates = [r["tokens_per_s"] for r in rows[1:] if "tokens_per_s" in r]
    vals = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    out = {
        **summary,
        "start_step": start_step,
        "steps": len(rows),
        "first_loss": rows[0]["loss"],
        "final_loss": rows[-1]["loss"],
        "val_losses": vals,
        "final_val_loss": vals[-1][1] if vals else None,
        "mean_tokens_per_s": sum(rates) / len(rates) if rates else summary.get("mean_tokens_per_s"),
    }
    fo = summary.get("failover")
    if isinstance(fo, dict):
        out["failover"] = {
            **fo,
            "steps_degraded": sum(1 for r in rows if r.get("job_degraded")),
            "samples_lost": sum(
                max(0, expected_microbatches - r.get("global_microbatches", expected_microbatches))
                for r in rows
            ),
        }
    return out


def check_summary(run_dir: Path) -> list[str]:
    """Where summary.json disagrees with metrics.jsonl and events.jsonl (empty: it agrees)."""
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
    events = read_rows(run_dir / "events.jsonl")
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
    kinds = Counter(e.get("type") for e in events)
    for key, kind in (("failures", "failure"), ("rejoins", "rejoin")):
        if fo.get(key) != kinds[kind]:
            out.append(f"failover.{key} = {fo.get(key)} but events.jsonl has {kinds[kind]}")
    degraded = sum(1 for r in rows if r.get("job_degraded"))
    if fo.get("steps_degraded") != degraded:
        out.append(
            f"failover.steps_degraded = {fo.get('steps_degraded')} but metrics say {degraded}"
        )
    if fo.get("samples_lost") != 0:
        out.append(f"failover.samples_lost = {fo.get('samples_lost')}")
    return out
