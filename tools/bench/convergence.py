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

from bench_common import (  # noqa: E402 - after the path fix
    bench_parser,
    fastest_of_rounds,
    init_torch,
    save_json,
    write_json,
)

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
        _preprocess(out, "fortunes", docs)
    return [f"data.path={prefix}", f"data.tokenizer_model={prefix}.model"]


def prepare_kjv(corpus_dir: str) -> list[str]:
    """The King James Bible (Debian's bible-kjv: `bible -f`), one chapter per document."""
    import shutil
    import subprocess

    out = Path(corpus_dir)
    prefix = out / "kjv"
    if not (out / "kjv.idx").exists():
        if shutil.which("bible") is None:
            raise SystemExit(
                "error: the `bible` command was not found: install Debian's bible-kjv package "
                "(apt-get install bible-kjv) or use --corpus demo"
            )
        text = subprocess.run(
            ["bible", "-f", "gen1:1-rev22:21"], capture_output=True, text=True, timeout=120
        ).stdout
        chapters: dict[str, list[str]] = {}
        for line in text.splitlines():
            ref, _, verse = line.partition(" ")
            if verse:
                chapters.setdefault(ref.split(":")[0], []).append(verse.strip())
        docs = [" ".join(v) for v in chapters.values()]
        if len(docs) < 1000:
            raise SystemExit(f"error: `bible -f` gave {len(docs)} chapters, expected 1189")
        _preprocess(out, "kjv", docs)
    return [f"data.path={prefix}", f"data.tokenizer_model={prefix}.model"]


def _preprocess(out: Path, name: str, docs: list[str]) -> None:
    from preprocess_data import main as preprocess_main

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.txt").write_text("\n".join(docs) + "\n", encoding="utf-8")
    code = preprocess_main(
        [
            "--input",
            str(out / f"{name}.txt"),
            "--output-prefix",
            str(out / name),
            "--vocab-size",
            "512",
            "--quiet",
        ]
    )
    if code:
        raise SystemExit(f"error: preprocessing the {name} corpus failed ({code})")
    print(f"{name} corpus: {len(docs)} documents -> {out / name}.bin/.idx", flush=True)


def corpus_overrides(args) -> list[str]:
    if args.corpus == "fortunes":
        return prepare_fortunes(args.corpus_dir)
    if args.corpus == "kjv":
        return prepare_kjv(args.kjv_dir)
    return []


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
    if args.seed is not None:
        extra.append(f"training.seed={args.seed}")
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
        micro_batch_size=next(
            (p.micro_batch_size for p in plans.values() if p.micro_batch_size), None
        ),
    )


def dead_at(scenario: str | None, step: int, steps: int) -> tuple[int, ...]:
    if scenario is None:
        return ()
    for start, end, dead in SCENARIOS[scenario][1]:
        if start * steps <= step < end * steps:
            return dead
    return ()


CONFIGS = {
    # name -> (policy, mecefo overrides); hybrid plans with --objective, --target-ratio, --budget
    "neighbor": ("neighbor", []),
    "spread": ("spread", []),
    "hybrid": ("hybrid", []),
    "hybrid_sample": ("hybrid", ["mecefo.takeover_granularity=sample"]),
    "hybrid_auto": ("hybrid", ["mecefo.hybrid_techniques=auto"]),
    "hybrid_sample_auto": (
        "hybrid",
        ["mecefo.takeover_granularity=sample", "mecefo.hybrid_techniques=auto"],
    ),
    "no_skip": ("neighbor", ["mecefo.skip_attention_backward=false"]),
    "no_recompute": ("neighbor", ["mecefo.recompute_ffn=false"]),
    "no_lowrank": ("neighbor", ["mecefo.lowrank_ffn_grad=false"]),
    "weight_svd": ("neighbor", ["mecefo.lowrank_basis=weight_svd"]),
}


def train(args, ctx, scenario, policy, overrides, cost, accuracy=None) -> dict:
    """One emulated n-replica run; returns the curve, final val loss and the slowest plans."""
    from megatron_mecefo.plan import make_step_plans
    from megatron_mecefo.plan.takeover import plan_step_times

    engine = build(args, ctx, overrides)
    mec = engine.cfg.mecefo
    n, m = args.replicas, args.microbatches
    curve, degraded_steps, slowest, degraded_mbe = [], 0, None, 0.0
    failure_times = []  # predicted slowest-rank time of each step with a dead replica
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
            choose_techniques=mec.hybrid_techniques == "auto",
            allowed_techniques=mec.techniques,
            granularity=mec.takeover_granularity,
            micro_batch_size=args.mbs,
            objective=args.objective,
            accuracy_budget=args.budget,
            accuracy=accuracy,
        )
        if dead:
            times = plan_step_times(plans, cost)
            worst = max(times, key=times.get)
            failure_times.append(times[worst])
            if slowest is None or times[worst] > slowest[1]:
                slowest = (plans[worst], times[worst])
            degraded_steps += any(p.num_degraded for p in plans.values())
            degraded_mbe += sum(
                p.task_fraction(t) for p in plans.values() for t in p.tasks if t.degraded
            )
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
        "slowest_plan": slowest[0] if slowest else None,
        "slowest_predicted_s": slowest[1] if slowest else None,
        "mean_failure_step_s": sum(failure_times) / len(failure_times) if failure_times else None,
        "techniques": mec.techniques.key,
        "steps_with_degraded": degraded_steps,
        # mean share of the global batch that ran degraded, per step of the run
        "degraded_fraction": degraded_mbe / (args.steps * n * m),
    }


