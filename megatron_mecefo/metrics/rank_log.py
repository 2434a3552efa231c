"""Each rank's own output file: with MECEFO_RANK_LOG_DIR set, a trainer sends its stdout and
stderr (file descriptors 1 and 2, so NCCL's and CUDA's C-level messages too) to
`<dir>/rank<RANK>.log`, appended across restarts, each incarnation starting with a header line.

`launch/slurm/pretrain.sbatch` sets it to the try's log folder, so a node's log keeps its agent's
lines and each rank has a file of its own instead of eight ranks interleaved. Without the
variable nothing changes (output goes where the launcher sends it).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

RANK_LOG_DIR_ENV = "MECEFO_RANK_LOG_DIR"


def rank_log_path(rank: int, environ: Mapping[str, str] = os.environ) -> Path | None:
    folder = environ.get(RANK_LOG_DIR_ENV)
    return Path(folder) / f"rank{rank}.log" if folder else None


def redirect_rank_output(environ: Mapping[str, str] = os.environ) -> Path | None:
    """Point fds 1 and 2 at this rank's file (when MECEFO_RANK_LOG_DIR and RANK are set)."""
    rank = environ.get("RANK")
    path = rank_log_path(int(rank), environ) if rank is not None else None
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    print(
        f"[rank {rank}] {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()} on "
        f"{socket.gethostname()}, incarnation {environ.get('MECEFO_INCARNATION', '0')}",
        flush=True,
    )
    return path


def echo_tail(
    log: Callable[[str], None],
    rank: int,
    lines: int = 5,
    environ: Mapping[str, str] = os.environ,
) -> None:
    """For the node agent when a rank dies: name its file and repeat its last lines."""
    path = rank_log_path(rank, environ)
    if path is None or not path.is_file():
        return
    with open(path, "rb") as fh:
        fh.seek(max(0, fh.seek(0, 2) - 8192))
        tail = fh.read().decode(errors="replace").splitlines()[-lines:]
    log(f"rank {rank}'s last lines ({path}):")
    for line in tail:
        log(f"  | {line}")
