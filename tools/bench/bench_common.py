"""Shared by the benchmark scripts: timing, statistics, table cells, JSON output, the machine's
description, and the demo job's command line and run-directory files.

Imported as `bench_common`, as `bench_engine` is: a script run as `python tools/bench/X.py` has
this folder on sys.path already; one that tests load by file path puts it there itself. No torch
import at module level (the control-plane, failover and node-loss benchmarks do not need torch in
the parent process); the timing helpers import it when called.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = ROOT / "configs" / "run" / "demo_cpu.yaml"
"""The run config of the tiny demo job the end-to-end benchmarks launch."""


def bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser whose --help shows the script's docstring as written."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


# -------------------------------------------------------------------------------------- timing
def init_torch(threads: int):
    """torch on `threads` CPU threads and a world-1 `ParallelContext` (its device: the GPU when
    there is one); returns the context."""
    import torch

    from megatron_mecefo.mcore.config import ParallelConfig
    from megatron_mecefo.mcore.parallel import init_parallel

    torch.set_num_threads(threads)
    return init_parallel(ParallelConfig())


def sync() -> None:
    """Wait for the GPU's queued work (nothing on CPU), so that a timer reads finished work."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_train_step(
    engine,
    tasks,
    step: int,
    *,
    num_replicas: int,
    microbatches_per_replica: int,
    micro_batch_size: int | None = None,
) -> float:
    """Seconds of one `Engine.train_step` running `tasks` (`MicroBatchTask`s) as its plan."""
    from megatron_mecefo.plan.step_plan import RankStepPlan

    plan = RankStepPlan(
        tasks=tuple(tasks),
        num_replicas=num_replicas,
        microbatches_per_replica=microbatches_per_replica,
        micro_batch_size=micro_batch_size,
    )
    sync()
    start = time.perf_counter()
    engine.train_step(step, plan)
    sync()
    return time.perf_counter() - start


def fastest_of_rounds(
    run: Callable[[object, int], float], scenarios: dict, reps: int, *, warmup: bool = True
) -> dict:
    """Fastest of `reps` runs per scenario (`run(scenario, step)` -> seconds), the scenarios
    interleaved round by round so that slow drift of the machine's speed hits every scenario
    alike (on a shared CPU interference only ever adds time). With `warmup`, each scenario runs
    once at step 0 first (untimed), the timed rounds at step 1."""
    if warmup:
        for scenario in scenarios.values():
            run(scenario, 0)
    best = {label: math.inf for label in scenarios}
    for _ in range(reps):
        for label, scenario in scenarios.items():
            best[label] = min(best[label], run(scenario, 1))
    return best


# ---------------------------------------------------------------------------------- statistics
def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    data = sorted(values)
    if not data:
        return None
    return data[min(len(data) - 1, max(0, math.ceil(q / 100 * len(data)) - 1))]


def median_of(values: Iterable[float | None]) -> float | None:
    """Median of the values that are not None; None when there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


# -------------------------------------------------------------------------------------- output
def cell(value, spec: str = "", *, scale: float = 1.0, missing: str = "n/a") -> str:
    """One table cell: `value` x `scale` in format `spec`, or `missing` for None."""
    if value is None:
        return missing
    return format(value * scale if scale != 1.0 else value, spec)


def save_json(doc, path: str | os.PathLike, *, indent: int = 2) -> Path:
    """Write `doc` to `path` (folders created; values JSON cannot hold are written as text)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=indent, default=str))
    return out


def write_json(doc, path: str | os.PathLike, *, indent: int = 2, blank_line: bool = True) -> int:
    """`save_json`, then say where (after a blank line); returns 0, a script's exit status."""
    out = save_json(doc, path, indent=indent)
    lead = "\n" if blank_line else ""
    print(f"{lead}wrote {out}")
    return 0


