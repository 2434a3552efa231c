"""This node's snapshot process (`mecefo-smp`, `snapshot/smp.py`): its command and its start.

The agent starts it before the node's ranks (and again if it dies); it owns the node's snapshot
folder in shared memory and outlives any trainer crash. No torch import.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from megatron_mecefo.config.cli import load_run_config, parse_args
from megatron_mecefo.control import keys
from megatron_mecefo.control.proc import ignore_stop_signal
from megatron_mecefo.snapshot.paths import node_dir


def snapshot_process_command(
    trainer_args: list[str], nnodes: int, address: str, ranks: list[int], node: int
) -> tuple[Path | None, list[str] | None]:
    """This node's snapshot folder and `mecefo-smp` command, if the run takes snapshots."""
    try:
        cfg = load_run_config(parse_args(list(trainer_args)))
    except (SystemExit, Exception):  # noqa: BLE001 - the trainers report config errors themselves
        return None, None
    if not cfg.snapshot.enabled:
        return None, None
    directory = node_dir(cfg.snapshot, cfg.run_dir, node=node)
    host = os.environ.get("MECEFO_SMP_HOST") or ("127.0.0.1" if nnodes == 1 else keys.this_host())
    cmd = [
        sys.executable,
        "-m",
        "megatron_mecefo.snapshot.smp",
        "--dir",
        str(directory),
        "--node",
        str(node),
        "--nnodes",
        str(nnodes),
        "--ranks",
        ",".join(map(str, ranks)),
        "--coordinator",
        address,
        "--parity",
        cfg.snapshot.parity,
        "--group",
        str(cfg.snapshot.parity_group),
        "--rs-parity",
        str(cfg.snapshot.rs_parity),
        "--host",
        host,
    ]
    return directory, cmd


def start_snapshot_process(cmd: list[str]) -> subprocess.Popen:
    """Start it in its own session (no signal to the agent's group reaches it)."""
    # pyeclib allocates fresh buffers per encode: without these, page faults cap Reed-Solomon at
    # ~0.4 GB/s instead of ~2 GB/s (docs/snapshot.md)
    env = {
        "MALLOC_MMAP_THRESHOLD_": "1073741824",
        "MALLOC_TRIM_THRESHOLD_": "4294967296",
        **os.environ,
    }
    return subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=ignore_stop_signal)
