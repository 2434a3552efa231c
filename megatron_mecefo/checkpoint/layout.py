"""On-disk protocol of a checkpoint root (pure; no torch):

    <root>/step_00000012/            files written by dist_checkpointing (every rank)
    <root>/step_00000012/commit.json written last, by one rank, once every file is on disk:
                                     {"step", "next_step", "files": {name: [bytes, sha256]}, ...}

A folder without `commit.json`, or whose files do not match it, is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from megatron_mecefo.errors import CheckpointError

MARKER = "commit.json"
PREFIX = "step_"


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """Folder of the checkpoint taken after `step` steps (i.e. resuming at step `step`)."""
    return Path(root) / f"{PREFIX}{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_marker(folder: Path, next_step: int, extra: dict[str, Any]) -> dict:
    """Checksum every file of `folder` and write the commit marker atomically (last)."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER):
        files[str(path.relative_to(folder))] = [path.stat().st_size, _sha256(path)]
    marker = {"next_step": next_step, "files": files, **extra}
    tmp = folder / (MARKER + ".tmp")
    tmp.write_text(json.dumps(marker, indent=1))
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    tmp.replace(folder / MARKER)
    return marker


def validate(folder: str | os.PathLike) -> dict:
    """The commit marker of a checkpoint whose files all match it.

    Raises:
        CheckpointError: no marker (never committed: a crash during the save), a missing file,
            or a file whose size or checksum differs (corruption), naming what failed.
    """
    folder = Path(folder)
    marker_path = folder / MARKER
    if not marker_path.is_file():
        raise CheckpointError(f"{folder}: no {MARKER} (the save never completed)")
    try:
        marker = json.loads(marker_path.read_text())
        files = marker["files"]
        int(marker["next_step"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{folder}: unreadable {MARKER} ({exc})") from None
    if not files:
        raise CheckpointError(f"{folder}: {MARKER} lists no files")
    for name, (size, digest) in files.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{folder}: file {name} is missing")
        if path.stat().st_size != size or _sha256(path) != digest:
            raise CheckpointError(f"{folder}: file {name} fails its checksum (corrupt)")
    return marker


def candidates(root: str | os.PathLike) -> list[Path]:
    """Step folders under `root`, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def newest_valid(root: str | os.PathLike, log=None) -> tuple[Path, dict] | None:
    """The newest checkpoint that validates; each one skipped is reported through `log`."""
    for folder in candidates(root):
        try:
            return folder, validate(folder)
        except CheckpointError as exc:
            if log is not None:
                log(f"skipping checkpoint: {exc}")
    return None


def prune(root: str | os.PathLike, keep_latest: int, *, keep: Path | None = None) -> list[Path]:
    """Delete all but the newest `keep_latest` committed checkpoints, and uncommitted folders
    older than the newest committed one. `keep` (a save in flight) is never deleted."""
    committed = [p for p in candidates(root) if (p / MARKER).is_file()]
    newest = committed[0].name if committed else None
    doomed = committed[keep_latest:]
    doomed += [
        p
        for p in candidates(root)
        if not (p / MARKER).is_file() and newest is not None and p.name < newest
    ]
    removed = []
    for p in doomed:
        if keep is not None and p.resolve() == keep.resolve():
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed
