"""Run directory: resolved config + environment before step 0, summary.json as the completion mark.

A run directory is *complete* only when `summary.json` exists. If set-up fails before the first
step, a directory this process created is removed, so no partial run dir is left looking valid.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from megatron_mecefo.config.loader import to_dict
from megatron_mecefo.errors import ConfigError
from megatron_mecefo.training.identity import StateIdentity
from megatron_mecefo.training.identity import write_file as write_identity

_PACKAGES = ("torch", "megatron-core", "numpy", "sentencepiece", "megatron-mecefo", "triton")


class RunDir:
    """Owns one run directory on rank 0."""

    def __init__(self, path: str | Path, *, overwrite: bool, resuming: bool = False):
        self.path = Path(path)
        self.created = False
        check_writable(self.path)
        if occupied(self.path) and not (overwrite or resuming):
            raise ConfigError(
                f"run_dir {self.path} already holds a run and no valid checkpoint to resume; "
                "choose another --run-dir or pass overwrite=true to replace it"
            )

    def create(
        self,
        config: Any,
        extra_env: dict[str, Any],
        *,
        resume_step: int = 0,
        identity: StateIdentity | None = None,
    ) -> None:
        """Write config, environment and the state identity. A fresh run (`resume_step` 0) drops
        a previous run's metrics, events, audit and summary; a resumed one keeps its metrics,
        events and audit rows up to `resume_step` (rows of steps it will redo are dropped) and
        only drops the summary."""
        self.created = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        stale = (
            ("summary.json",) if resume_step else ("metrics.jsonl", "events.jsonl", "summary.json")
        )
        for name in stale:
            (self.path / name).unlink(missing_ok=True)
        if resume_step:
            truncate_metrics(self.path / "metrics.jsonl", resume_step)
        truncate_audit(self.path, resume_step)
        if identity is not None:
            write_identity(self.path, identity)
        (self.path / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
        env = {**environment_info(), **extra_env}
        (self.path / "env.json").write_text(json.dumps(env, indent=2))

    def write_summary(self, summary: dict[str, Any]) -> None:
        tmp = self.path / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2))
        tmp.replace(self.path / "summary.json")

    def discard_if_created(self) -> None:
        """Remove the directory if this process created it (set-up failed before step 0)."""
        if self.created and self.path.exists():
            shutil.rmtree(self.path, ignore_errors=True)


def already_complete(cfg, start_step: int) -> str:
    """The one line a rerun of a finished run prints (it changes nothing)."""
    return (
        f"run {cfg.run_dir} is already complete at step {start_step} "
        f"(training.max_steps={cfg.training.max_steps}): nothing to do; raise --max-steps to "
        "train on, or pass overwrite=true with checkpoint.resume=never to start over"
    )


def occupied(path: Path) -> bool:
    """The folder holds a run's metrics (a run was started there)."""
    return (Path(path) / "metrics.jsonl").exists()


def check_writable(path: Path) -> None:
    """A `ConfigError` unless `path` is a writable folder or can be created as one."""
    path = Path(path)
    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        raise ConfigError(f"run_dir {path}: {where} is not a directory; choose another --run-dir")
    what = "run_dir" if where == path else f"run_dir {path}: its parent"
    if not os.access(where, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {where} is not writable; choose another --run-dir")
    try:  # root passes os.access everywhere, yet cannot create a folder in /proc or /sys
        probe = tempfile.mkdtemp(prefix=".mecefo-probe-", dir=where)
    except OSError as exc:
        raise ConfigError(
            f"{what} {where} is not writable (a folder cannot be created there: "
            f"{exc.strerror}); choose another --run-dir"
        ) from None
    os.rmdir(probe)


def truncate_metrics(path: Path, next_step: int) -> None:
    """Keep the metric rows of steps before `next_step` (a crashed run may have logged more, and
    its last row may be cut short: that one is dropped too)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) < next_step:
                keep.append(line)
        except (ValueError, AttributeError):
            pass  # a row cut short by a crash (or a blank line)
    path.write_text("".join(line + "\n" for line in keep))


def truncate_audit(run_dir: Path, next_step: int) -> None:
    """Keep the audit rows (`failover.audit`) of steps before `next_step`; the final-state
    digests are dropped (the run will write them again)."""
    audit = Path(run_dir) / "audit"
    # task rows name the step they ran; shard rows the state they hold (after step next_step - 1)
    for pattern, key, bound in (
        ("tasks_rank*.jsonl", "step", next_step),
        ("shards_rank*.jsonl", "next_step", next_step + 1),
    ):
        for path in audit.glob(pattern):
            keep = []
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line)[key] < bound:
                        keep.append(line)
                except (ValueError, KeyError, TypeError):
                    pass  # a row cut short by a crash
            path.write_text("".join(line + "\n" for line in keep))
    for path in audit.glob("state_rank*.json"):
        path.unlink(missing_ok=True)


def committed_attempts(run_dir: Path) -> dict[int, tuple[int, int]]:
    """step -> (generation, attempt) that committed it, from metrics.jsonl (failover runs)."""
    path = Path(run_dir) / "metrics.jsonl"
    out: dict[int, tuple[int, int]] = {}
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            row = json.loads(line)
            if "attempt" in row:
                out[row["step"]] = (row["generation"], row["attempt"])
        except (ValueError, KeyError, TypeError):
            pass  # a row cut short by a crash
    return out


def is_committed_row(row: dict, attempts: dict[int, tuple[int, int]]) -> bool:
    """A tasks audit row is logged before its vote: it counts if metrics.jsonl names its attempt
    (a row without one, or of a step metrics does not name, counts as before)."""
    if "attempt" not in row or row.get("step") not in attempts:
        return True
    return (row.get("gen"), row["attempt"]) == attempts[row["step"]]


def environment_info() -> dict[str, Any]:
    """Git SHA, package versions, interpreter and host: enough to reproduce a run."""
    versions = {}
    for pkg in _PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "git_sha": _git_sha(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": platform.node(),
        "argv": sys.argv,
        "versions": versions,
    }


def _git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
