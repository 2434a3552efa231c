"""`mecefo-train`: load config, build, train, close.

    mecefo-train --config configs/run/demo_cpu.yaml [--run-dir DIR] [--max-steps N] [key=value ...]

Under `mecefo-launch` (which sets MECEFO_COORDINATOR) the run survives rank deaths: see
`megatron_mecefo.failover`. Under plain torchrun a rank death ends the job.

A user mistake (bad config, missing data, bad layout) prints one `error: ...` line and exits with
the code from `megatron_mecefo.errors.ExitCode`; `--dry-run` validates the config without starting.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from megatron_mecefo.errors import ConfigError, ExitCode, MecefoError

if __name__ == "__mp_main__":  # re-imported in a multiprocessing spawn child of a trainer
    from megatron_mecefo.failover.lifecycle import die_with_parent

    die_with_parent()  # megatron's spawned checkpoint-result queue must not outlive its trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="mecefo-train",
        description="Pretrain a Megatron-Core GPT with MeCeFO fault tolerance.",
        epilog="Overrides use dotted keys, e.g. training.lr=1e-3 model=llama-350m "
        "parallel.tensor_model_parallel_size=2. Exit codes: 0 ok, 1 internal error, 2 config, "
        "3 data, 4 distributed, 5 checkpoint, 9 stopped on request (SIGUSR1) after a final "
        "checkpoint.",
    )
    p.add_argument(
        "--config", required=True, help="run config YAML (e.g. configs/run/demo_cpu.yaml)"
    )
    p.add_argument("--run-dir", help="output directory (overrides run_dir)")
    p.add_argument("--max-steps", type=int, help="optimizer steps (overrides training.max_steps)")
    p.add_argument(
        "--inject",
        action="append",
        metavar="KIND:RANK:STEP[:DOWN_STEPS]",
        help="inject a real failure (kill | hang | exception | stall) of a global rank at a step; "
        "repeatable; needs mecefo-launch",
    )
    p.add_argument(
        "--failures",
        metavar="FILE",
        help="inject the failures of a scenario (configs/failures/*.yaml); needs mecefo-launch",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config and print it resolved, then exit",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return p.parse_intermixed_args(argv)  # key=value overrides may come before or after flags


def load_run_config(args: argparse.Namespace):
    from megatron_mecefo.config.loader import load_config
    from megatron_mecefo.config.run import RunConfig

    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"run_dir={args.run_dir}")
    if args.max_steps is not None:
        overrides.append(f"training.max_steps={args.max_steps}")
    return load_config(RunConfig, args.config, overrides)


def run(args: argparse.Namespace) -> int:
    import yaml

    from megatron_mecefo.config.batch import resolve_global_batch, world_size_from_env
    from megatron_mecefo.config.loader import to_dict

    cfg = load_run_config(args)
    cfg = resolve_global_batch(cfg, world_size_from_env(cfg))  # fixed global batch, if set
    if args.dry_run:
        _check_injections(args, cfg)
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return ExitCode.OK
    if os.environ.get("MECEFO_COORDINATOR"):
        from megatron_mecefo.failover.session import run_with_failover

        return run_with_failover(cfg, args, print)
    if args.inject or args.failures:
        raise ConfigError(
            "--inject/--failures need failover: launch with mecefo-launch "
            "(launch/local/run.sh), not plain torchrun"
        )
    from megatron_mecefo.checkpoint.manager import CheckpointManager
    from megatron_mecefo.mcore.parallel import init_parallel
    from megatron_mecefo.metrics.logger import MetricsLogger
    from megatron_mecefo.snapshot.hook import SnapshotHook
    from megatron_mecefo.snapshot.paths import node_dir
    from megatron_mecefo.snapshot.recovery import Recovery, agree_min_over_default_group
    from megatron_mecefo.training import identity as state_identity
    from megatron_mecefo.training.engine import build_engine
    from megatron_mecefo.training.loop import train
    from megatron_mecefo.training.run_dir import RunDir
    from megatron_mecefo.training.stop import StopFlag, StopRequest

    stop_flag = StopFlag().install()
    ctx = init_parallel(cfg.parallel)
    say = print if ctx.is_rank0 else (lambda *a, **k: None)
    log = lambda m: say(m, flush=True)  # noqa: E731
    shm = node_dir(cfg.snapshot, cfg.run_dir) if cfg.snapshot.enabled else None
    identity = state_identity.resolve(  # what state this run may load (all ranks, in order)
        cfg, dp_size=ctx.world_size // ctx.tp_size, share=state_identity.share_over_default_group()
    )
    recovery = Recovery(
        cfg,
        rank=ctx.rank,
        snapshot_dir=shm,
        identity=identity,
        agree_min=agree_min_over_default_group(ctx.device),
        log=lambda m: print(f"[recovery] rank {ctx.rank}: {m}", flush=True),
    )
    resuming = bool(recovery.candidates())
    run_dir = (
        RunDir(cfg.run_dir, overwrite=cfg.overwrite, resuming=resuming) if ctx.is_rank0 else None
    )
    ckpt = CheckpointManager(
        cfg.checkpoint,
        cfg.run_dir,
        max_steps=cfg.training.max_steps,
        tp_size=ctx.tp_size,
        identity=identity,
        log=log,
    )
    snapshots = SnapshotHook(
        cfg.snapshot, shm, ctx.rank, max_steps=cfg.training.max_steps, log=log, identity=identity
    )
    try:
        engine = build_engine(cfg, ctx, log=log)
        start_step = recovery.load(engine, ckpt) or 0
        if start_step >= cfg.training.max_steps:  # nothing to run: leave the run dir untouched
            say(already_complete(cfg, start_step), flush=True)
            engine.close()
            return ExitCode.OK
        snapshots.attach(engine)
        if run_dir is not None:
            run_dir.create(
                cfg,
                {
                    "world_size": ctx.world_size,
                    "dp_size": engine.membership.num_replicas,
                    "tp_size": ctx.tp_size,
                    "backend": ctx.backend,
                },
                resume_step=start_step,
                identity=identity,
            )
    except BaseException:
        if run_dir is not None:
            run_dir.discard_if_created()
        raise
    logger = MetricsLogger(
        cfg.logging,
        cfg.run_dir,
        enabled=ctx.is_rank0,
        total_steps=cfg.training.max_steps,
        start_step=start_step,
        run_config=to_dict(cfg),
    )
    try:
        summary = train(
            engine,
            logger,
            [StopRequest(stop_flag, ctx.world_size), snapshots, ckpt],
            start_step=start_step,
        )
    finally:
        logger.close()
    if run_dir is not None:
        run_dir.write_summary(summary)
        print_summary(summary, cfg.run_dir)
    engine.close()
    return exit_code_of(summary)


def already_complete(cfg, start_step: int) -> str:
    """The one line a rerun of a finished run prints (it changes nothing)."""
    return (
        f"run {cfg.run_dir} is already complete at step {start_step} "
        f"(training.max_steps={cfg.training.max_steps}): nothing to do; raise --max-steps to "
        "train on, or pass overwrite=true with checkpoint.resume=never to start over"
    )


def exit_code_of(summary: dict) -> ExitCode:
    """OK, or PREEMPTED when the run stopped early on request (a final checkpoint was saved)."""
    return ExitCode.OK if summary.get("stopped_at") is None else ExitCode.PREEMPTED


def _check_injections(args: argparse.Namespace, cfg) -> None:
    """Validate --inject / --failures at dry-run time (the launcher's one-process check; it
    passes the job's world size in MECEFO_DRY_RUN_WORLD)."""
    from megatron_mecefo.failover import inject

    world = os.environ.get("MECEFO_DRY_RUN_WORLD")
    inject.specs_of(args.inject, args.failures, cfg, int(world) if world else None)


def print_summary(summary: dict, run_dir: str) -> None:
    print(
        f"done: {summary['steps']} steps, loss {summary['first_loss']:.4f} -> "
        f"{summary['final_loss']:.4f}",
        flush=True,
    )
    for step, val in summary["val_losses"]:
        print(f"  val_loss @ step {step + 1:>5}: {val:.4f}")
    floor = summary.get("entropy_floor_nats_per_token")
    if floor is not None and summary["final_val_loss"] is not None:
        print(
            f"  entropy floor of the demo corpus: {floor:.4f} nats/token "
            f"(gap {summary['final_val_loss'] - floor:+.4f})"
        )
    if summary.get("mean_tokens_per_s"):
        print(f"  throughput: {summary['mean_tokens_per_s']:.0f} tokens/s")
    fo = summary.get("failover")
    if fo:
        print(
            f"  failover: {fo['failures']} failure(s), {fo['rejoins']} rejoin(s), "
            f"{fo['steps_redone']} step(s) redone, {fo['steps_degraded']} step(s) with degraded "
            f"micro-batches, samples lost {fo['samples_lost']}, detection ms {fo['detection_ms']}, "
            f"regroup ms {fo['regroup_ms']}"
        )
    if summary.get("stopped_at") is not None:
        print(
            f"  stopped on request after step {summary['stopped_at'] - 1} with a final checkpoint;"
            " relaunch (or requeue) the same command to resume",
            flush=True,
        )
    print(f"  metrics: {run_dir}/metrics.jsonl", flush=True)


def _failover_crash_code(exc: Exception, rank: int) -> int:
    """An unexpected error under failover. A lost coordinator is a clean COORDINATOR_LOST exit;
    an error because this replica left the membership (a TP peer died) is a one-line REJOIN exit;
    anything else prints its traceback and exits FAILURE. The agent restarts REJOIN and FAILURE."""
    from megatron_mecefo.failover import keys

    text = str(exc)
    comm_error = any(w in text for w in ("gloo", "NCCL", "Connection", "Timed out"))
    try:
        store = keys.connect(os.environ[keys.COORDINATOR_ENV], 2.0)
        removed = keys.wait_for_removal(store, rank, timeout_s=5.0 if comm_error else 0.0)
        if removed is None:  # a genuine error here: tell the coordinator now, not by heartbeat
            keys.report_dead(store, rank, int(os.environ.get(keys.INCARNATION_ENV, 0)))
    except Exception:  # noqa: BLE001 - unreachable, whatever the error type
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__  # no C++ frames
        print(f"error: rank {rank}: coordinator unreachable ({first})", file=sys.stderr, flush=True)
        return int(ExitCode.COORDINATOR_LOST)
    if removed is not None:
        line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"rank {rank}: left the membership ({removed}) after: {line}", flush=True)
        return int(ExitCode.REJOIN)
    traceback.print_exception(exc)
    return int(ExitCode.FAILURE)


def main(argv: list[str] | None = None) -> int:
    from megatron_mecefo.failover.lifecycle import die_with_parent

    # whatever this process forks (megatron's async checkpoint writers) dies with it, even when
    # it is SIGKILLed: no writer outlives its trainer holding files and pipes open
    os.register_at_fork(after_in_child=die_with_parent)
    from megatron_mecefo.metrics.rank_log import redirect_rank_output

    redirect_rank_output()  # MECEFO_RANK_LOG_DIR: this rank's own log file (pretrain.sbatch)
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    failover = bool(os.environ.get("MECEFO_COORDINATOR"))
    try:
        code = int(run(args))
    except MecefoError as exc:
        if rank == 0 or failover:
            who = f"rank {rank}: " if failover else ""
            print(f"error: {who}{exc}", file=sys.stderr, flush=True)
        code = int(exc.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except Exception as exc:
        if not failover:
            raise
        code = _failover_crash_code(exc, rank)
    if failover:
        # Abandoned collectives of dead generations may still hold gloo/NCCL threads; never let
        # interpreter teardown wait on them.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
