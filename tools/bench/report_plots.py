"""The benchmark report's plots (800 x 450 PNGs) and the rows they are drawn from.

Imported by `report.py`, which puts `tools/bench` on `sys.path`."""

from __future__ import annotations

import math
from pathlib import Path

from report_markdown import _scale
from report_tools import PAPER_MECEFO_DROP_PCT, PAPER_SPARE, PNG_DPI, PNG_SIZE_IN


# ------------------------------------------------------------------------------------ data prep
def throughput_drops(sim: dict) -> list[dict]:
    """Per strategy of a `mecefo-sim simulate --json` result: TTT/T0 and the throughput drop
    1 - T0/TTT in % (None when the job did not finish: no throughput)."""
    rows = []
    t0_h = sim.get("t0_h")
    for r in sim.get("results", []):
        ratio = r.get("ttt_over_t0")
        if ratio is None and t0_h and r.get("ttt_h") is not None:
            ratio = r["ttt_h"] / t0_h
        finished = r.get("finished", True) and ratio is not None and math.isfinite(ratio)
        rows.append(
            {
                "strategy": r.get("strategy", "?"),
                "ttt_over_t0": ratio,
                "drop_pct": 100.0 * (1.0 - 1.0 / ratio) if finished and ratio > 0 else None,
                "restarts": r.get("restarts"),
                "masked_failures": r.get("masked_failures"),
            }
        )
    return rows


def spare_rows(reproduce: dict) -> list[dict]:
    """The SPARe table, ours vs the paper's (the paper's values from the JSON or PAPER_SPARE)."""
    rows = []
    for r in reproduce.get("rows", []):
        n = r.get("N")
        paper_rep, paper_spare = PAPER_SPARE.get(n, (None, None))
        row = {
            "N": n,
            "rep": r.get("rep_ckpt"),
            "rep_paper": r.get("paper_rep_ckpt", paper_rep),
            "rep_r": r.get("rep_r"),
            "spare": r.get("spare_ckpt"),
            "spare_paper": r.get("paper_spare_ckpt", paper_spare),
            "spare_r": r.get("spare_r"),
        }
        for k in ("rep", "spare"):
            ours, paper = row[k], row[f"{k}_paper"]
            row[f"{k}_gap_pct"] = 100 * (ours / paper - 1) if ours and paper else None
        rows.append(row)
    return rows


def latency_rows(failover: dict | None, recovery: dict | None) -> list[dict]:
    """Failure kind -> detection/regroup/rejoin ms (failover.json) and end-to-end recovery ms
    (recovery.json); missing values are None."""
    rows = []
    for f in (failover or {}).get("failures", []):
        rows.append(
            {
                "label": f.get("kind", "?"),
                "detection_ms": f.get("detection_ms"),
                "regroup_ms": f.get("regroup_ms"),
                "rejoin_ms": f.get("rejoin_ms"),
            }
        )
    for name, r in ((recovery or {}).get("end_to_end") or {}).items():
        rows.append({"label": name, "recovery_ms": r.get("recovery_ms")})
    return rows


def snapshot_rows(recovery: dict) -> list[dict]:
    """Per model and snapshot interval (> 0): overhead % of the median step and blocked %."""
    rows = []
    for model, res in (recovery.get("models") or {}).items():
        for interval, r in sorted((res.get("overhead") or {}).items(), key=lambda kv: int(kv[0])):
            rows.append(
                {
                    "model": model,
                    "interval": int(interval),
                    "median_step_ms": _scale(r.get("median_step_s"), 1e3),
                    "overhead_pct": r.get("overhead_pct"),
                    "blocked_ms": r.get("blocked_ms_per_step"),
                    "blocked_pct": r.get("blocked_pct"),
                }
            )
    return rows


# ------------------------------------------------------------------------------------ plots
def _figure(title: str, ylabel: str):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=PNG_SIZE_IN, dpi=PNG_DPI, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    return fig, ax


def _grouped_bars(ax, groups: list[str], series: dict[str, list], hatches=None) -> dict:
    """One bar per (group, series) with a value; None values draw no bar. Returns the bars' x
    positions per series."""
    width = 0.8 / max(1, len(series))
    positions = {}
    for i, (label, values) in enumerate(series.items()):
        xs = positions[label] = [
            g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))
        ]
        pts = [(x, v) for x, v in zip(xs, values) if v is not None]
        if pts:
            hatch = (hatches or {}).get(label)
            bars = ax.bar(*zip(*pts), width=width, label=label, hatch=hatch, ec="black", lw=0.4)
            ax.bar_label(bars, fmt="%.2f", fontsize=6)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.legend(fontsize=7)
    return positions