def mem_available_gb() -> float:
    """The kernel's MemAvailable, in GiB (0 where /proc/meminfo does not say)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def machine() -> dict:
    """Where a benchmark ran: CPUs, platform, Python, available memory, local date."""
    import platform

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mem_available_gb": mem_available_gb(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


# ----------------------------------------------------------------------------------- demo jobs
def demo_job_args(
    steps: int, run_dir: str | os.PathLike, demo_dir: str, *extra: str, config=DEMO_CONFIG
) -> list[str]:
    """`mecefo-train` arguments of a demo job of `steps` steps writing to `run_dir`, evaluation
    and step printing off, then `extra` (more overrides or options)."""
    return [
        "--config",
        str(config),
        "--max-steps",
        str(steps),
        "--run-dir",
        str(run_dir),
        f"data.demo_dir={demo_dir}",
        "training.eval_interval=0",
        "logging.print_interval=0",
        *extra,
    ]


def run_demo_job(
    launcher: str, nproc: int, steps: int, run_dir: Path, demo_dir: str, extra=()
) -> dict:
    """Run the demo job to the end and read its run directory back (`run_job`). `launcher`:
    "torchrun", "failover" (`mecefo-launch`, tcp store) or "failover-etcd"."""
    train_args = demo_job_args(steps, run_dir, demo_dir, *extra)
    if launcher.startswith("failover"):
        store = ["--store", "etcd", "--job-id", run_dir.name] if launcher.endswith("etcd") else []
        from megatron_mecefo.failover.node.agent_cli import launch_command

        cmd = launch_command(train_args, nproc_per_node=nproc, flags=store)
    else:
        cmd = torchrun_command(nproc, ["-m", "megatron_mecefo.train", *train_args])
    return run_job(cmd, run_dir, what=launcher)


def run_demo_nodes(
    nnodes: int, standby: int, steps: int, run_dir: Path, demo_dir: str, extra=(), nproc: int = 1
) -> dict:
    """The demo job on `nnodes` simulated nodes of `nproc` ranks (an agent each, node 0 with the
    tcp store) plus `standby` spare agents, to the end; read back as `run_job` does."""
    from megatron_mecefo.failover.node.agent_cli import launch_command

    train_args = demo_job_args(steps, run_dir, demo_dir, *extra)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    start, procs, logs = time.monotonic(), [], []
    for node in range(nnodes + standby):
        where = (
            ["--coordinator-port", str(port)]
            if node == 0
            else ["--coordinator", f"127.0.0.1:{port}"]
        )
        cmd = launch_command(
            train_args, nproc_per_node=nproc, nnodes=nnodes, node_rank=node,
            flags=[*where, *(["--standby"] if node >= nnodes else [])],
        )  # fmt: skip
        logs.append(Path(f"{run_dir}.node{node}.log"))  # a file: an unread pipe fills and blocks
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log))
        if node == 0:
            time.sleep(1.0)  # the store first
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, 900 - (time.monotonic() - start)))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    if procs[0].returncode != 0:
        tail = logs[0].read_text(errors="replace")[-3000:]
        sys.exit(f"error: the {nnodes}-node job failed ({procs[0].returncode}):\n{tail}")
    return _read_run(run_dir, start)


def torchrun_command(nproc: int, entry: list[str], restarts: int = 0) -> list[str]:
    """`torchrun --standalone` of `nproc` processes running `entry`, restarted up to `restarts`
    times."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(restarts),
        *entry,
    ]


def run_job(cmd: list[str], run_dir: Path, timeout_s: float = 900, what: str = "job") -> dict:
    """Run a job's command to its end (one thread per process, library warnings off) and read
    its run directory back: wall time, metrics, events, summary. Exits with the job's output
    tail if it fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        sys.exit(
            f"error: {what} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
            f"{proc.stderr[-3000:]}"
        )
    return _read_run(run_dir, start)


def _read_run(run_dir: Path, start: float) -> dict:
    """A finished job's run directory: wall time since `start`, metrics, events, summary."""
    return {
        "wall_s": time.monotonic() - start,
        "metrics": read_jsonl(run_dir / "metrics.jsonl"),
        "events": read_jsonl(run_dir / "events.jsonl"),
        "summary": json.loads((run_dir / "summary.json").read_text()),
    }


def free_port() -> int:
    """A free TCP port on localhost (for a spawned job's MASTER_PORT)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_demo(demo_dir: str | os.PathLike) -> None:
    """The embedded demo corpus with the default data config, built into `demo_dir` if absent."""
    from megatron_mecefo.data.config import DataConfig
    from megatron_mecefo.data.demo import ensure_demo_corpus

    d = DataConfig()
    ensure_demo_corpus(
        str(demo_dir),
        num_documents=d.demo_num_documents,
        seed=d.demo_seed,
        vocab_size=d.demo_vocab_size,
    )


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The rows of a JSON-lines file (events.jsonl, metrics.jsonl); [] when it does not exist,
    blank lines skipped."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
