"""`mecefo-train`: load config, build, train, close.

    mecefo-train --config configs/run/demo_cpu.yaml [--run-dir DIR] [--max-steps N] [key=value ...]

Under `mecefo-launch` (which sets MECEFO_COORDINATOR) the run survives rank deaths: the session
runs under failover's `FailoverManager`. Under plain torchrun a rank death ends the job. The run
itself is `session.py` (beside this file), the same code either way.

A user mistake (bad config, missing data, bad layout) prints one `error: ...` line and exits with
the code from `megatron_mecefo.errors.ExitCode`; `--dry-run` validates the config without starting
(the data files too, once any of them exists: before preprocessing it checks the config and the
layout, and says in one line that the data was not checked).
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_mecefo.config.cli import load_run_config, parse_args
from megatron_mecefo.control.keys import COORDINATOR_ENV, INCARNATION_ENV
from megatron_mecefo.errors import ConfigError, ExitCode, MecefoError

if __name__ == "__mp_main__":  # re-imported in a multiprocessing spawn child of a trainer
    from megatron_mecefo.control.proc import die_with_parent

    die_with_parent()  # megatron's spawned checkpoint-result queue must not outlive its trainer


def run(args: argparse.Namespace) -> int:
    import yaml

    from megatron_mecefo import precheck
    from megatron_mecefo.config.batch import dp_size, resolve_global_batch, world_size_from_env
    from megatron_mecefo.config.loader import to_dict
    from megatron_mecefo.data.pipeline import check_paths

    cfg = load_run_config(args)
    if args.dry_run:  # every check that needs no start-up (precheck.py), then the config
        world = os.environ.get("WORLD_SIZE") or os.environ.get("MECEFO_DRY_RUN_WORLD")
        unchecked = precheck.unchecked_data(cfg)  # before preprocessing: a layout check only
        world_size = int(world) if world else None
        cfg = precheck.check(cfg, args, world_size=world_size, data=unchecked is None)
        cfg = resolve_global_batch(cfg, world_size_from_env(cfg))
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        if unchecked is not None:
            print(f"note: {unchecked}", file=sys.stderr, flush=True)
        return ExitCode.OK
    # a process without WORLD_SIZE runs alone (`mcore.parallel`: world 1), whatever TP x PP says
    world = world_size_from_env(cfg) if "WORLD_SIZE" in os.environ else 1
    dp_size(cfg, world)  # a user's mistake in a second, before torch and megatron are imported
    check_paths(cfg.data)
    cfg = resolve_global_batch(cfg, world)  # fixed global batch, if set
    done = (
        None
        if os.environ.get(INCARNATION_ENV, "0") != "0"
        else precheck.already_complete(cfg, world)
    )
    if done is not None:  # every rank reads the same files: all of them stop here
        if os.environ.get("RANK", "0") == "0":
            print(done, flush=True)
        return ExitCode.OK
    from megatron_mecefo.session import StaticRun, run_session

    if os.environ.get(COORDINATOR_ENV):
        control, hooks = _failover_control(cfg, args)
        return run_session(cfg, control, hooks)
    if args.inject or args.failures:
        raise ConfigError(
            "--inject/--failures need failover: launch with mecefo-launch "
            "(launch/local/run.sh), not plain torchrun"
        )
    return run_session(cfg, StaticRun(cfg))


def _failover_control(cfg, args: argparse.Namespace):
    """The failover manager of this trainer process, and its injection hook when asked for."""
    from megatron_mecefo.control import keys
    from megatron_mecefo.failover.trainer.manager import FailoverManager
    from megatron_mecefo.mcore.parallel import resolve_backend
    from megatron_mecefo.testing import inject

    address = os.environ[COORDINATOR_ENV]
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    incarnation = int(os.environ.get(INCARNATION_ENV, 0))
    specs = inject.specs_of(args.inject, args.failures, cfg, world)
    injector = None
    if inject.Injector.wanted(specs, rank):
        replica_size = cfg.parallel.tensor_model_parallel_size * (
            cfg.parallel.pipeline_model_parallel_size
        )
        injector = inject.Injector(
            specs, keys.connect(address, 5.0), rank, incarnation, replica_size
        )
    manager = FailoverManager(
        cfg,
        address=address,
        rank=rank,
        world_size=world,
        tp_size=cfg.parallel.tensor_model_parallel_size,
        pp_size=cfg.parallel.pipeline_model_parallel_size,
        incarnation=incarnation,
        backend=resolve_backend(cfg.parallel),
        before_transfer=injector.at_rejoin if injector is not None else None,
        log=lambda m: print(m, flush=True),
    )
    return manager, [injector] if injector is not None else []


def main(argv: list[str] | None = None) -> int:
    from megatron_mecefo.control.proc import forks_die_with_parent, quiet_library_warnings
    from megatron_mecefo.metrics.rank_log import redirect_rank_output

    quiet_library_warnings(os.environ)  # before megatron is imported
    forks_die_with_parent()
    redirect_rank_output()  # MECEFO_RANK_LOG_DIR: this rank's own log file (pretrain.sbatch)
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    failover = bool(os.environ.get(COORDINATOR_ENV))
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
        from megatron_mecefo.failover.trainer.crash import crash_code

        incarnation = int(os.environ.get(INCARNATION_ENV, 0))
        code = crash_code(exc, rank, os.environ[COORDINATOR_ENV], incarnation)
    if failover:
        # Abandoned collectives of dead generations may still hold gloo/NCCL threads; never let
        # interpreter teardown wait on them.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def cli() -> None:
    """The `mecefo-train` command: `main`, then `proc.exit_now` (`main` returns, for tests)."""
    from megatron_mecefo.control.proc import exit_now

    exit_now(main())


if __name__ == "__main__":
    cli()
