"""`mecefo-sim`: SPARe closed forms, strategy simulation, planner, paper table, replay and plots.

Argument parsing and printing only; the work is in the library modules. A user error (bad flag, bad
file, bad value) prints one `error: ...` line and exits with ExitCode.CONFIG_ERROR, never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from megatron_mecefo.errors import ConfigError, ExitCode, MecefoError
from megatron_mecefo.sim import events as events_mod
from megatron_mecefo.sim import paper, plots, spare
from megatron_mecefo.sim.failures import FailureProcess
from megatron_mecefo.sim.layout import DEFAULT_STATE_GBPS, ReplicaLayout, from_run_config
from megatron_mecefo.sim.planner import PlanConfig, plan
from megatron_mecefo.sim.scenario import injections_to_trace, load_scenario
from megatron_mecefo.sim.simulator import JobConfig, simulate_all, trace_for_job
from megatron_mecefo.sim.strategies import (
    MEASURED_NEIGHBOR_STEP_RATIO,
    MEASURED_REPLACE_S,
    MEASURED_SNAPSHOT_RESTART_S,
    STRATEGY_NAMES,
    StrategyConfig,
)

DEFAULT_STRATEGIES = (
    "ckpt,snapshot,replication:3,spare:8,mecefo:neighbor,mecefo:spread,mecefo:hybrid"
)


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors are one `error:` line and ExitCode.CONFIG_ERROR."""

    def error(self, message: str):  # type: ignore[override]
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(ExitCode.CONFIG_ERROR)


