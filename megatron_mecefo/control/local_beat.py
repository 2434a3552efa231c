"""Node-local heartbeat channel between the trainers and their node agent (no torch import).

At 16k ranks one store cannot take every rank's heartbeat and generation watch (measured:
`tools/bench/control_plane.py`, mode a). So under `mecefo-launch` the heartbeats are aggregated
per node: a trainer's heartbeat thread writes its beat (incarnation, counter, progress, a stop
request) to a file in the agent's folder, and the agent copies every rank's beat into its one
node report (`node/<i>`, `liveness.py`); the agent in turn writes what the trainers must know
(generation, abort, stop) to one control file, refreshed every agent tick, and each new
generation's record to a file, fetched once for the node. So the store sees two requests per node
per agent tick, and one record read per node per generation, whatever the ranks on the node.

Every file is replaced whole (`os.replace`), so a reader never sees half a write. The control
file's `seq` moves every agent tick: a trainer that sees it frozen knows its agent stalled, and
beats to the store itself until it moves again (the per-rank path, kept for exactly this).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

BEAT_DIR_ENV = "MECEFO_BEAT_DIR"
"""Set by the agent for its ranks: the folder of the node-local channel. Unset: a trainer beats
straight to the store (threads as ranks, a trainer started without an agent)."""
AGGREGATE_ENV = "MECEFO_AGGREGATE_HEARTBEATS"
"""`0` makes the agent leave BEAT_DIR_ENV unset (per-rank heartbeats to the store, as before)."""
CONTROL = "control"
AGENT_STALL_S = 0.5
"""A control file frozen this long (five agent ticks) means the agent stalled: its trainers beat
to the store themselves meanwhile, and the coordinator reads their own keys for a node whose
report is this old (`Coordinator._read_node_reports`). Keep the coordinator's soft heartbeat
timeout at 2x this or more, so that a stalled agent's ranks are back on the store in time."""


def _write(path: Path, data: dict) -> None:
    _write_bytes(path, json.dumps(data).encode())


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def beat_path(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}"


@dataclass
class Control:
    """What the agent last told its trainers."""

    seq: int
    gen: int
    abort: str | None = None
    stop: str | None = None
    done: bool = False


def write_control(folder: Path, control: Control) -> None:
    _write(folder / CONTROL, control.__dict__)


def read_control(folder: Path) -> Control | None:
    raw = _read(folder / CONTROL)
    return None if raw is None else Control(**raw)


def write_beat(
    folder: Path, rank: int, incarnation: int, beats: int, progress: str, stop: str | None
) -> None:
    """Trainer side: this rank's latest beat (`stop`: a stop this rank was asked for)."""
    _write(
        beat_path(folder, rank),
        {"inc": incarnation, "beats": beats, "progress": progress, "stop": stop},
    )


def read_beats(folder: Path, incarnations: dict[int, int]) -> dict[int, dict]:
    """Agent side: the beat of each rank's current incarnation (a rank that has not beaten yet,
    or whose file is from a previous incarnation, is left out)."""
    out = {}
    for rank, inc in incarnations.items():
        beat = _read(beat_path(folder, rank))
        if beat is not None and beat.get("inc") == inc:
            out[rank] = beat
    return out


def write_record(folder: Path, gen: int, raw: bytes) -> None:
    """Agent side: generation `gen`'s record as the coordinator published it, fetched once for
    the node (at 16k ranks a record is ~200 KB: one read per rank would be 3 GB per generation
    through the store); records older than the previous one are removed."""
    _write_bytes(folder / f"gen{gen}", raw)
    for old in folder.glob("gen*"):
        if old.name[3:].isdigit() and int(old.name[3:]) < gen - 1:
            old.unlink(missing_ok=True)


def read_record(folder: Path, gen: int) -> bytes | None:
    """Trainer side: generation `gen`'s record if the agent fetched it (None: ask the store)."""
    try:
        return (folder / f"gen{gen}").read_bytes()
    except OSError:
        return None


def _write_bytes(path: Path, raw: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def make_folder(parent: str | None = None) -> Path:
    """A fresh private folder for one agent's channel: in /dev/shm when there is one (no disk).
    Its name carries the agent's pid; folders left by agents that are gone (SIGKILL leaves its
    folder behind) are removed first, so /dev/shm does not fill up across restarts."""
    if parent is None and Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        parent = "/dev/shm"
    remove_orphans(Path(parent or tempfile.gettempdir()))
    return Path(tempfile.mkdtemp(prefix=f"mecefo-beat-{os.getpid()}-", dir=parent))


_JANITOR = """
import os, shutil, sys, time
parent = os.getppid()
while os.getppid() == parent:
    time.sleep(0.5)
shutil.rmtree(sys.argv[1], ignore_errors=True)
"""


def start_janitor(folder: Path):
    """A tiny process (no imports of ours) that removes `folder` once the process that started
    it is gone, however it ended: a SIGKILLed agent leaves no folder in /dev/shm. It is in its
    own session (no signal to the agent's group reaches it) and ends when it has cleaned up."""
    import subprocess
    import sys

    return subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _JANITOR, str(folder)],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def remove_orphans(parent: Path) -> list[Path]:
    """Remove the channel folders in `parent` whose agent process no longer exists."""
    removed = []
    for folder in parent.glob("mecefo-beat-*-*"):
        pid = folder.name.split("-")[2]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
