"""The convergence benchmark's summaries: per-config statistics with t intervals, the markdown
table of a set of runs, the accuracy-cost and proxy-cost files the planner reads, the table.

Imported by `convergence.py`, which puts `tools/bench` and the repository on `sys.path`."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _ratio(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


def _default_skip_layers() -> str:
    """The skip-layer setting the runs' configs get unless a config overrides it."""
    from megatron_mecefo.mecefo import MecefoConfig

    return MecefoConfig().skip_attention_layers


def markdown_table(paths: list[str]) -> str:
    """One row per (run, scenario, config) of the given convergence JSONs; ValueError for a
    file that is not one."""
    lines = [
        "| corpus | layers | skip layers | M | scenario | config | seeds | ppl gap % (mean +- sd) "
        "| 95% CI "
        "| beyond noise | slowest step x (pred.) | mean step x over failure steps (pred.) "
        "| degraded share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path in paths:
        try:
            report = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not readable as JSON ({exc})") from None
        if not isinstance(report, dict) or not {"args", "rows"} <= report.keys():
            raise ValueError(f"{path}: not a convergence run (no 'args' and 'rows')")
        a = report["args"]
        for r in summarize(report["rows"]):
            g, (lo, hi) = r["gap_ppl_pct"], r["ci95"]
            lines.append(
                f"| {a['corpus']} | {a.get('num_layers') or 2} "
                f"| {report.get('skip_attention_layers', 'all')} | {a['microbatches']} "
                f"| {r['scenario']} | {r['config']} | {g['n']} "
                f"| {g['mean']:+.2f} +- {g['std']:.2f} "
                f"| [{lo:+.2f}, {hi:+.2f}] | {'yes' if r['beyond_noise'] else 'no'} "
                f"| {_ratio(r['predicted_step_ratio']['mean'])} "
                f"| {_ratio(r['mean_predicted_step_ratio']['mean'])} "
                f"| {100 * r['degraded_fraction']['mean']:.1f}% |"
            )
    return "\n".join(lines)


def write_proxy_costs(
    grad_paths: list[str], anchor_path: str, out: str, command: str, skip_layers: str = "all"
) -> dict:
    """The planner's table from the gradient-error proxy, anchored to convergence runs (which
    ran with the skip in every layer); `skip_layers`: the setting the table's skip sets are for."""
    per_set: dict[str, list[float]] = {}
    for path in grad_paths:
        for key, st in json.loads(Path(path).read_text())["grad_error"]["sets"].items():
            per_set.setdefault(key, []).append(st["mean"])
    if skip_layers != "all":  # the skip sets at that setting replace the all-layer ones
        for key in [k for k in per_set if "@" not in k and "skip" in k.split("+")]:
            if f"{key}@{skip_layers}" not in per_set:
                raise SystemExit(f"error: no --grad-error run measured {key}@{skip_layers}")
        at = {k.split("@")[0]: v for k, v in per_set.items() if k.endswith(f"@{skip_layers}")}
    else:
        at = {}
    anchor = json.loads(Path(anchor_path).read_text())
    measured = anchor["costs"]
    # the anchor set: measured by convergence with the smallest relative spread
    key = min(
        (k for k in measured if k in per_set and measured[k]["mean"] > 0),
        key=lambda k: measured[k]["std"] / measured[k]["mean"],
    )
    proxy = {k: _stats(v) for k, v in per_set.items() if "@" not in k}
    alpha = measured[key]["mean"] / proxy[key]["mean"]
    table_sets = {k: _stats(at.get(k, per_set[k])) for k in proxy}
    validation = {}
    for k, m in measured.items():
        if k not in proxy:
            continue
        n = m.get("n", 1)
        half = _T95.get(n - 1, 1.96) * m["std"] / math.sqrt(n) if n > 1 else math.inf
        lo, hi = m.get("raw_mean", m["mean"]) - half, m.get("raw_mean", m["mean"]) + half
        predicted = alpha * proxy[k]["mean"]
        validation[k] = {
            "proxy_predicted": predicted,
            "convergence_mean": m.get("raw_mean", m["mean"]),
            "convergence_ci95": [lo, hi],
            "within_ci": lo <= predicted <= hi,
        }
    table = {
        "unit": anchor["unit"],
        "costs": {k: alpha * v["mean"] for k, v in sorted(table_sets.items())},
        "skip_attention_layers": skip_layers,
        "skip_layer_proxy": {k: _stats(v) for k, v in per_set.items() if "@" in k},
        "method": "gradient-error proxy (relative squared error of the reduced step gradient, "
        "neighbour plan, replica 1 dead) x alpha; alpha makes the proxy equal the convergence "
        f"cost of {key!r}, the set the convergence runs measured most precisely; the sets with "
        f"the attention skip take the proxy measured with skip_attention_layers={skip_layers}",
        "alpha": alpha,
        "anchor_set": key,
        "proxy": {k: {**v, "per_run": per_set[k]} for k, v in proxy.items()},
        "validation": validation,
        "convergence": measured,
        "measured": {
            "command": command,
            "grad_error_runs": grad_paths,
            "anchor": anchor.get("measured"),
        },
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(table, indent=2) + "\n")
    print(f"wrote {out} (alpha {alpha:.2f}, anchor {key}):")
    for k, v in table["costs"].items():
        val = validation.get(k)
        extra = (
            f"; all layers: proxy predicts {val['proxy_predicted']:.2f}, convergence "
            f"{val['convergence_mean']:+.2f}, 95% CI "
            f"[{val['convergence_ci95'][0]:+.2f}, {val['convergence_ci95'][1]:+.2f}]"
            if val
            else ""
        )
        print(f"  {k:<16} {v:7.2f} (proxy {table_sets[k]['mean']:.4f}){extra}")
    return table


def _stats(values: list[float]) -> dict:
    k = len(values)
    mean = sum(values) / k
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (k - 1)) if k > 1 else 0.0
    return {"mean": mean, "std": std, "n": k, "min": min(values), "max": max(values)}