def parse_strategies(text: str, args: argparse.Namespace) -> list[StrategyConfig]:
    """'ckpt,spare:8,replication:3,mecefo:hybrid,mecefo:spread:sample' -> configs (':' gives r,
    or the policy and optionally the granularity; default `--granularity`)."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, arg = item.partition(":")
        if name not in STRATEGY_NAMES:
            raise ConfigError(f"unknown strategy {name!r} (allowed: {', '.join(STRATEGY_NAMES)})")
        kw: dict = {"name": name}
        if name in ("spare", "replication"):
            if not arg.isdigit():
                raise ConfigError(f"{name} needs a redundancy, e.g. {name}:4 (got {item!r})")
            kw["redundancy"] = int(arg)
        elif name == "mecefo":
            policy, _, granularity = arg.partition(":")
            kw["takeover_policy"] = policy or "hybrid"
            layout = _layout(args)
            kw["pipeline_stages"] = layout.pp if layout else getattr(args, "pipeline_stages", 1)
            if policy == "stage" or granularity == "stage":
                kw["takeover_policy"], kw["unit"], granularity = "spread", "stage", ""
            kw["neighbor_step_ratio"] = args.neighbor_step_ratio
            kw["granularity"] = granularity or getattr(args, "granularity", "microbatch")
            kw["microbatches_per_rank"] = (
                layout.microbatches(args.gpus) if layout else getattr(args, "microbatches", 8)
            )
            kw["micro_batch_size"] = (
                layout.micro_batch_size if layout else getattr(args, "micro_batch_size", 4)
            )
        elif arg:
            raise ConfigError(f"strategy {name!r} takes no ':' argument (got {item!r})")
        if name == "snapshot":
            kw["snapshot_restart_s"] = args.snapshot_restart_s
        try:
            out.append(StrategyConfig(**kw))
        except ValueError as exc:
            raise ConfigError(f"{item}: {exc}") from None
    if not out:
        raise ConfigError("no strategy given")
    return out


def _job_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("job")
    g.add_argument("--gpus", type=int, default=600_000, help="GPUs in the job (default 600000)")
    g.add_argument("--gpus-per-group", type=int, default=1000, help="GPUs per DP group (1000)")
    g.add_argument(
        "--run-config",
        help="a run config (configs/run/*.yaml): GPUs per group = its TP x PP, and the spare-node "
        "replacement time = --replace-s + one rank's state over --state-gbps",
    )
    g.add_argument(
        "--state-gbps",
        type=float,
        default=DEFAULT_STATE_GBPS,
        help=f"with --run-config: network bandwidth per GPU for a replacement rank's state, Gb/s "
        f"(an assumption, default {DEFAULT_STATE_GBPS:g})",
    )
    g.add_argument("--steps", type=int, default=10_000, help="training steps (10000)")
    g.add_argument("--step-time-s", type=float, default=64.0, help="failure-free step time (64)")
    g.add_argument("--save-s", type=float, default=60.0, help="checkpoint save time T_s (60)")
    g.add_argument("--restart-s", type=float, default=3600.0, help="restart time T_r (3600)")
    g.add_argument(
        "--spare-nodes",
        type=int,
        default=0,
        help="standby nodes that replace a failed group's node without a restart (0: none)",
    )
    g.add_argument(
        "--replace-s",
        type=float,
        default=MEASURED_REPLACE_S,
        help=f"spare nodes: failure -> full strength again (provisional measured "
        f"{MEASURED_REPLACE_S} s, tools/bench/node_loss.py)",
    )
    f = p.add_argument_group("failures")
    f.add_argument("--scenario", help="failure scenario YAML (configs/failures/*.yaml)")
    f.add_argument("--system-mtbf-s", type=float, help="system MTBF m in seconds (overrides)")
    f.add_argument("--distribution", choices=["exponential", "weibull"], help="override law")
    f.add_argument("--seed", type=int, default=0, help="trace seed (0)")
    s = p.add_argument_group("strategy inputs")
    s.add_argument(
        "--neighbor-step-ratio",
        type=float,
        default=MEASURED_NEIGHBOR_STEP_RATIO,
        help=f"MeCeFO neighbour step ratio (measured {MEASURED_NEIGHBOR_STEP_RATIO})",
    )
    s.add_argument(
        "--snapshot-restart-s",
        type=float,
        default=MEASURED_SNAPSHOT_RESTART_S,
        help=f"snapshot restart cost (measured {MEASURED_SNAPSHOT_RESTART_S} s; add a cluster's "
        "relaunch time)",
    )
    s.add_argument(
        "--granularity",
        choices=["microbatch", "sample"],
        default="microbatch",
        help="MeCeFO spread/hybrid take over whole micro-batches or sample slices "
        "(per strategy: mecefo:spread:sample)",
    )
    s.add_argument(
        "--microbatches",
        type=int,
        default=8,
        help="MeCeFO micro-batches per rank M (8; with --run-config: the config's)",
    )
    s.add_argument(
        "--pipeline-stages",
        type=int,
        default=1,
        help="P, pipeline stages of a group: extra work costs e / (M + P - 1) (1; with "
        "--run-config: its PP); mecefo:stage reroutes a dead stage into the others' bubbles",
    )
    s.add_argument(
        "--micro-batch-size", type=int, default=4, help="MeCeFO samples per micro-batch b (4)"
    )


def _layout(args) -> ReplicaLayout | None:
    return from_run_config(args.run_config) if getattr(args, "run_config", None) else None


def _job(args) -> JobConfig:
    layout = _layout(args)
    per_group, replace_s = args.gpus_per_group, args.replace_s
    if layout is not None:
        per_group, replace_s = layout.gpus, layout.replacement_s(args.replace_s, args.state_gbps)
    try:
        return JobConfig(
            num_gpus=args.gpus,
            gpus_per_group=per_group,
            num_steps=args.steps,
            step_time_s=args.step_time_s,
            checkpoint_save_s=args.save_s,
            restart_s=args.restart_s,
            spare_nodes=args.spare_nodes,
            replace_s=replace_s,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _process(args) -> tuple[FailureProcess | None, object]:
    """(failure process or None, scenario or None) from --scenario / --system-mtbf-s."""
    scenario = load_scenario(args.scenario) if args.scenario else None
    proc = scenario.process if scenario else FailureProcess()
    if scenario is not None and proc is None and args.system_mtbf_s is None:
        return None, scenario
    fields = {} if proc is None else dict(proc.__dict__)
    if args.system_mtbf_s is not None:
        fields.update(system_mtbf_s=args.system_mtbf_s, gpu_mtbf_h=None)
    if args.distribution:
        fields["distribution"] = args.distribution
    return FailureProcess(**fields), scenario


def _emit(args, payload: dict, lines: list[str]) -> None:
    if args.json:
        print(json.dumps(payload, indent=2, default=_json_default))
    else:
        print("\n".join(lines))


def _json_default(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return float(obj)


def _fmt_rows(rows: list[dict]) -> list[str]:
    head = (
        f"{'strategy':<22}{'TTT/T0':>8}{'drop':>8}{'TTT h':>9}{'uptime':>8}{'restarts':>9}"
        f"{'T_c s':>8}"
    )
    out = [head]
    for r in rows:
        drop = 1.0 - 1.0 / r["ttt_over_t0"] if r["ttt_over_t0"] > 0 else math.nan
        out.append(
            f"{r['strategy']:<22}{r['ttt_over_t0']:>8.3f}{drop:>8.2%}{r.get('ttt_h', 0):>9.1f}"
            f"{r['uptime_fraction']:>8.3f}{r['restarts']:>9.1f}{r['checkpoint_period_s']:>8.0f}"
        )
    return out


def cmd_spare(args) -> None:
    """Closed forms (and optional Monte Carlo) for one (N, r)."""
    n, r = args.groups, args.redundancy
    spare.check_layout(n, r)
    if args.system_mtbf_s <= 0:
        raise ConfigError(f"--system-mtbf-s must be > 0, got {args.system_mtbf_s}")
    mu = spare.endurable_failures(n, r)
    tf = mu * args.system_mtbf_s
    out = {
        "N": n,
        "r": r,
        "mu_closed": mu,
        "mu_replication_closed": spare.endurable_failures_replication(n, r),
        "s_bar_closed": spare.mean_overhead_closed(n, r),
        "t_c_opt_s": spare.optimal_checkpoint_period(args.save_s, tf, args.restart_s),
        "availability": spare.best_availability(args.save_s, tf, args.restart_s),
        "J_spare": spare.time_to_train_ratio(n, r, args.system_mtbf_s, args.restart_s, args.save_s),
        "r_star_closed": spare.optimal_redundancy_closed(n),
        "r_opt": spare.optimal_redundancy(n, args.system_mtbf_s, args.restart_s, args.save_s)[0],
    }
    if args.trials:
        out["mu_monte_carlo"], out["mu_monte_carlo_se"] = spare.endurable_failures_monte_carlo(
            n, r, trials=args.trials, seed=args.seed
        )
        out["s_bar_monte_carlo"], _ = spare.mean_overhead_monte_carlo(
            n, r, trials=max(1, args.trials // 20), seed=args.seed
        )
    _emit(
        args,
        out,
        [f"{k:<24}{v:.4g}" if isinstance(v, float) else f"{k:<24}{v}" for k, v in out.items()],
    )


def _trace(args, job: JobConfig):
    proc, scenario = _process(args)
    if proc is None:
        return injections_to_trace(
            scenario,
            step_time_s=job.step_time_s,
            num_groups=job.num_groups,
            horizon_s=job.t0_s * job.horizon_factor,
        ), None
    seed = args.seed if scenario is None else scenario.seed + args.seed
    trace = trace_for_job(proc, job, seed)
    return trace, proc.cluster_mtbf_s(job.num_gpus)


def cmd_simulate(args) -> None:
    """All requested strategies side by side on one trace."""
    job = _job(args)
    configs = parse_strategies(args.strategies, args)
    trace, m = _trace(args, job)
    start = time.perf_counter()
    results = simulate_all(job, configs, trace, system_mtbf_s=m)
    rows = [r.summary() for r in results]
    payload = {
        "num_groups": job.num_groups,
        "spare_nodes": job.spare_nodes,
        "replace_s": job.replace_s,
        "t0_h": job.t0_s / 3600,
        "failures_in_trace": int(trace.times_s.size),
        "elapsed_s": time.perf_counter() - start,
        "results": rows,
    }
    if args.plot:
        payload["plot"] = plots.plot_availability(results, args.plot)["path"]
    spares = (
        f", {job.spare_nodes} spare nodes (replacement {job.replace_s:g} s)"
        if job.spare_nodes
        else ""
    )
    head = [
        f"N = {job.num_groups} groups of {job.gpus_per_group} GPUs, T_0 = {job.t0_s / 3600:.1f} h, "
        f"{trace.times_s.size} failures in the trace{spares}"
    ]
    layout = _layout(args)
    if layout is not None:
        head.insert(0, layout.describe(args.replace_s, args.state_gbps))
        payload["layout"] = {
            "model": layout.name,
            "gpus_per_replica": layout.gpus,
            "tp": layout.tp,
            "pp": layout.pp,
            "state_gb_per_rank": layout.state_bytes_per_rank() / 1e9,
            "state_gbps": args.state_gbps,
        }
    _emit(args, payload, head + _fmt_rows(rows))


def cmd_plan(args) -> None:
    """Planner sweep and recommendation."""
    job = _job(args)
    proc, _ = _process(args)
    if proc is None:
        raise ConfigError("the planner needs a stochastic process (scenario `process:` block)")
    cfg = PlanConfig(
        seeds=args.seeds,
        seed=args.seed,
        max_redundancy=args.max_redundancy,
        strategies=[s.strip() for s in args.strategies.split(",") if s.strip()],
        neighbor_step_ratio=args.neighbor_step_ratio,
        snapshot_restart_s=args.snapshot_restart_s,
    )
    start = time.perf_counter()
    rows = plan(job, proc, cfg)
    best = rows[0]
    summaries = [r.summary(job.t0_s) for r in rows]
    rec = {
        "strategy": best.config.name,
        "redundancy": best.config.redundancy,
        "takeover_policy": best.config.takeover_policy if best.config.name == "mecefo" else None,
        "checkpoint_interval_s": best.checkpoint_period_s,
        "expected_ttt_h": best.ratio * job.t0_s / 3600,
        "ttt_over_t0": best.ratio,
        "availability": best.uptime,
    }
    payload = {
        "recommendation": rec,
        "elapsed_s": time.perf_counter() - start,
        "system_mtbf_s": proc.cluster_mtbf_s(job.num_gpus),
        "candidates": summaries,
    }
    lines = [
        f"recommended: {best.config.label}  checkpoint every {best.checkpoint_period_s:.0f} s  "
        f"TTT {rec['expected_ttt_h']:.1f} h ({best.ratio:.2f} x T_0)  "
        f"availability {best.uptime:.3f}",
        "",
        *_fmt_rows(summaries[: args.top]),
    ]
    _emit(args, payload, lines)


_LEVEL_TEXT = {
    "gpu": "per-GPU Weibull renewal processes from age 0 at job start (cluster MTBF 5 min)",
    "system": "one stationary cluster-level Weibull renewal process, mean 5 min",
}


def cmd_reproduce(args) -> None:
    """The SPARe paper's table, ours vs theirs."""
    groups = tuple(int(g) for g in args.groups.split(","))
    unknown = [g for g in groups if g not in paper.PAPER_TABLE]
    if unknown:
        raise ConfigError(
            f"--groups {unknown}: the paper's table has N in {sorted(paper.PAPER_TABLE)} only"
        )
    result = paper.reproduce(
        groups,
        seeds=args.seeds,
        seed=args.seed,
        max_redundancy=args.max_redundancy,
        level=args.level,
    )
    rows = [r.summary() for r in result]
    lines = [
        f"failure model: {_LEVEL_TEXT[args.level]}",
        f"{'N':>5} {'Rep+CKPT':>9} {'paper':>6} {'gap':>6}  {'SPARe':>6} {'paper':>6} {'gap':>6}",
    ]
    for r in rows:
        lines.append(
            f"{r['N']:>5} {r['rep_ckpt']:>9.2f} {r['paper_rep_ckpt']:>6.2f} {r['rep_gap']:>+6.1%}"
            f"  {r['spare_ckpt']:>6.2f} {r['paper_spare_ckpt']:>6.2f} {r['spare_gap']:>+6.1%}"
            f"   (r = {r['rep_r']} / {r['spare_r']})"
        )
    _emit(args, {"level": args.level, "rows": rows}, lines)