def time_plan(engine, plan, reps: int) -> float:
    best = math.inf
    for _ in range(reps):
        best = min(best, engine.train_step(10**6, plan).step_time_s)
    return best


def calibrate(args, ctx):
    """Cost model from separate calibration steps (not the runs it is used for): exact, degraded
    with the configured techniques, and degraded with each subset of them (`hybrid_auto`)."""
    from megatron_mecefo.plan import CostModel, MicroBatchTask, RankStepPlan, candidate_techniques

    engine = build(args, ctx, [])
    m = args.microbatches
    installed = engine.cfg.mecefo.techniques

    def plan(flags, techniques=None):
        tasks = tuple(
            MicroBatchTask(i // m, i % m, f, techniques if f else None) for i, f in enumerate(flags)
        )
        return RankStepPlan(tasks=tasks, num_replicas=2, microbatches_per_replica=m)

    cases = {
        "exact": plan([False] * m),
        "double": plan([False] * (2 * m)),
        "mixed": plan([False] * m + [True] * m),
    }
    for t in candidate_techniques(installed):
        cases[t.key] = plan([False] * m + [True] * m, t)
    best = fastest_of_rounds(  # interleaved, min of each
        lambda p, step: time_plan(engine, p, 1), cases, args.calib_reps, warmup=False
    )
    exact_mb = max(1e-9, (best["double"] - best["exact"]) / m)

    def degraded_mb(key):
        return max(1e-9, (best[key] - best["exact"]) / m)

    overhead = max(best["exact"] - m * exact_mb, -0.5 * exact_mb)
    return CostModel.from_measured(
        exact_microbatch_s=exact_mb,
        degraded_microbatch_s=degraded_mb("mixed"),
        step_overhead_s=overhead,
        technique_microbatch_s={t.key: degraded_mb(t.key) for t in candidate_techniques(installed)},
    )


def load_or_calibrate(args, ctx):
    from megatron_mecefo.plan import CostModel

    path = Path(args.cost_model) if args.cost_model else None
    shape = {k: getattr(args, k) for k in ("model", "num_layers", "microbatches", "mbs")}
    if path is not None and path.exists():
        saved = json.loads(path.read_text())
        if saved.get("shape") != shape:
            raise SystemExit(
                f"error: {path} was calibrated for {saved.get('shape')}, this run is {shape}"
            )
        print(f"cost model from {path}", flush=True)
        return CostModel.from_measured(**saved["cost_model"])
    cost = calibrate(args, ctx)
    if path is not None:
        save_json({"cost_model": vars(cost), "shape": shape}, path)
    return cost


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
        _accumulate_grads(engine, plan.tasks, sampler=engine.valid_sampler, step=0, loss_scale=1.0)
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


def _accumulate_grads(engine, tasks, *, sampler, step: int, loss_scale: float) -> None:
    """Forward/backward of `tasks` (each in its mode) into main_grad: no reduction, no update."""
    import functools

    from megatron_mecefo.mcore import stack

    fwd = functools.partial(engine._forward_step, sampler=sampler, step=step, loss_scale=loss_scale)
    saved = engine.tcfg.finalize_model_grads_func
    engine.tcfg.finalize_model_grads_func = None
    try:
        stack.forward_backward(
            engine.ddp,
            fwd,
            iter(tasks),
            num_microbatches=len(tasks),
            seq_length=engine.cfg.model.seq_length,
            micro_batch_size=engine.cfg.training.micro_batch_size,
        )
    finally:
        engine.tcfg.finalize_model_grads_func = saved
        engine.controller.set_degraded(False)


def grad_error(args, ctx) -> dict:
    """Relative squared error ||g_T - g||^2 / ||g||^2 of the group's reduced gradient g (all
    tasks exact) when the neighbour plan's degraded tasks use technique set T (with its masked
    averaging), on batches the training never saw; per set: mean and sd over batches."""
    from megatron_mecefo.plan import CostModel, candidate_techniques, make_step_plans

    run = train(args, ctx, None, "spread", [], None)
    engine = run["engine"]
    print(f"  trained {args.steps} exact steps: val loss {run['val_loss']:.4f}", flush=True)
    n, m = args.replicas, args.microbatches
    plans = make_step_plans(
        alive=[r for r in range(n) if r != 1],
        num_replicas=n,
        num_microbatches=m,
        policy="neighbor",
        cost=CostModel(),
    )
    tasks = union_plan(plans).tasks
    sets = candidate_techniques(engine.cfg.mecefo.techniques)
    errors = _set_errors(args, engine, tasks, sets)
    for spec in args.skip_layers:  # the sets with the attention skip, in a subset of the layers
        other = build(args, ctx, [f"mecefo.skip_attention_layers={spec}"])
        other.ddp.module.load_state_dict(engine.ddp.module.state_dict())  # the trained weights
        skipping = [t for t in sets if t.skip_attention_backward]
        for key, values in _set_errors(args, other, tasks, skipping).items():
            errors[f"{key}@{spec}"] = values
        del other
    share = sum(x.degraded for x in tasks) / (n * m)
    out = {"degraded_share": share, "val_loss": run["val_loss"], "sets": {}}
    for key, values in errors.items():
        out["sets"][key] = _stats(values)
        print(f"  {key:<24} relative squared gradient error {_stats(values)['mean']:.4f}")
    return out


def _set_errors(args, engine, tasks, sets) -> dict[str, list[float]]:
    """Per technique set, the relative squared gradient error on each unseen batch."""
    from megatron_mecefo.plan import MicroBatchTask

    n, m = args.replicas, args.microbatches
    exact = tuple(MicroBatchTask(t.source_dp_rank, t.micro_index) for t in tasks)
    errors: dict[str, list[float]] = {t.key: [] for t in sets}
    for k in range(args.grad_batches):
        step = args.steps + k  # past the trained steps: unseen data
        reference = _reduced_grad(engine, exact, n, m, step)
        for t in sets:
            plan_tasks = tuple(
                MicroBatchTask(x.source_dp_rank, x.micro_index, True, t) if x.degraded else x
                for x in tasks
            )
            computing = sum(not x.skips_attention for x in plan_tasks)
            masked = m / computing if t.skip_attention_backward and computing else None
            g = _reduced_grad(engine, plan_tasks, n, m, step, masked)
            errors[t.key].append(float((g - reference).pow(2).sum() / reference.pow(2).sum()))
    return errors


def _reduced_grad(engine, tasks, n, m, step, masked_scale=None):
    """The SUM-reduced gradient of `tasks` with the plan scaling (ordinary 1/n, masked
    parameters `masked_scale`), flattened; no optimizer step."""
    import torch

    from megatron_mecefo.plan import RankStepPlan

    engine.ddp.zero_grad_buffer()
    plan = RankStepPlan(tasks=tuple(tasks), num_replicas=n, microbatches_per_replica=m)
    sampler = engine._sampler_for(plan)  # serves all n replicas' micro-batches
    _accumulate_grads(engine, tasks, sampler=sampler, step=step, loss_scale=1.0 / m)
    parts = []
    for name, param in engine.ddp.module.named_parameters():
        scale = 1.0 / n
        if masked_scale is not None and engine.controller.is_masked_param(name):
            scale = masked_scale
        parts.append(param.main_grad.detach().double().flatten() * scale)
    return torch.cat(parts)


def summarize_basis(rows: list[dict]) -> dict:
    keys = ["weight_svd", "activation", "random", "best (SVD of G)"]
    out = {}
    for linear in ("fc1", "fc2", "all"):
        sel = [r for r in rows if linear == "all" or r["linear"] == linear]
        out[linear] = {k: sum(r[k] for r in sel) / len(sel) for k in keys}
    return out


# ---------------------------------------------------------------------------------- main
def _ratio(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


def _default_skip_layers() -> str:
    """The skip-layer setting the runs' configs get unless a config overrides it."""
    from megatron_mecefo.mecefo import MecefoConfig

    return MecefoConfig().skip_attention_layers


def markdown_table(paths: list[str]) -> str:
    """One row per (run, scenario, config) of the given convergence JSONs."""
    lines = [
        "| corpus | layers | skip layers | M | scenario | config | seeds | ppl gap % (mean +- sd) "
        "| 95% CI "
        "| beyond noise | slowest step x (pred.) | mean step x over failure steps (pred.) "
        "| degraded share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path in paths:
        report = json.loads(Path(path).read_text())
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
        print(markdown_table(args.table))
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


def _normal_plan(args):
    from megatron_mecefo.plan import failure_free_plan

    return failure_free_plan(0, args.replicas, args.microbatches)


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


if __name__ == "__main__":
    sys.exit(main())