# two-sided 95% Student t quantiles by degrees of freedom (seeds - 1)
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def summarize(rows: list[dict]) -> list[dict]:
    """Per (scenario, config): mean and spread over seeds of the paired perplexity gap, its 95%
    confidence interval (Student t over the seeds), and whether it is beyond seed noise (the
    interval excludes 0)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["scenario"], r["config"]), []).append(r)
    out = []
    for (scenario, config), rs in groups.items():
        gap = _stats([r["gap_ppl_pct"] for r in rs])
        if gap["n"] > 1:
            half = _T95.get(gap["n"] - 1, 1.96) * gap["std"] / math.sqrt(gap["n"])
        else:
            half = math.inf
        out.append(
            {
                "scenario": scenario,
                "config": config,
                "techniques": rs[0].get("techniques"),
                "gap_ppl_pct": gap,
                "ci95": [gap["mean"] - half, gap["mean"] + half],
                "beyond_noise": abs(gap["mean"]) > half,
                "step_time_ratio": _stats([r["step_time_ratio"] for r in rs]),
                "predicted_step_ratio": _stats(
                    [r.get("predicted_step_ratio", math.nan) for r in rs]
                ),
                "mean_predicted_step_ratio": _stats(
                    [r.get("mean_predicted_step_ratio", math.nan) for r in rs]
                ),
                "degraded_fraction": _stats([r["degraded_fraction"] for r in rs]),
            }
        )
    return out


def write_accuracy_costs(report: dict, args) -> None:
    """The planner's table: per technique set, the perplexity gap per unit of degraded share
    (neighbor-policy rows only, where one technique set runs every degraded micro-batch)."""
    per_set: dict[str, list[float]] = {}
    for r in report["rows"]:
        if r["policy"] == "neighbor" and r["degraded_fraction"] > 0:
            per_set.setdefault(r["techniques"], []).append(
                r["gap_ppl_pct"] / r["degraded_fraction"]
            )
    costs = {}
    for key, values in sorted(per_set.items()):
        stats = _stats(values)
        # a mean below 0 (within seed noise of 0) is stored as 0: a cost is never negative
        costs[key] = {**stats, "mean": max(0.0, stats["mean"]), "raw_mean": stats["mean"]}
        costs[key]["per_seed"] = values
    table = {
        "unit": "% perplexity gap if the whole global batch ran degraded with the set on every "
        "step (a plan costs the sum over its degraded tasks of cost x share of the global batch)",
        "costs": costs,
        "recompute": "exact (bit-identical gradients, tested): a set costs what it costs "
        "without recompute",
        "measured": {
            "command": report["command"],
            "date": report["date"],
            "corpus": args.corpus,
            "model": args.model,
            "num_layers": args.num_layers,
            "replicas": args.replicas,
            "microbatches": args.microbatches,
            "micro_batch_size": args.mbs,
            "steps": args.steps,
            "scenarios": args.scenarios,
            "seeds": args.seeds,
        },
    }
    path = Path(args.accuracy_costs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=2) + "\n")
    print(
        f"wrote the accuracy-cost table {path}: "
        + ", ".join(f"{k} {v['mean']:.2f} +- {v['std']:.2f}" for k, v in costs.items())
    )


def print_table(report: dict, args) -> None:
    seeds = ", ".join(str(s) for s in args.seeds)
    print(
        f"\n{args.corpus}, {args.model}, layers {args.num_layers or 'preset'}, n = "
        f"{args.replicas}, M = {args.microbatches}, mbs {args.mbs}, {args.steps} steps, seeds "
        f"{seeds}; failure-free val loss {report['failure_free']['val_loss']:.4f} (seed "
        f"{args.seeds[0]})"
    )
    print(
        f"{'scenario':<10}{'config':<20}{'ppl gap % (mean +- sd)':>24}{'95% CI':>18}"
        f"{'step x meas':>12}{'step x pred':>12}{'mean x':>8}{'degraded':>10}"
    )
    for r in report["summary"]:
        g, (lo, hi) = r["gap_ppl_pct"], r["ci95"]
        print(
            f"{r['scenario']:<10}{r['config']:<20}{g['mean']:>+14.2f} +- {g['std']:<6.2f}"
            f"{f'[{lo:+.2f}, {hi:+.2f}]':>18}"
            f"{r['step_time_ratio']['mean']:>12.2f}{r['predicted_step_ratio']['mean']:>12.2f}"
            f"{r['mean_predicted_step_ratio']['mean']:>8.2f}"
            f"{100 * r['degraded_fraction']['mean']:>9.1f}%"
        )
