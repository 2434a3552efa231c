"""`mecefo-train`: load config, build, train, close. Launch under torchrun for more than one rank.

    mecefo-train --config configs/run/demo_cpu.yaml [--run-dir DIR] [--max-steps N] [key=value ...]

A user mistake (bad config, missing data, bad layout) prints one `error: ...` line and exits with
the code from `megatron_mecefo.errors.ExitCode`; `--dry-run` validates the config without starting.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_mecefo.errors import ExitCode, MecefoError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="mecefo-train",
        description="Pretrain a Megatron-Core GPT with MeCeFO fault tolerance.",
        epilog="Overrides use dotted keys, e.g. training.lr=1e-3 model=llama-350m "
        "parallel.tensor_model_parallel_size=2. Exit codes: 0 ok, 1 internal error, 2 config, "
        "3 data, 4 distributed, 5 checkpoint.",
    )
    p.add_argument(
        "--config", required=True, help="run config YAML (e.g. configs/run/demo_cpu.yaml)"
    )
    p.add_argument("--run-dir", help="output directory (overrides run_dir)")
    p.add_argument("--max-steps", type=int, help="optimizer steps (overrides training.max_steps)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config and print it resolved, then exit",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return p.parse_args(argv)


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

    from megatron_mecefo.config.loader import to_dict

    cfg = load_run_config(args)
    if args.dry_run:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return ExitCode.OK
    from megatron_mecefo.mcore.parallel import init_parallel
    from megatron_mecefo.metrics.logger import MetricsLogger
    from megatron_mecefo.training.engine import build_engine
    from megatron_mecefo.training.loop import train
    from megatron_mecefo.training.run_dir import RunDir

    ctx = init_parallel(cfg.parallel)
    run_dir = RunDir(cfg.run_dir, overwrite=cfg.overwrite) if ctx.is_rank0 else None
    say = print if ctx.is_rank0 else (lambda *a, **k: None)
    try:
        engine = build_engine(cfg, ctx, log=lambda m: say(m, flush=True))
        if run_dir is not None:
            run_dir.create(
                cfg,
                {
                    "world_size": ctx.world_size,
                    "dp_size": ctx.dp_size,
                    "tp_size": ctx.tp_size,
                    "backend": ctx.backend,
                },
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
        run_config=to_dict(cfg),
    )
    try:
        summary = train(engine, logger)
    finally:
        logger.close()
    if run_dir is not None:
        run_dir.write_summary(summary)
        _print_summary(summary, cfg.run_dir)
    engine.close()
    return ExitCode.OK


def _print_summary(summary: dict, run_dir: str) -> None:
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
    print(f"  metrics: {run_dir}/metrics.jsonl", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        return int(run(args))
    except MecefoError as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return int(exc.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
