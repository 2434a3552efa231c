"""The columns of the peers benchmark (`peers.py`), computed by one function from every system's
trace, the table, the loss-vs-wall-clock figure, and the trace of a torchft run (its replicas'
rows merged into one row per committed step).

A trace: `start` (epoch s), `wall_s`, `rows` (one per committed step, in commit order: `step`,
`time` epoch s, `loss` of the global batch, `samples` it trained on; a step committed again after
a rollback has a second row), `kill_times` (epoch s) and `kill_steps` of the kills that fired,
the group kill last, `group_kill` (None, or its `step`, `time`, `processes` killed, whether it was
`relaunched` and the new launch `rejoined` before the end), `uncommitted_attempts` (step attempts
the system redid without logging them) and `redo_times` (epoch s of those it dates),
`global_batch` (samples), `heal_bytes` (the serialised state that rejoining or healing replicas
received; None: none did, or they restarted from saved state), `val_loss` (None: not measured),
`restarts`.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from bench_common import cell, read_jsonl

GROUP_COLUMNS = (
    "group_kill_step",
    "group_kill_held",
    "group_kill_to_commit_s",
    "group_samples_dropped",
    "group_steps_redone",
)
"""The group kill's own columns (`_group_columns`)."""


def torchft_trace(out: Path, replicas: int, start: float, wall_s: float) -> dict:
    """One row per committed step from the replicas' rows: the latest replica's commit time, the
    mean local loss of the participating replicas, participants x their batch in samples (the
    kills are the benchmark's to add)."""
    by_step: dict[int, list[dict]] = {}
    uncommitted: dict[int, float] = {}  # a step no replica committed: its first attempt's end
    val = None
    heal: list[int] = []
    for r in range(replicas):
        for row in read_jsonl(out / f"rows_replica{r}.jsonl"):
            if "val_loss" in row:
                val = row["val_loss"]
            elif "heal_bytes" in row:
                heal.append(row["heal_bytes"])
            elif not row["committed"]:
                uncommitted[row["step"]] = min(row["time"], uncommitted.get(row["step"], math.inf))
            elif row["participating"]:
                by_step.setdefault(row["step"], []).append(row)
    rows = []
    for step in sorted(by_step):
        group = by_step[step]
        samples = sum(r["samples"] for r in group)
        rows.append(
            {
                "step": step,
                "time": max(r["time"] for r in group),
                "loss": statistics.fmean(r["loss"] for r in group),
                "samples": samples,
            }
        )
    restarts = 0
    for r in range(replicas):
        incs = {row.get("incarnation", 0) for row in read_jsonl(out / f"rows_replica{r}.jsonl")}
        restarts += max(incs, default=0)
    return {
        "start": start,
        "wall_s": wall_s,
        "rows": rows,
        "uncommitted_attempts": len(uncommitted),
        "redo_times": sorted(uncommitted.values()),
        "heal_bytes": sum(heal) if heal else None,  # state dicts its HTTP transport delivered
        "val_loss": val,
        "restarts": restarts,
    }


def _step_s(trace: dict) -> float | None:
    """Failure-free time per step: from step 1's commit to the last commit before the first
    kill, over the steps between. A rate over the whole window, not a median of gaps: our rows
    are seen by polling (`POLL_S`), which quantises single gaps but not a long window."""
    first_kill = min(trace["kill_times"], default=float("inf"))
    rows = [r for r in trace["rows"] if r["time"] < first_kill and r["step"] >= 1]
    if len(rows) < 2 or rows[-1]["step"] <= rows[0]["step"]:
        return None
    return (rows[-1]["time"] - rows[0]["time"]) / (rows[-1]["step"] - rows[0]["step"])


def columns(traces: dict[str, dict], baseline: str | None) -> dict[str, dict]:
    """Every column of every system (the same code for all)."""
    base_loss = {}
    if baseline is not None:
        base_loss = {r["step"]: r["loss"] for r in traces[baseline]["rows"]}
    base_step = _step_s(traces[baseline]) if baseline is not None else None
    out = {}
    for name, t in traces.items():
        rows = t["rows"]
        final = {r["step"]: r for r in rows}  # the last commit of each step is what trained on
        seen: set[int] = set()
        rolled_back = 0
        for r in rows:
            rolled_back += r["step"] in seen
            seen.add(r["step"])
        committed = sum(r["samples"] for r in final.values())
        # what each step trained on against the global batch: short = dropped, over = twice
        gb = t["global_batch"]
        dropped = sum(max(0, gb - r["samples"]) for r in final.values())
        twice = sum(max(0, r["samples"] - gb) for r in final.values())
        kills = zip(t["kill_steps"], t["kill_times"], strict=True)
        heal = [_next_commit(rows, step, k) for step, k in kills]
        devs = [abs(r["loss"] - base_loss[s]) for s, r in final.items() if s in base_loss]
        step_s = _step_s(t)
        out[name] = {
            "step_s": step_s,
            "step_vs_torchrun": step_s / base_step if step_s and base_step else None,
            "wall_s": t["wall_s"],
            "steps_committed": len(final),
            "goodput_samples_per_s": committed / t["wall_s"],
            "kill_to_next_commit_s": heal,
            "kills": len(t["kill_times"]),
            "restarts": t["restarts"],
            "steps_redone": rolled_back + t["uncommitted_attempts"],
            "samples_dropped": dropped,
            "samples_counted_twice": twice,
            "heal_bytes": t["heal_bytes"],
            "val_loss": t["val_loss"],
            "max_loss_dev": max(devs) if devs and name != baseline else None,
            **_group_columns(t, final, gb),
        }
    return out