def cmd_replay(args) -> None:
    """Replay a real run's events.jsonl through the strategies."""
    evs = events_mod.read_events(args.events)
    job = _job(args)
    trace = events_mod.events_to_trace(evs, horizon_s=job.t0_s * job.horizon_factor)
    if trace.groups.size and trace.groups.max() >= job.num_groups:
        raise ConfigError(
            f"events name dp_rank {trace.groups.max()} but there are only "
            f"{job.num_groups} groups (set --gpus / --gpus-per-group)"
        )
    results = simulate_all(job, parse_strategies(args.strategies, args), trace)
    rows = [r.summary() for r in results]
    payload = {
        "events": len(evs),
        "failures": int(trace.times_s.size),
        "measured": events_mod.measured_latencies(evs),
        "results": rows,
    }
    _emit(
        args,
        payload,
        [
            f"{len(evs)} events, {trace.times_s.size} failures, measured {payload['measured']}",
            *_fmt_rows(rows),
        ],
    )


def cmd_plot(args) -> None:
    """One of the three plots."""
    if args.kind == "scale":
        args.gpus = args.gpus_per_group  # the base job only carries step/save/restart times
    job = _job(args)
    proc, _ = _process(args)
    if proc is None:
        raise ConfigError("plots need a stochastic process (scenario `process:` block)")
    if args.kind == "redundancy":
        data = plots.plot_ttt_vs_redundancy(job, proc, args.out, seeds=args.seeds)
    elif args.kind == "scale":
        gpus = [int(g) for g in args.scale_gpus.split(",")]
        data = plots.plot_ttt_vs_scale(
            gpus, job.gpus_per_group, proc, args.out, base_job=job, seeds=args.seeds
        )
    else:
        trace, m = _trace(args, job)
        results = simulate_all(job, parse_strategies(args.strategies, args), trace, system_mtbf_s=m)
        data = plots.plot_availability(results, args.out)
    _emit(args, data, [f"wrote {data['path']}"])


