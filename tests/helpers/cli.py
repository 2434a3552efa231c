"""Run `mecefo-train` on the tiny demo config as a user would (one process, or N ranks through
launch/local/run.sh under plain torchrun), with a hard timeout; parse its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def demo_args(run_dir, demo_dir, steps, *extra) -> list[str]:
    """`mecefo-train` arguments of the tiny demo job (paths relative to the repository)."""
    return [
        "--config",
        "configs/run/demo_cpu.yaml",
        "--run-dir",
        str(run_dir),
        "--max-steps",
        str(steps),
        f"data.demo_dir={demo_dir}",
        "training.eval_interval=0",
        "logging.print_interval=0",
        *extra,
    ]


def run_train(run_dir, demo_dir, steps, *extra, nproc=1, timeout_s=300):
    """`mecefo-train` for `steps` steps; returns the CompletedProcess (output captured)."""
    args = demo_args(run_dir, demo_dir, steps, *extra)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHON=sys.executable)
    if nproc == 1:
        cmd = [sys.executable, "-m", "megatron_mecefo.train", *args]
    else:
        env.update(NPROC=str(nproc), MECEFO_LAUNCHER="torchrun")
        cmd = ["bash", "launch/local/run.sh", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)


def metric_rows(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
