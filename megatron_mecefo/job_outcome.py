"""Whether a launch trained to its last step, read from what the job wrote: `launch/local/run.sh`
asks it once its agents have exited, so that its exit code follows what the job did, not which
agent was killed (a head node lost to SIGKILL while a standby finished the job is a finished job).

    python -m megatron_mecefo.job_outcome --since EPOCH_S [--codes "137 0 0"] -- <mecefo-train args>

Exit 0, with one line, when the run directory's `summary.json` was written since `EPOCH_S` and
says the run trained to `training.max_steps` (the summary is the run's completion mark: the
leader writes it once the job raised DONE; a stopped run's summary has `stopped_at`); else exit 1,
silent. No torch import.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_mecefo.config.cli import load_run_config, parse_args
from megatron_mecefo.errors import MecefoError
from megatron_mecefo.metrics.logger import last_logged_step


def trained_to_last_step(run_dir: Path, max_steps: int, since_s: float = 0.0) -> bool:
    """The run in `run_dir` trained to step `max_steps - 1`, as a `summary.json` written at or
    after `since_s` (epoch seconds; an older one is an earlier launch's) says."""
    path = Path(run_dir) / "summary.json"
    try:
        if path.stat().st_mtime < since_s:
            return False
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(summary, dict) or summary.get("stopped_at") is not None:
        return False
    # the last step logged, not a row count: a leader lost between a commit and its row leaves
    # that one row out (docs/failover.md, "Metrics rows")
    return last_logged_step(Path(run_dir) / "metrics.jsonl") == max_steps - 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_mecefo.job_outcome", description=__doc__)
    p.add_argument("--since", type=float, default=0.0, help="when the launch began (epoch s)")
    p.add_argument("--codes", default="", help="the nodes' exit codes, for the line printed")
    p.add_argument("trainer_args", nargs=argparse.REMAINDER, help="-- then mecefo-train args")
    args = p.parse_args(argv)
    trainer_args = args.trainer_args[1:] if args.trainer_args[:1] == ["--"] else args.trainer_args
    try:
        cfg = load_run_config(parse_args(trainer_args))
    except (MecefoError, SystemExit):
        return 1
    max_steps = cfg.training.max_steps
    if not trained_to_last_step(Path(cfg.run_dir), max_steps, args.since):
        return 1
    codes = f" (node exit codes: {args.codes})" if args.codes else ""
    print(
        f"the job trained to its last step (step {max_steps - 1}, {cfg.run_dir}/summary.json)"
        f"{codes}: exit 0",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
