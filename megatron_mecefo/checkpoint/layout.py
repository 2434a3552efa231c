"""On-disk protocol of a checkpoint root (pure; no torch):

    <root>/step_00000012/            files written by dist_checkpointing (every rank)
    <root>/step_00000012/commit.json written last, by one rank, once every file is on disk:
                                     {"next_step", "files": {name: [bytes, sha256]},
                                      "identity": {run_id, config_hash, lineage}, ...,
                                      "marker_sha256": SHA-256 of the marker's own content}
    <root>/abandoned/<line>/step_*   checkpoints of an abandoned line (or another run) moved
                                     aside when the current line needs their folder name

A folder without `commit.json`, whose marker fails its own checksum, or whose files do not match
it, is never loaded. What a valid checkpoint *is* (`StateIdentity.relation`) is judged by the
resume policy (`manager.find_resume`) and by `prune`, which only deletes the current line's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_mecefo.errors import CheckpointError

if TYPE_CHECKING:
    from megatron_mecefo.training.identity import StateIdentity

MARKER = "commit.json"
PREFIX = "step_"
ABANDONED = "abandoned"
_STEP_DIR = re.compile(r"step_\d{8}")
_SELF = "marker_sha256"


def checkpoint_root(cfg: Any, run_dir: str) -> Path:
    """The checkpoint root of a `CheckpointConfig`: `dir`, else `<run_dir>/checkpoints`."""
    return Path(cfg.dir) if cfg.dir else Path(run_dir) / "checkpoints"


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """Folder of the checkpoint taken after `step` steps (i.e. resuming at step `step`)."""
    return Path(root) / f"{PREFIX}{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _marker_digest(marker: dict) -> str:
    body = {k: v for k, v in marker.items() if k != _SELF}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_marker(
    folder: Path, next_step: int, extra: dict[str, Any], *, identity: dict | None = None
) -> dict:
    """Checksum every file of `folder` and write the commit marker atomically (last). The
    marker's own checksum covers its identity and step as well as the file list."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER):
        files[str(path.relative_to(folder))] = [path.stat().st_size, _sha256(path)]
    marker = {"next_step": next_step, "files": files, **extra, "identity": identity}
    marker[_SELF] = _marker_digest(marker)
    tmp = folder / (MARKER + ".tmp")
    tmp.write_text(json.dumps(marker, indent=1))
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    tmp.replace(folder / MARKER)
    return marker


def load_marker(folder: str | os.PathLike) -> dict:
    """The commit marker of `folder`, checked against its own checksum (files not checked).

    Raises:
        CheckpointError: no such folder, no marker (the save never completed), or a marker
            that is unreadable or fails its own checksum.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    marker_path = folder / MARKER
    if not marker_path.is_file():
        raise CheckpointError(f"{folder}: no {MARKER} (the save never completed)")
    try:
        marker = json.loads(marker_path.read_text())
        marker["files"].items()
        int(marker["next_step"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{folder}: unreadable {MARKER} ({exc})") from None
    if marker.get(_SELF) != _marker_digest(marker):
        raise CheckpointError(f"{folder}: {MARKER} fails its own checksum (edited or corrupt)")
    if not marker["files"]:
        raise CheckpointError(f"{folder}: {MARKER} lists no files")
    return marker


def read_marker(folder: str | os.PathLike) -> dict | None:
    """`load_marker`, or None when it raises."""
    try:
        return load_marker(folder)
    except CheckpointError:
        return None


def check_files(folder: str | os.PathLike, marker: dict) -> None:
    """Raises CheckpointError naming the first missing file or failed checksum."""
    folder = Path(folder)
    for name, (size, digest) in marker["files"].items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{folder}: file {name} is missing")
        if path.stat().st_size != size or _sha256(path) != digest:
            raise CheckpointError(f"{folder}: file {name} fails its checksum (corrupt)")


def validate(folder: str | os.PathLike) -> dict:
    """The commit marker of a checkpoint whose marker and files all check.

    Raises:
        CheckpointError: see `load_marker` and `check_files`.
    """
    marker = load_marker(folder)
    check_files(folder, marker)
    return marker


def candidates(root: str | os.PathLike) -> list[Path]:
    """Step folders under `root`, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def set_aside(root: str | os.PathLike, folder: Path, marker: dict | None) -> Path:
    """Move a checkpoint that is not on the current line out of the way (never deleted):
    `<root>/abandoned/<its line>/<name>`; returns where it went."""
    line = str(((marker or {}).get("identity") or {}).get("lineage", ["unidentified"])[-1])
    dest = Path(root) / ABANDONED / re.sub(r"[^\w@.-]", "_", line) / folder.name
    n = 1
    while dest.exists():
        dest, n = dest.with_name(f"{folder.name}.{n}"), n + 1
    dest.parent.mkdir(parents=True, exist_ok=True)
    folder.rename(dest)
    return dest


def prune(
    root: str | os.PathLike,
    keep_latest: int,
    identity: StateIdentity,
    *,
    keep: Path | None = None,
) -> list[Path]:
    """Keep the newest `keep_latest` committed checkpoints of the current line (its own and
    its ancestors' up to the branch point) and delete its older ones, plus uncommitted folders
    older than its newest. Checkpoints of other lines or runs are never deleted here. `keep` (a
    save in flight, or the one just committed) is never deleted."""
    line, partial = [], []
    for p in candidates(root):
        if not (p / MARKER).is_file():
            partial.append(p)
            continue
        marker = read_marker(p)
        if marker is None:
            continue  # a corrupt marker: left for a person to look at
        relation = identity.relation(marker.get("identity"), int(marker["next_step"]))
        if relation in ("current", "ancestor"):
            line.append(p)
    newest = line[0].name if line else None
    doomed = line[keep_latest:] + [p for p in partial if newest is not None and p.name < newest]
    removed = []
    for p in doomed:
        if keep is not None and p.resolve() == Path(keep).resolve():
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed
