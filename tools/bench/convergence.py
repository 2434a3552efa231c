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
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tools" / "bench"))

FORTUNES_DIR = Path("/usr/share/games/fortunes")

# name -> (description, [(start fraction, end fraction, dead replicas)]) for n = 4 replicas
SCENARIOS = {
    "moderate": ("1 of 4 dead for 25% of steps", [(0.25, 0.50, (1,))]),
    "harsh": (
        "1-2 of 4 dead for 75% of steps",
        [(0.10, 0.30, (1,)), (0.30, 0.60, (1, 3)), (0.60, 0.85, (3,))],
    ),
}
TECHNIQUES = ("skip_attention_backward", "recompute_ffn", "lowrank_ffn_grad")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--corpus", choices=["demo", "fortunes"], default="demo")
    p.add_argument("--model", default="tiny", help="model preset")
    p.add_argument("--num-layers", type=int, default=None, help="override the preset's layers")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--replicas", type=int, default=4, help="n (the scenarios assume 4)")
    p.add_argument("--mbs", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4, help="M per replica")
    p.add_argument("--lr", type=float, default=3e-3)
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
    p.add_argument("--rank", type=float, default=0.125, help="basis-error rank (fraction)")
    p.add_argument("--quick", action="store_true", help="demo corpus, 60 steps, 2 configs")
    p.add_argument("--demo-dir", default=".cache/demo_data")
    p.add_argument("--corpus-dir", default=".cache/fortunes_data")
    p.add_argument("--out", default="bench_out/convergence.json")
    args = p.parse_args()
    if args.quick:
        args.corpus, args.steps, args.reps = "demo", 60, 2
        args.configs = args.configs or ["neighbor", "hybrid"]
        args.scenarios = ["moderate"]
    return args


# ---------------------------------------------------------------------------------- corpus
def prepare_fortunes(corpus_dir: str) -> list[str]:
    """Write the fortunes as one document per line, index them; return data overrides."""
    out = Path(corpus_dir)
    prefix = out / "fortunes"
    if not (out / "fortunes.idx").exists():
        if not FORTUNES_DIR.is_dir():
            raise SystemExit(
                f"error: {FORTUNES_DIR} not found: install Debian's fortunes package "
                "(apt-get install fortunes) or use --corpus demo"
            )
        docs = []
        for path in sorted(FORTUNES_DIR.iterdir()):
            if path.suffix or not path.is_file():  # skip .dat / .u8 index files and links
                continue
            text = path.read_text(encoding="utf-8", errors="ignore")
            docs += [" ".join(d.split()) for d in text.split("\n%\n") if d.strip()]
        out.mkdir(parents=True, exist_ok=True)
        (out / "fortunes.txt").write_text("\n".join(docs) + "\n", encoding="utf-8")
        from preprocess_data import main as preprocess_main

        code = preprocess_main(
            [
                "--input",
                str(out / "fortunes.txt"),
                "--output-prefix",
                str(prefix),
                "--vocab-size",
                "512",
                "--quiet",
            ]
        )
        if code:
            raise SystemExit(f"error: preprocessing the fortunes corpus failed ({code})")
        print(f"fortunes corpus: {len(docs)} documents -> {prefix}.bin/.idx", flush=True)
    return [f"data.path={prefix}", f"data.tokenizer_model={prefix}.model"]


# ---------------------------------------------------------------------------------- engine
def build(args, ctx, overrides: list[str]):
    from bench_engine import build_bench_engine

    extra = [
        f"training.lr={args.lr}",
        f"training.min_lr={args.lr / 10}",
        f"training.lr_decay_steps={args.steps}",
        "training.warmup_steps=20",
        f"training.eval_microbatches={args.eval_microbatches}",
    ]
    if args.num_layers:
        extra.append(f"model.num_layers={args.num_layers}")
    return build_bench_engine(
        ctx,
        args.model,
        demo_dir=args.demo_dir,
        micro_batch_size=args.mbs,
        num_microbatches=args.microbatches,
        max_steps=args.steps * args.replicas,  # the sampler serves n replicas from one process
        overrides=[*args.data_overrides, *extra, *overrides],
    )


