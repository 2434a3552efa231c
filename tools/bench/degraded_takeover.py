"""The takeover benchmark: per-rank step time and peak activation memory of a normal rank, naive
Neighbor-Do-Both, the MeCeFO neighbour and the slowest rank of `spread`, `hybrid` and `hybrid_auto`,
each against the planner's out-of-sample prediction (a cost model calibrated on held-out task lists
or read from an earlier run), plus the exact-mode hook overhead and the V refresh time.

Imported by `degraded.py`, which puts `tools/bench` and the repository on `sys.path`."""

from __future__ import annotations

import json
from pathlib import Path

from degraded_rank import EngineRank, result_head, timed, timed_round_robin


def bench_model(name: str, args, ctx) -> dict:
    from megatron_mecefo.plan import make_step_plans
    from megatron_mecefo.plan.takeover import plan_step_times

    m, reps = args.microbatches, args.reps
    rank = EngineRank(name, args, ctx)
    model_cfg = rank.model_cfg
    cost, calibration = load_or_calibrate(name, args, ctx)
    print(
        f"{name}: {model_cfg.num_layers} layers, d={model_cfg.hidden_size}, "
        f"f={model_cfg.ffn_hidden_size}, s={model_cfg.seq_length}, mbs={args.mbs}, M={m}"
    )
    # scenario label -> (flags, n, predicted seconds)
    scenarios = {
        "normal": ([False] * m, None, cost.step_time(m, 0)),
        "ndb_naive": ([False] * (2 * m), None, cost.step_time(2 * m, 0)),
        "mecefo_neighbor": ([True] * (2 * m), None, cost.step_time(0, 2 * m)),
    }
    for n in args.replicas:
        alive = list(range(1, n))  # replica 0 dead
        for policy in ("spread", "hybrid", "hybrid_auto"):
            plans = make_step_plans(
                alive=alive,
                num_replicas=n,
                num_microbatches=m,
                policy=policy.removesuffix("_auto"),
                cost=cost,
                target_ratio=args.target_ratio,
                choose_techniques=policy == "hybrid_auto",
                allowed_techniques=rank.engine.cfg.mecefo.techniques,
            )
            times = plan_step_times(plans, cost)
            slowest = max(times, key=times.get)
            flags = [t.techniques or t.degraded for t in plans[slowest].tasks]
            scenarios[f"{policy} n={n}"] = (flags, n, times[slowest])
    step_s = timed_round_robin(rank, {k: v[0] for k, v in scenarios.items()}, reps)
    rows = []
    for label, (flags, n, predicted) in scenarios.items():
        mem = max(rank.peak_activation_bytes(f) for f in set(flags))
        used = sorted({f.key for f in flags if not isinstance(f, bool)})
        rows.append(
            {
                "scenario": label.split()[0],
                "n": n,
                "microbatches": len(flags),
                "degraded": sum(map(bool, flags)),
                "techniques": used or None,
                "step_s": step_s[label],
                "predicted_s": predicted,
                "peak_activation_bytes": mem,
            }
        )
    normal = rows[0]["step_s"]
    for row in rows:
        row["ratio"] = row["step_s"] / normal
        row["predicted_ratio"] = row["predicted_s"] / cost.step_time(m, 0)
        row["prediction_error"] = row["predicted_s"] / row["step_s"] - 1.0  # out of sample
        row["memory_ratio"] = row["peak_activation_bytes"] / rows[0]["peak_activation_bytes"]
    # exact-mode overhead of the hooks: hooked vs un-hooked model, same task list
    plain = EngineRank(name, args, ctx, hooked=False)
    t_plain = t_hooked = float("inf")
    for _ in range(reps):  # interleaved A/B so drifting load hits both alike
        t_plain = min(t_plain, timed(plain, [False] * m, 1))
        t_hooked = min(t_hooked, timed(rank, [False] * m, 1))
    del plain
    svd_s = refresh_time(rank, rank.engine.cfg.mecefo.tau)
    return {
        **result_head(name, model_cfg, args, ctx),
        "cost_model": {**vars(cost), "technique_microbatch_s": dict(cost.technique_microbatch_s)},
        "calibration": calibration,
        "rows": rows,
        "prediction_error_abs_mean": sum(abs(r["prediction_error"]) for r in rows) / len(rows),
        "exact_mode_overhead": t_hooked / t_plain - 1.0,
        "svd_refresh_s": svd_s,
    }


