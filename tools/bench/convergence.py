"""Convergence of degraded-mode training against failure-free, and the low-rank basis error.

    python tools/bench/convergence.py --quick                        # demo corpus, ~2 min
    python tools/bench/convergence.py --corpus fortunes --steps 300  # real English text
    python tools/bench/convergence.py --corpus fortunes --basis-error --steps 300

A data-parallel job of n replicas is emulated in one process: each step, the takeover planner makes
every survivor's plan and ONE `Engine.train_step` runs all their micro-batches in their modes with
the plans' scaling (1/n ordinary, M/E attention grads). A SUM all-reduce of per-rank buffers gives
the same gradient (tests/dist/test_mecefo_takeover.py checks the two agree), so the loss curves are
those of the real job; only float summation order differs. Scenarios state the fraction of steps
and of replicas degraded. Reported per configuration: final validation loss, its gap to
failure-free in % of the loss and in perplexity %, and the step-time ratio of the slowest rank's
plan over a normal rank's (measured on this machine: `Engine.train_step`, min of --reps,
configurations interleaved).

`--basis-error`: trains failure-free (exact) for --steps, then on held-out micro-batches compares
each FFN weight gradient G with its rank-r projection G V V^T (what the low-rank gradient equals
with the attention skip off; pinned by tests) for V = weight_svd, activation (statistics collected
during training), random, and the best possible (top singular vectors of G itself).

Corpora: `demo` (the embedded synthetic corpus) or `fortunes`: English text from Debian's
`fortunes` package (`apt-get install fortunes`, /usr/share/games/fortunes), one fortune per
document, tokenized with a 512-piece sentencepiece model (tools/preprocess_data.py).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tools" / "bench"))

from bench_common import (  # noqa: E402 - after the path fix
    bench_parser,
    fastest_of_rounds,
    init_torch,
    save_json,
    write_json,
)
from convergence_basis import basis_error, grad_error, summarize_basis  # noqa: E402
from convergence_corpus import corpus_overrides  # noqa: E402
from convergence_engine import CONFIGS, SCENARIOS, load_or_calibrate, time_plan, train  # noqa: E402
from convergence_summary import (  # noqa: E402
    _default_skip_layers,
    markdown_table,
    print_table,
    summarize,
    write_accuracy_costs,
    write_proxy_costs,
)


def parse_args() -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--corpus", choices=["demo", "fortunes", "kjv"], default="demo")
    p.add_argument("--model", default="tiny", help="model preset")
    p.add_argument("--num-layers", type=int, default=None, help="override the preset's layers")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--replicas", type=int, default=4, help="n (the scenarios assume 4)")
    p.add_argument("--mbs", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4, help="M per replica")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=None, help="training.seed (init and data order)")
    p.add_argument(
        "--seeds",
        type=int,
        nargs="*",
        default=None,
        help="several training seeds: each runs failure-free and every config; gaps are paired "
        "per seed and reported as mean and spread",
    )
    p.add_argument(
        "--objective", choices=["accuracy", "time"], default="accuracy", help="hybrid objective"
    )
    p.add_argument(
        "--budget", type=float, default=1.0, help="hybrid objective=time: accuracy budget"
    )
    p.add_argument(
        "--accuracy-table",
        default="",
        help="accuracy-cost JSON hybrid plans with (default: the one shipped with the package)",
    )
    p.add_argument(
        "--accuracy-costs",
        default=None,
        metavar="OUT.json",
        help="write the measured accuracy cost of each run's technique set (neighbor-policy "
        "configs: gap in ppl %% / mean degraded share of the global batch, over the seeds) to "
        "OUT.json, the table the planner reads (megatron_mecefo/plan/accuracy_costs.json)",
    )
    p.add_argument(
        "--cost-model",
        default=None,
        metavar="PATH.json",
        help="the planner's cost model: loaded from PATH if it exists, else calibrated and saved "
        "there, so several runs (seeds, corpora) plan with the same measured times",
    )
    p.add_argument(
        "--calib-reps", type=int, default=5, help="calibration: timed rounds (min of each)"
    )
    p.add_argument(
        "--skip-layers",
        nargs="*",
        default=[],
        help="extra neighbor configs skipping attention backward only in these layers "
        "(mecefo.skip_attention_layers values, e.g. last:4 first:2 every:2)",
    )
    p.add_argument("--scenarios", nargs="*", default=list(SCENARIOS))
    p.add_argument(
        "--configs",
        nargs="*",
        default=None,
        help="subset of: neighbor spread hybrid no_skip no_recompute no_lowrank weight_svd",
    )
    p.add_argument("--target-ratio", type=float, default=1.15, help="hybrid's step-time bound")
    p.add_argument("--reps", type=int, default=3, help="timed steps per configuration (min)")
    p.add_argument("--eval-microbatches", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--basis-error", action="store_true", help="measure the low-rank basis error")
    p.add_argument(
        "--grad-error",
        action="store_true",
        help="the accuracy-cost proxy: after --steps failure-free steps, the relative squared "
        "error of the reduced step gradient when the neighbour plan (replica 1 dead) runs the "
        "covering rank's micro-batches degraded with each technique set, over --grad-batches "
        "unseen batches",
    )
    p.add_argument("--grad-batches", type=int, default=8, help="--grad-error: batches averaged")
    p.add_argument(
        "--proxy-costs",
        nargs="+",
        default=None,
        metavar="GRAD_JSON",
        help="with --accuracy-costs OUT and --accuracy-table ANCHOR (a table measured by "
        "convergence runs): write the table whose costs are the --grad-error proxy of each set "
        "(mean over the given runs) scaled so that the anchor's best-measured set keeps its "
        "cost, with the proxy's prediction for every measured set beside its convergence 95%% CI",
    )
    p.add_argument(
        "--proxy-skip-layers",
        default="all",
        help="--proxy-costs: the skip_attention_layers setting the table is for (its sets with "
        "the skip take the proxy measured at that setting, `--grad-error --skip-layers SPEC`)",
    )
    p.add_argument("--rank", type=float, default=0.125, help="basis-error rank (fraction)")
    p.add_argument("--quick", action="store_true", help="demo corpus, 60 steps, 2 configs")
    p.add_argument(
        "--table",
        nargs="+",
        default=None,
        metavar="JSON",
        help="print a markdown table (mean, sd, 95%% CI of the perplexity gap over seeds; step "
        "ratios) from the JSONs of earlier runs, then exit",
    )
    p.add_argument("--demo-dir", default=".cache/demo_data")
    p.add_argument("--corpus-dir", default=".cache/fortunes_data")
    p.add_argument("--kjv-dir", default=".cache/kjv_data")
    p.add_argument("--out", default="bench_out/convergence.json")
    args = p.parse_args()
    if args.seeds is None:
        args.seeds = [args.seed]
    elif args.seed is not None:
        p.error("give --seed or --seeds, not both")
    for spec in args.skip_layers:
        CONFIGS[f"skip@{spec}"] = ("neighbor", [f"mecefo.skip_attention_layers={spec}"])
        if args.configs is not None:
            args.configs.append(f"skip@{spec}")
    unknown = sorted(set(args.configs or ()) - set(CONFIGS))
    if unknown:
        p.error(f"unknown config(s) {unknown}; choose from {sorted(CONFIGS)}")
    if args.quick:
        args.corpus, args.steps, args.reps = "demo", 60, 2
        args.configs = args.configs or ["neighbor", "hybrid"]
        args.scenarios = ["moderate"]
    return args


def main() -> int:
    if "--proxy-costs" in sys.argv:
        args = parse_args()
        if not (args.accuracy_costs and args.accuracy_table):
            raise SystemExit("error: --proxy-costs needs --accuracy-costs OUT and --accuracy-table")
        command = "python tools/bench/convergence.py " + " ".join(sys.argv[1:])
        write_proxy_costs(
            args.proxy_costs,
            args.accuracy_table,
            args.accuracy_costs,
            command,
            args.proxy_skip_layers,
        )
        return 0
    if "--table" in sys.argv:
        args = parse_args()
        try:
            print(markdown_table(args.table))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    args = parse_args()
    from megatron_mecefo.plan import load_accuracy_costs

    ctx = init_torch(args.threads)
    args.data_overrides = corpus_overrides(args)
    report = {
        "args": {k: v for k, v in vars(args).items() if k != "data_overrides"},
        "skip_attention_layers": _default_skip_layers(),
        "command": "python tools/bench/convergence.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if args.basis_error:
        args.seed = args.seeds[0]
        rows = basis_error(args, ctx)
        report["basis_error"] = {"rows": rows, "mean": summarize_basis(rows)}
        print(f"\nrelative FFN weight-gradient error at r = {args.rank} of the input dim:")
        for linear, vals in report["basis_error"]["mean"].items():
            print(f"  {linear:<4} " + "  ".join(f"{k} {v:.3f}" for k, v in vals.items()))
        return write_json(report, args.out)
    if args.grad_error:
        args.seed = args.seeds[0]
        report["grad_error"] = grad_error(args, ctx)
        return write_json(report, args.out)
    accuracy = load_accuracy_costs(args.accuracy_table or None)
    report["accuracy_table"] = {"source": accuracy.source, "costs": dict(accuracy.costs)}
    args.seed = args.seeds[0]
    cost = load_or_calibrate(args, ctx)
    report["cost_model"] = vars(cost)
    print(
        f"cost model (separate calibration steps): exact {cost.exact_microbatch_s * 1e3:.1f} ms, "
        f"degraded {cost.degraded_microbatch_s * 1e3:.1f} ms, overhead "
        f"{cost.step_overhead_s * 1e3:.1f} ms; per technique set (ms): "
        + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in cost.technique_microbatch_s),
        flush=True,
    )
    normal_plan = _normal_plan(args)
    normal_s = cost.step_time(args.microbatches, 0)
    rows, by_seed = [], {}
    for seed in args.seeds:
        args.seed = seed
        print(f"failure-free (seed {seed}):", flush=True)
        base = train(args, ctx, None, "spread", [], cost, accuracy)
        by_seed[str(seed)] = {"val_loss": base["val_loss"], "loss_curve": base["loss_curve"]}
        for scenario in args.scenarios:
            for name in args.configs or list(CONFIGS):
                policy, overrides = CONFIGS[name]
                print(f"{scenario} / {name} (seed {seed}):", flush=True)
                run = train(args, ctx, scenario, policy, overrides, cost, accuracy)
                rows.append(_row(args, run, base, scenario, name, normal_plan, normal_s, seed))
                del run
                # after every run, so that a run cut short leaves what it measured
                _write_partial(report, by_seed, rows, args)
    first = by_seed[str(args.seeds[0])]
    report["failure_free"] = {**first, "by_seed": by_seed}
    report["rows"] = rows
    report["complete"] = True
    report["summary"] = summarize(rows)
    print_table(report, args)
    if args.accuracy_costs:
        write_accuracy_costs(report, args)
    return write_json(report, args.out)


def _write_partial(report: dict, by_seed: dict, rows: list[dict], args) -> None:
    first = by_seed[str(args.seeds[0])]
    partial = {**report, "failure_free": {**first, "by_seed": by_seed}, "rows": rows}
    partial["complete"] = False
    save_json(partial, args.out)


def _row(args, run, base, scenario, name, normal_plan, normal_s, seed) -> dict:
    policy, overrides = CONFIGS[name]
    engine, slow = run["engine"], run["slowest_plan"]
    # interleaved A/B on the trained engine, after a warm-up step of each (the first step at a
    # new tau-bucket refreshes V)
    best = fastest_of_rounds(
        lambda p, step: time_plan(engine, p, 1), {"normal": normal_plan, "slow": slow}, args.reps
    )
    t_normal, t_slow = best["normal"], best["slow"]
    gap = run["val_loss"] - base["val_loss"]
    row = {
        "scenario": scenario,
        "config": name,
        "policy": policy,
        "overrides": overrides,
        "seed": seed,
        "techniques": run["techniques"],
        "val_loss": run["val_loss"],
        "failure_free_val_loss": base["val_loss"],
        "gap_loss_pct": 100 * gap / base["val_loss"],
        "gap_ppl_pct": 100 * (math.exp(gap) - 1),
        "steps_with_degraded": run["steps_with_degraded"],
        "degraded_fraction": run["degraded_fraction"],
        "slowest_rank": {
            "microbatches": round(slow.microbatch_equivalents, 3),
            "degraded": slow.num_degraded,
        },
        "step_time_ratio": t_slow / t_normal,
        "predicted_step_ratio": run["slowest_predicted_s"] / normal_s,
        # time cost of the failure: mean over the steps with a dead replica
        "mean_predicted_step_ratio": run["mean_failure_step_s"] / normal_s,
        "loss_curve": run["loss_curve"],
    }
    print(
        f"  val {row['val_loss']:.4f} (failure-free {base['val_loss']:.4f}): gap "
        f"{row['gap_loss_pct']:+.2f}% loss, {row['gap_ppl_pct']:+.2f}% ppl; slowest rank "
        f"{slow.microbatch_equivalents:.2f} mb ({slow.num_degraded} degraded) "
        f"{row['step_time_ratio']:.2f}x measured, {row['predicted_step_ratio']:.2f}x predicted "
        f"(mean over failure steps {row['mean_predicted_step_ratio']:.2f}x); "
        f"{100 * row['degraded_fraction']:.1f}% of the work degraded",
        flush=True,
    )
    return row


def _normal_plan(args):
    from megatron_mecefo.plan import failure_free_plan

    return failure_free_plan(0, args.replicas, args.microbatches)


if __name__ == "__main__":
    sys.exit(main())