def union_plan(plans: dict):
    """All survivors' tasks as one plan with the group's scaling (same SUM-reduced gradient)."""
    from megatron_mecefo.plan import RankStepPlan

    first = next(iter(plans.values()))
    return RankStepPlan(
        tasks=tuple(t for r in sorted(plans) for t in plans[r].tasks),
        num_replicas=first.num_replicas,
        microbatches_per_replica=first.microbatches_per_replica,
        masked_scale=first.masked_scale,
    )


def dead_at(scenario: str | None, step: int, steps: int) -> tuple[int, ...]:
    if scenario is None:
        return ()
    for start, end, dead in SCENARIOS[scenario][1]:
        if start * steps <= step < end * steps:
            return dead
    return ()


CONFIGS = {
    # name -> (policy, mecefo overrides)
    "neighbor": ("neighbor", []),
    "spread": ("spread", []),
    "hybrid": ("hybrid", []),
    "no_skip": ("neighbor", ["mecefo.skip_attention_backward=false"]),
    "no_recompute": ("neighbor", ["mecefo.recompute_ffn=false"]),
    "no_lowrank": ("neighbor", ["mecefo.lowrank_ffn_grad=false"]),
    "weight_svd": ("neighbor", ["mecefo.lowrank_basis=weight_svd"]),
}