def build_parser() -> argparse.ArgumentParser:
    """The `mecefo-sim` argument parser."""
    p = _Parser(prog="mecefo-sim", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def add(name: str, func, help_text: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.add_argument("--json", action="store_true", help="print JSON instead of a table")
        sp.set_defaults(func=func)
        return sp

    sp = add("spare", cmd_spare, "SPARe closed forms for N groups and redundancy r")
    sp.add_argument("--groups", "-N", type=int, required=True, help="number of DP groups N")
    sp.add_argument("--redundancy", "-r", type=int, required=True, help="stack depth r")
    sp.add_argument("--system-mtbf-s", type=float, default=300.0, help="system MTBF m (300)")
    sp.add_argument("--save-s", type=float, default=60.0, help="T_s (60)")
    sp.add_argument("--restart-s", type=float, default=3600.0, help="T_r (3600)")
    sp.add_argument("--trials", type=int, default=0, help="Monte Carlo trials (0: none)")
    sp.add_argument("--seed", type=int, default=0)

    sp = add("simulate", cmd_simulate, "simulate strategies side by side on one failure trace")
    _job_args(sp)
    sp.add_argument(
        "--strategies",
        default=DEFAULT_STRATEGIES,
        help="comma list: ckpt, snapshot, replication:R, spare:R, mecefo:POLICY[:GRANULARITY]",
    )
    sp.add_argument("--plot", help="also write an availability-over-time PNG here")

    sp = add("plan", cmd_plan, "recommend strategy, redundancy and checkpoint interval")
    _job_args(sp)
    sp.add_argument("--strategies", default=",".join(STRATEGY_NAMES), help="families to sweep")
    sp.add_argument("--max-redundancy", type=int, default=12, help="largest r tried (12)")
    sp.add_argument("--seeds", type=int, default=2, help="traces per candidate (2)")
    sp.add_argument("--top", type=int, default=12, help="rows to print (12)")

    sp = add("reproduce", cmd_reproduce, "reproduce the SPARe paper's TTT table (600k GPUs)")
    sp.add_argument("--seeds", type=int, default=3, help="traces per candidate (3)")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--groups", default="200,600,1000", help="N values, comma list (all three)")
    sp.add_argument("--max-redundancy", type=int, default=12, help="largest r tried (12)")
    sp.add_argument(
        "--level",
        choices=["gpu", "system"],
        default="gpu",
        help="failure model: per-GPU renewal from age 0 (gpu, default) or one stationary "
        "cluster-level process (system)",
    )

    sp = add("replay", cmd_replay, "replay a real run's events.jsonl through the strategies")
    sp.add_argument("events", help="events.jsonl of a run")
    _job_args(sp)
    sp.add_argument("--strategies", default="ckpt,mecefo:neighbor,mecefo:hybrid")

    sp = add("plot", cmd_plot, "write a PNG: TTT vs redundancy, vs scale, or availability")
    sp.add_argument("kind", choices=["redundancy", "scale", "availability"])
    sp.add_argument("--out", required=True, help="PNG path")
    _job_args(sp)
    sp.add_argument("--seeds", type=int, default=1)
    sp.add_argument("--scale-gpus", default="16384,65536,200000,600000", help="for kind=scale")
    sp.add_argument("--strategies", default=DEFAULT_STRATEGIES, help="for kind=availability")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (MecefoError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = getattr(exc, "exit_code", ExitCode.CONFIG_ERROR)
        return int(code if code != ExitCode.FAILURE else ExitCode.CONFIG_ERROR)
    return int(ExitCode.OK)


if __name__ == "__main__":
    sys.exit(main())