def load_or_calibrate(name: str, args, ctx):
    """The planner's cost model, never fitted on the steps it predicts.

    With `--calibration FILE` (a degraded.json of an earlier run) it is read from there. Otherwise
    it is calibrated here on a separate engine, on held-out task lists that are not among the
    table's scenarios: M/2 and 3M/2 exact micro-batches (exact marginal cost: the chord), and M/2
    exact + M degraded (degraded marginal cost). Every table row is then a prediction out of
    sample. Each technique set of `--techniques` (and the configured one) gets its own degraded
    marginal cost from M/2 exact + M degraded with that set: the candidates of `hybrid_auto`.
    Returns (CostModel, JSON-able record incl. whether the fallback model was used).
    """
    from megatron_mecefo.plan import CostModel, DegradedTechniques

    if args.calibration:
        data = json.loads(Path(args.calibration).read_text())
        entry = next((r for r in data["models"] if r["model"] == name), None)
        if entry is None:
            raise SystemExit(f"error: {args.calibration} has no cost model for {name}")
        cost = CostModel.from_measured(**entry["cost_model"])
        return cost, {"source": str(args.calibration), "fallback": False}
    m = args.microbatches
    lo, hi = max(1, m // 2), m + max(1, m // 2)
    calib_rank = EngineRank(name, args, ctx)
    configured = calib_rank.engine.cfg.mecefo.techniques
    sets = [DegradedTechniques.from_key(k) for k in args.techniques]
    skipped = [t.key for t in sets if not t.issubset(configured)]
    if skipped:
        print(f"  not calibrated (switched off in mecefo config {configured.key}): {skipped}")
    sets = [configured] + [
        t for t in dict.fromkeys(sets) if t != configured and t.issubset(configured)
    ]
    lists = {"lo": [False] * lo, "hi": [False] * hi}
    lists |= {f"lo_degraded {t.key}": [False] * lo + [t] * m for t in sets}
    calib = timed_round_robin(calib_rank, lists, args.reps)
    calib["lo_degraded"] = calib[f"lo_degraded {configured.key}"]
    del calib_rank
    exact_mb = max(1e-9, (calib["hi"] - calib["lo"]) / (hi - lo))
    degraded_mb = max(1e-9, (calib["lo_degraded"] - calib["lo"]) / m)
    intercept = calib["lo"] - lo * exact_mb
    fallback = intercept + exact_mb <= 0  # noise made the chord absurdly steep
    if fallback:
        print(
            f"  warning: noisy calibration (intercept {intercept * 1e3:.1f} ms); using the "
            "proportional fallback model T = k x per-micro-batch time instead; raise --reps"
        )
        exact_mb, intercept = calib["lo"] / lo, 0.0
        degraded_mb = min(degraded_mb, exact_mb)
    per_set = {t.key: max(1e-9, (calib[f"lo_degraded {t.key}"] - calib["lo"]) / m) for t in sets}
    if fallback:
        per_set = {k: min(v, exact_mb) for k, v in per_set.items()}
    cost = CostModel.from_measured(
        exact_microbatch_s=exact_mb,
        degraded_microbatch_s=degraded_mb,
        step_overhead_s=intercept,
        technique_microbatch_s=per_set,
    )
    record = {
        "source": "held-out task lists on a separate engine",
        "task_lists": {"lo": lo, "hi": hi, "lo_degraded <techniques>": [lo, m]},
        "step_s": calib,
        "fallback": fallback,
    }
    return cost, record


def refresh_time(rank: EngineRank, tau: int) -> float:
    """Seconds to recompute V of every layer (paid by the first degraded step of each tau window):
    a degraded step that crosses into a new window minus the same step inside it."""
    rank.controller.clear_caches()
    with_svd = rank.step([True], step=tau)
    without = min(rank.step([True], step=tau + 1) for _ in range(2))
    return max(0.0, with_svd - without)


def print_table(result: dict) -> None:
    print(
        f"\n{result['model']} ({result['device']}), M={result['microbatches']}; cost model "
        f"exact {result['cost_model']['exact_microbatch_s'] * 1e3:.1f} ms, degraded "
        f"{result['cost_model']['degraded_microbatch_s'] * 1e3:.1f} ms, overhead "
        f"{result['cost_model']['step_overhead_s'] * 1e3:.1f} ms"
    )
    print(
        f"{'scenario':<18}{'n':>4}{'mb':>5}{'degr':>6}{'step ms':>10}{'ratio':>8}"
        f"{'pred (err)':>14}{'act MiB':>10}{'act ratio':>10}  techniques"
    )
    for r in result["rows"]:
        pred = f"{r['predicted_ratio']:.2f} ({r['prediction_error']:+.0%})"
        print(
            f"{r['scenario']:<18}{r['n'] or '-':>4}{r['microbatches']:>5}{r['degraded']:>6}"
            f"{r['step_s'] * 1e3:>10.1f}{r['ratio']:>8.2f}{pred:>14}"
            f"{r['peak_activation_bytes'] / 2**20:>10.2f}{r['memory_ratio']:>10.2f}"
            f"  {','.join(r['techniques'] or []) or '-'}"
        )
    print(
        f"planner's prediction (cost model: {result['calibration']['source']}, fallback "
        f"{result['calibration']['fallback']}): mean |error| "
        f"{result['prediction_error_abs_mean']:.1%} out of sample"
    )
    print(
        f"exact-mode hook overhead: {result['exact_mode_overhead'] * 100:+.1f}% ; "
        f"V refresh of all layers: {result['svd_refresh_s'] * 1e3:.1f} ms every tau steps"
    )
