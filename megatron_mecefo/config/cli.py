"""The trainer's command line (`mecefo-train`), shared with every process that must read the same
run config from it: the node agent (snapshot settings, injections), the preflight check.

    mecefo-train --config configs/run/demo_cpu.yaml [--run-dir DIR] [--max-steps N] [key=value ...]
"""

from __future__ import annotations

import argparse


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
        help="inject a real failure (kill | hang | exception | stall | starve) of a global rank at "
        "a step, or a silent one (nan|spike:RANK:STEP[:persistent|data], "
        "bitflip:RANK:STEP[:update], slow:RANK:FACTOR:FROM; docs/anomalies.md); repeatable; "
        "needs mecefo-launch",
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
    """The `RunConfig` of a parsed command line (raises ConfigError on a bad one)."""
    from megatron_mecefo.config.loader import load_config
    from megatron_mecefo.config.run import RunConfig

    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"run_dir={args.run_dir}")
    if args.max_steps is not None:
        overrides.append(f"training.max_steps={args.max_steps}")
    return load_config(RunConfig, args.config, overrides)
