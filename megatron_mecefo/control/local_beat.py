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
The folder is the agent's: removed from outside, it is recreated at the agent's next tick
(`ChannelFolder.ensure`), and a trainer that cannot write its beat meanwhile beats to the store.
No agent removes a folder whose owner lock (`OWNER`) another process holds.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
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


OWNER = ".owner"
"""The file in a channel folder that its agent holds an exclusive `flock` on while it lives. The
lock, not the pid in the folder's name, proves a live owner: a pid can be reused, and an agent in
another pid namespace (a container sharing /dev/shm) has a pid this one cannot see."""
ORPHAN_MIN_AGE_S = 60.0
"""A folder without an owner file (an older version's, or one being created right now) is an
orphan only when its pid is gone and it is at least this old."""


class ChannelFolder:
    """The agent's side of its channel folder: created private, locked for the agent's lifetime
    (`OWNER`), and recreated by `ensure` when something outside removed it."""

    def __init__(self, parent: str | None = None):
        if parent is None and Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
            parent = "/dev/shm"
        remove_orphans(Path(parent or tempfile.gettempdir()))
        self.path = Path(tempfile.mkdtemp(prefix=f"mecefo-beat-{os.getpid()}-", dir=parent))
        self._lock_fd: int | None = None
        self._lock()

    def _lock(self) -> None:
        """Create the owner file already locked (locked under a temporary name, then renamed), so
        no other agent's `remove_orphans` ever finds it unlocked while this agent lives."""
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=f"{OWNER}.")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.replace(tmp, self.path / OWNER)
        except BaseException:
            os.close(fd)
            Path(tmp).unlink(missing_ok=True)
            raise
        if self._lock_fd is not None:
            os.close(self._lock_fd)
        self._lock_fd = fd

    def ensure(self) -> bool:
        """True when the folder (or its owner file) had been removed and is now recreated: the
        caller rewrites what its readers need. Raises `OSError` when it cannot be recreated."""
        if (self.path / OWNER).exists():
            return False
        self.path.mkdir(mode=0o700, exist_ok=True)
        self._lock()
        return True

    def remove(self) -> None:
        """The agent is done: remove the folder and release the lock."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def make_folder(parent: str | None = None) -> ChannelFolder:
    """A fresh private folder for one agent's channel: in /dev/shm when there is one (no disk).
    Its name carries the agent's pid; folders left by agents that are gone (SIGKILL leaves its
    folder behind) are removed first, so /dev/shm does not fill up across restarts."""
    return ChannelFolder(parent)


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
    """Remove the channel folders in `parent` whose agent is gone: nobody holds the lock on
    their owner file (`OWNER`). A folder of a live agent is never removed, whatever its pid."""
    removed = []
    for folder in parent.glob("mecefo-beat-*-*"):
        lock_fd = _orphan_lock(folder)
        if lock_fd is None:
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            if lock_fd >= 0:
                os.close(lock_fd)
        removed.append(folder)
    return removed


def _orphan_lock(folder: Path) -> int | None:
    """None if `folder` may have a live owner; else the fd holding its owner lock (-1: a folder
    without an owner file, whose pid is gone and which is older than `ORPHAN_MIN_AGE_S`)."""
    try:
        fd = os.open(folder / OWNER, os.O_RDWR)
    except FileNotFoundError:
        pid = folder.name.split("-")[2]
        try:
            age_s = time.time() - folder.stat().st_mtime
        except OSError:
            return None
        if pid.isdigit() and not _pid_alive(int(pid)) and age_s >= ORPHAN_MIN_AGE_S:
            return -1
        return None
    except OSError:  # not ours to judge (another user's, a file system that refuses)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its agent lives
        os.close(fd)
        return None
    return fd


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