def plot_throughput_drop(scenarios: dict[str, list[dict]]):
    """Bars: simulated throughput drop per strategy, one series per scenario; MeCeFO's figures
    as horizontal markers. Strategies that did not finish get no bar."""
    fig, ax = _figure(
        "Throughput drop under failures (mecefo-sim) vs the MeCeFO paper", "drop, % (symlog)"
    )
    strategies = list(dict.fromkeys(r["strategy"] for rows in scenarios.values() for r in rows))
    series = {
        label: [next((r["drop_pct"] for r in rows if r["strategy"] == s), None) for s in strategies]
        for label, rows in scenarios.items()
    }
    positions = _grouped_bars(ax, strategies, series)
    for label, rows in scenarios.items():  # say so where a strategy ran but never finished
        for x, s in zip(positions[label], strategies):
            if any(r["strategy"] == s and r["drop_pct"] is None for r in rows):
                ax.text(x, 0.05, "did not finish", rotation=90, fontsize=6, ha="center")
    for i, (size, pct) in enumerate(PAPER_MECEFO_DROP_PCT.items()):
        ax.axhline(pct, ls="--", lw=1, color=f"C{i + 5}")
        ax.text(-0.45, pct, f"MeCeFO paper {size}: {pct}%", fontsize=7, va="bottom")
    ax.set_yscale("symlog", linthresh=1.0)
    top = max([v for vs in series.values() for v in vs if v is not None] + [5.0])
    ax.set_ylim(0, 2 * top)  # head-room for the bar labels on the log part
    return fig


def plot_latencies(rows: list[dict]):
    """Bars: detection, regroup, rejoin per failure kind, and end-to-end recovery per case."""
    fig, ax = _figure("Failover and recovery latencies (from the failure)", "ms")
    keys = {
        "detection": "detection_ms",
        "regroup": "regroup_ms",
        "rejoin": "rejoin_ms",
        "recovery": "recovery_ms",
    }
    series = {label: [r.get(k) for r in rows] for label, k in keys.items()}
    series = {k: v for k, v in series.items() if any(x is not None for x in v)}
    _grouped_bars(ax, [_wrap(r["label"]) for r in rows], series)
    return fig


def _wrap(label: str, width: int = 18) -> str:
    import textwrap

    return textwrap.fill(label, width)


def plot_spare(rows: list[dict]):
    """Bars: TTT/T0 of Rep+CKPT and SPARe+CKPT per N, ours next to the paper's (hatched)."""
    fig, ax = _figure("SPARe table: TTT / T0 at 600k GPUs, ours vs the paper", "TTT / T0")
    series = {
        "Rep+CKPT (ours)": [r["rep"] for r in rows],
        "Rep+CKPT (paper)": [r["rep_paper"] for r in rows],
        "SPARe+CKPT (ours)": [r["spare"] for r in rows],
        "SPARe+CKPT (paper)": [r["spare_paper"] for r in rows],
    }
    hatches = {k: "//" for k in series if "paper" in k}
    _grouped_bars(ax, [f"N = {r['N']}" for r in rows], series, hatches)
    return fig


def plot_snapshot_overhead(rows: list[dict]):
    """Lines: median-step overhead % and blocked % vs snapshot interval, per model; 2% target."""
    fig, ax = _figure("Snapshot overhead vs interval (recovery.py)", "% of a snapshot-free step")
    for model in dict.fromkeys(r["model"] for r in rows):
        sel = [r for r in rows if r["model"] == model and r["interval"] > 0]
        xs = [r["interval"] for r in sel]
        ax.plot(xs, [r["overhead_pct"] for r in sel], "o-", label=f"{model}: median step")
        ax.plot(xs, [r["blocked_pct"] for r in sel], "s--", label=f"{model}: blocked")
    ax.set_xticks(sorted({r["interval"] for r in rows if r["interval"] > 0}))
    ax.axhline(2.0, color="red", lw=1, ls=":", label="target < 2%")
    ax.set_xlabel("snapshot every k steps")
    ax.legend(fontsize=7)
    return fig


def save_png(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=PNG_DPI)