def _next_commit(rows: list[dict], step: int, kill: float) -> float | None:
    """Seconds from a kill to the first commit of its step or a later one after it."""
    after = [r["time"] for r in rows if r["time"] > kill and r["step"] >= step]
    return min(after) - kill if after else None


def _group_columns(t: dict, final: dict[int, dict], gb: int) -> dict:
    """The group kill's own figures: whether the group's trainer held at its step (False: it
    was still down, and the group was killed as the job went past the step); kill -> next
    commit; the samples the steps from its step on dropped; the steps redone after it (commits
    of a step committed before it, and the attempts the system dates after it). All None
    without a group kill."""
    g = t.get("group_kill")
    if not g:
        return dict.fromkeys(GROUP_COLUMNS)
    before = {r["step"] for r in t["rows"] if r["time"] <= g["time"]}
    again = sum(1 for r in t["rows"] if r["time"] > g["time"] and r["step"] in before)
    redo = sum(1 for x in t.get("redo_times") or [] if x > g["time"])
    dropped = sum(max(0, gb - r["samples"]) for s, r in final.items() if s >= g["step"])
    return {
        "group_kill_step": g["step"],
        "group_kill_held": g["held"],
        "group_kill_to_commit_s": _next_commit(t["rows"], g["step"], g["time"]),
        "group_samples_dropped": dropped,
        "group_steps_redone": again + redo,
    }


def _c(value, width: int, spec: str = ".2f", scale: float = 1.0) -> str:
    return cell(value, spec, scale=scale).rjust(width)


def print_table(table: dict[str, dict]) -> None:
    print(
        f"{'system':<19}{'step ms':>8}{'vs trun':>8}{'wall s':>7}{'goodput':>8}"
        f"{'kill->commit s':>18}{'redone':>7}{'dropped':>8}{'heal MB':>8}{'val loss':>9}"
        f"{'max dev':>8}{'group: s':>9}{'redone':>7}{'dropped':>8}"
    )
    for name, c in table.items():
        heal = [h for h in c["kill_to_next_commit_s"] if h is not None]
        heal_s = ",".join(f"{h:.2f}" for h in heal) if heal else "n/a"
        mb = None if c["heal_bytes"] is None else c["heal_bytes"] / 1e6
        print(
            f"{name:<19}{_c(c['step_s'], 8, '.1f', 1000)}{_c(c['step_vs_torchrun'], 8)}"
            f"{c['wall_s']:7.1f}{c['goodput_samples_per_s']:8.1f}  {heal_s:>16}"
            f"{c['steps_redone']:7d}{c['samples_dropped']:8d}{_c(mb, 8)}"
            f"{_c(c['val_loss'], 9, '.4f')}{_c(c['max_loss_dev'], 8, '.4f')}"
            f"{_c(c['group_kill_to_commit_s'], 8)}{'*' if c['group_kill_held'] is False else ' '}"
            f"{_c(c['group_steps_redone'], 7, 'd')}"
            f"{_c(c['group_samples_dropped'], 8, 'd')}"
        )
    print(
        "goodput: committed samples / wall s; kill->commit: from each kill to the next committed "
        "step (the group kill last); val loss after the last step; max dev: largest |loss - "
        "torchrun's| at a step; group: the group kill's kill->commit, steps redone after it and "
        "samples dropped from its step on (*: replica 1 was still down at the group-kill step)"
    )


def plot(traces: dict[str, dict], path: str) -> None:
    """Loss against wall-clock seconds since each run started, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, t in traces.items():
        xs, ys = [], []
        for i, r in enumerate(t["rows"]):
            if i and r["step"] <= t["rows"][i - 1]["step"]:  # a rollback: a gap, not a line
                xs.append(float("nan"))
                ys.append(float("nan"))
            xs.append(r["time"] - t["start"])
            ys.append(r["loss"])
        (line,) = ax.plot(xs, ys, label=name, lw=1.2)
        for k in t["kill_times"]:
            ax.axvline(k - t["start"], color=line.get_color(), ls=":", lw=0.8)
    ax.set_xlabel("wall-clock s since the run started (dotted: kills)")
    ax.set_ylabel("training loss (global batch)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
