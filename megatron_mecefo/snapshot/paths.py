"""Where snapshots live on shared memory (no torch: the launcher imports this)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from megatron_mecefo.config.snapshot import SnapshotConfig

SMP_ENV = "MECEFO_SMP"
"""Set to 1 by mecefo-launch when the node runs a snapshot process."""
SHM_DIR_ENV = "MECEFO_SHM_DIR"
"""Shared-memory root (default /dev/shm)."""
REBUILT_MARKER = "rebuilt.json"
"""Written by the snapshot process into a node folder it rebuilt from parity: {"step": S, ...}."""
NODE_DIR_ENV = "MECEFO_SNAPSHOT_DIR"
"""This node's snapshot folder, set by mecefo-launch for its trainers and its snapshot process."""


def run_snapshot_root(cfg: SnapshotConfig, run_dir: str) -> Path:
    """The run's folder on shared memory: one per run directory (stable across restarts)."""
    base = cfg.dir or os.environ.get(SHM_DIR_ENV) or "/dev/shm"
    tag = hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:12]
    return Path(base) / f"mecefo-{tag}"


def node_dir(cfg: SnapshotConfig, run_dir: str, node: int | None = None) -> Path:
    """This node's folder: `$MECEFO_SNAPSHOT_DIR` under mecefo-launch, else `node<node or 0>`."""
    if node is None and os.environ.get(NODE_DIR_ENV):
        return Path(os.environ[NODE_DIR_ENV])
    return run_snapshot_root(cfg, run_dir) / f"node{node or 0:04d}"