def train(args, ctx, scenario, policy, overrides, cost) -> dict:
    """One emulated n-replica run; returns the curve, final val loss and the slowest plans."""
    from megatron_mecefo.plan import make_step_plans
    from megatron_mecefo.plan.takeover import plan_step_times

    engine = build(args, ctx, overrides)
    n, m = args.replicas, args.microbatches
    curve, degraded_steps, slowest = [], 0, None
    start = time.perf_counter()
    for step in range(args.steps):
        dead = dead_at(scenario, step, args.steps)
        alive = [r for r in range(n) if r not in dead]
        plans = make_step_plans(
            alive=alive,
            num_replicas=n,
            num_microbatches=m,
            policy=policy,
            cost=cost,
            target_ratio=args.target_ratio,
        )
        if dead:
            times = plan_step_times(plans, cost)
            worst = plans[max(times, key=times.get)]
            key = (len(worst.tasks), worst.num_degraded)
            if slowest is None or key > (len(slowest.tasks), slowest.num_degraded):
                slowest = worst
            degraded_steps += any(p.num_degraded for p in plans.values())
        result = engine.train_step(step, union_plan(plans))
        curve.append(result.loss)
        if (step + 1) % max(1, args.steps // 5) == 0:
            print(
                f"    step {step + 1}/{args.steps} loss {result.loss:.4f} "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    val = engine.evaluate()
    return {
        "engine": engine,
        "loss_curve": curve,
        "val_loss": val,
        "slowest_plan": slowest,
        "steps_with_degraded": degraded_steps,
    }


def time_plan(engine, plan, reps: int) -> float:
    best = math.inf
    for _ in range(reps):
        best = min(best, engine.train_step(10**6, plan).step_time_s)
    return best


def calibrate(args, ctx):
    """Cost model from separate calibration steps (not the runs it is used for)."""
    from megatron_mecefo.plan import CostModel, MicroBatchTask, RankStepPlan

    engine = build(args, ctx, [])
    m = args.microbatches

    def plan(flags):
        tasks = tuple(MicroBatchTask(i // m, i % m, f) for i, f in enumerate(flags))
        return RankStepPlan(tasks=tasks, num_replicas=2, microbatches_per_replica=m)

    t = {
        k: time_plan(engine, plan(f), args.reps + 2)
        for k, f in (
            ("exact", [False] * m),
            ("double", [False] * (2 * m)),
            ("mixed", [False] * m + [True] * m),
        )
    }
    exact_mb = max(1e-9, (t["double"] - t["exact"]) / m)
    degraded_mb = max(1e-9, min(exact_mb, (t["mixed"] - t["exact"]) / m))
    overhead = max(t["exact"] - m * exact_mb, -0.5 * exact_mb)
    return CostModel.from_measured(
        exact_microbatch_s=exact_mb, degraded_microbatch_s=degraded_mb, step_overhead_s=overhead
    )


# ---------------------------------------------------------------------------------- basis error
def basis_error(args, ctx) -> list[dict]:
    """Relative FFN weight-gradient error ||G - G V V^T|| / ||G|| per basis, after training."""
    import torch

    from megatron_mecefo.mecefo.lowrank import top_right_singular_vectors
    from megatron_mecefo.plan import MicroBatchTask, RankStepPlan

    run = train(args, ctx, None, "spread", ["mecefo.lowrank_basis=activation"], None)
    engine = run["engine"]
    print(f"  trained {args.steps} exact steps: val loss {run['val_loss']:.4f}", flush=True)
    layers = [layer for _, layer in engine.controller._layers]
    gen = torch.Generator().manual_seed(0)
    rows = []
    m = args.microbatches
    for batch_index in range(args.eval_microbatches // m):  # held out: the validation split
        engine.ddp.zero_grad_buffer()
        tasks = tuple(MicroBatchTask(0, batch_index * m + i) for i in range(m))
        plan = RankStepPlan(tasks=tasks, num_replicas=1, microbatches_per_replica=m)
        _accumulate_grads(engine, plan)
        for index, layer in enumerate(layers):
            hooks = layer.mecefo_hooks
            for label, weight, cache in (
                ("fc1", layer.mlp.linear_fc1.weight, hooks.v1_cache),
                ("fc2", layer.mlp.linear_fc2.weight, hooks.v2_cache),
            ):
                g = weight.main_grad.detach().double()
                n_in = g.shape[1]
                r = max(1, min(n_in, round(args.rank * n_in) if args.rank < 1 else int(args.rank)))
                bases = {
                    "weight_svd": top_right_singular_vectors(weight.detach(), r).double(),
                    "activation": top_right_singular_vectors(cache.stats.moment, r).double(),
                    "random": torch.linalg.qr(torch.randn(n_in, r, generator=gen).double())[0],
                    "best (SVD of G)": top_right_singular_vectors(g, r),
                }
                row = {"batch": batch_index, "layer": index, "linear": label, "rank": r}
                for name, v in bases.items():
                    row[name] = float((g - g @ v @ v.T).norm() / g.norm())
                rows.append(row)
    return rows


def _accumulate_grads(engine, plan) -> None:
    """Forward/backward of validation micro-batches into main_grad, no reduction, no update."""
    import functools

    from megatron_mecefo.mcore import stack

    sampler = engine.valid_sampler
    fwd = functools.partial(engine._forward_step, sampler=sampler, step=0, loss_scale=1.0)
    saved = engine.tcfg.finalize_model_grads_func
    engine.tcfg.finalize_model_grads_func = None
    try:
        stack.forward_backward(
            engine.ddp,
            fwd,
            iter(plan.tasks),
            num_microbatches=len(plan.tasks),
            seq_length=engine.cfg.model.seq_length,
            micro_batch_size=engine.cfg.training.micro_batch_size,
        )
    finally:
        engine.tcfg.finalize_model_grads_func = saved
        engine.controller.set_degraded(False)


def summarize_basis(rows: list[dict]) -> dict:
    keys = ["weight_svd", "activation", "random", "best (SVD of G)"]
    out = {}
    for linear in ("fc1", "fc2", "all"):
        sel = [r for r in rows if linear == "all" or r["linear"] == linear]
        out[linear] = {k: sum(r[k] for r in sel) / len(sel) for k in keys}
    return out


# ---------------------------------------------------------------------------------- main
def main() -> int:
    args = parse_args()
    import torch

    from megatron_mecefo.mcore.config import ParallelConfig
    from megatron_mecefo.mcore.parallel import init_parallel

    torch.set_num_threads(args.threads)
    args.data_overrides = prepare_fortunes(args.corpus_dir) if args.corpus == "fortunes" else []
    ctx = init_parallel(ParallelConfig())
    report = {"args": {k: v for k, v in vars(args).items() if k != "data_overrides"}}
    if args.basis_error:
        rows = basis_error(args, ctx)
        report["basis_error"] = {"rows": rows, "mean": summarize_basis(rows)}
        print(f"\nrelative FFN weight-gradient error at r = {args.rank} of the input dim:")
        for linear, vals in report["basis_error"]["mean"].items():
            print(f"  {linear:<4} " + "  ".join(f"{k} {v:.3f}" for k, v in vals.items()))
        return _write(report, args.out)
    cost = calibrate(args, ctx)
    report["cost_model"] = vars(cost)
    print(
        f"cost model (separate calibration steps): exact {cost.exact_microbatch_s * 1e3:.1f} ms, "
        f"degraded {cost.degraded_microbatch_s * 1e3:.1f} ms, overhead "
        f"{cost.step_overhead_s * 1e3:.1f} ms",
        flush=True,
    )
    print("failure-free:", flush=True)
    base = train(args, ctx, None, "spread", [], cost)
    report["failure_free"] = {"val_loss": base["val_loss"], "loss_curve": base["loss_curve"]}
    normal_plan = _normal_plan(args)
    rows = []
    for scenario in args.scenarios:
        for name in args.configs or list(CONFIGS):
            policy, overrides = CONFIGS[name]
            print(f"{scenario} / {name}:", flush=True)
            run = train(args, ctx, scenario, policy, overrides, cost)
            engine, slow = run["engine"], run["slowest_plan"]
            t_normal = t_slow = math.inf
            for _ in range(args.reps):  # interleaved A/B on the trained engine
                t_normal = min(t_normal, time_plan(engine, normal_plan, 1))
                t_slow = min(t_slow, time_plan(engine, slow, 1))
            gap = run["val_loss"] - base["val_loss"]
            row = {
                "scenario": scenario,
                "config": name,
                "policy": policy,
                "overrides": overrides,
                "val_loss": run["val_loss"],
                "gap_loss_pct": 100 * gap / base["val_loss"],
                "gap_ppl_pct": 100 * (math.exp(gap) - 1),
                "steps_with_degraded": run["steps_with_degraded"],
                "slowest_rank": {"microbatches": len(slow.tasks), "degraded": slow.num_degraded},
                "step_time_ratio": t_slow / t_normal,
                "loss_curve": run["loss_curve"],
            }
            rows.append(row)
            print(
                f"  val {row['val_loss']:.4f} (failure-free {base['val_loss']:.4f}): gap "
                f"{row['gap_loss_pct']:+.2f}% loss, {row['gap_ppl_pct']:+.2f}% ppl; slowest "
                f"rank {len(slow.tasks)} mb ({slow.num_degraded} degraded) "
                f"{row['step_time_ratio']:.2f}x",
                flush=True,
            )
            del engine, run
    report["rows"] = rows
    print_table(report, args)
    return _write(report, args.out)


def _normal_plan(args):
    from megatron_mecefo.plan import failure_free_plan

    return failure_free_plan(0, args.replicas, args.microbatches)


def print_table(report: dict, args) -> None:
    print(
        f"\n{args.corpus}, {args.model}, n = {args.replicas}, M = {args.microbatches}, "
        f"{args.steps} steps; failure-free val loss {report['failure_free']['val_loss']:.4f}"
    )
    print(f"{'scenario':<10}{'config':<14}{'val':>8}{'loss %':>9}{'ppl %':>9}{'step x':>8}")
    for r in report["rows"]:
        print(
            f"{r['scenario']:<10}{r['config']:<14}{r['val_loss']:>8.4f}{r['gap_loss_pct']:>+9.2f}"
            f"{r['gap_ppl_pct']:>+9.2f}{r['step_time_ratio']:>8.2f}"
        )


def _write(report: dict, out: str) -> int:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
