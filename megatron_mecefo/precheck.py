"""Everything that can be known before a job starts, checked in one process: the rule is that a
deterministic mistake (configuration, layout, paths, permissions) costs one line and a non-zero
exit, never a start-up of every rank (launch/README.md, "Two rules").

    python -m megatron_mecefo.precheck --world-size 4 [--nodes 2] -- <mecefo-train args>

`launch/local/run.sh` runs it before it starts anything; `mecefo-train --dry-run` and
`mecefo-launch` run the same `check`. Checks: the config itself; the layout (the world divides into
TP x PP, and the global batch); the injections against the job; the run directory (writable, not
holding another run); the data files; the snapshot parity against the node count. A run that is
already complete (its summary reached `training.max_steps` with this config) is told in one line
(exit `COMPLETE`, which the launch scripts turn into 0). A run directory that holds this same run,
interrupted before it saved anything, is not "another run": the same command starts it again.
No torch import.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from megatron_mecefo.config.batch import dp_size, resolve_global_batch
from megatron_mecefo.config.cli import load_run_config, parse_args
from megatron_mecefo.errors import ConfigError, ExitCode, MecefoError

COMPLETE = 10
"""Exit code of this check for a run that is already complete (nothing to start)."""


def check(
    cfg,
    args: argparse.Namespace,
    *,
    world_size: int | None,
    nodes: int | None = None,
    run_dir: bool = True,
    data: bool = True,
):
    """Raise a `MecefoError` for the first problem found; returns the config with the global
    batch resolved for `world_size` ranks (None: not known, e.g. a dry run on a login node).
    `run_dir`: check the run directory too (not on a node that may join a running job).
    `data`: check the data files too (a dry run before preprocessing does not: `unchecked_data`)."""
    from megatron_mecefo.data.pipeline import check_paths
    from megatron_mecefo.testing import inject

    if world_size is not None:
        dp_size(cfg, world_size)  # the world divides into TP x PP
        cfg = resolve_global_batch(cfg, world_size)
    inject.specs_of(args.inject, args.failures, cfg, world_size)
    if run_dir:
        _check_run_dir(cfg, world_size)
    if data:
        check_paths(cfg.data)
    if nodes is not None:
        _check_parity(cfg, nodes)
    return cfg


def unchecked_data(cfg) -> str | None:
    """A dry run before preprocessing (a layout check on a login node): the line saying the
    data files were not checked because none of them exists yet; None when there is something
    to check (then `check` checks every file, and a missing one is an error)."""
    data = cfg.data
    if data.path is None:
        return None  # the demo corpus: generated on first use
    files = [f"{data.path}.bin", f"{data.path}.idx", data.tokenizer_model]
    if any(os.path.exists(f) for f in files):
        return None
    return (
        f"data not checked: none of {', '.join(files)} exists yet (the config and the layout "
        "were checked); preprocess it before launching (README, 'Data'): the launch requires it"
    )


def _check_run_dir(cfg, world_size: int | None = None) -> None:
    from megatron_mecefo.config.batch import world_size_from_env
    from megatron_mecefo.training.run_dir import check_writable, occupied

    check_writable(Path(cfg.run_dir))
    if not occupied(Path(cfg.run_dir)) or cfg.overwrite or _resumable(cfg):
        return
    world = world_size if world_size is not None else world_size_from_env(cfg)
    if interrupted_rerun(cfg, dp_size(cfg, world)):
        return  # the same run, stopped before it saved anything: it starts again
    raise ConfigError(
        f"run_dir {cfg.run_dir} already holds a run and no checkpoint or snapshot to resume; "
        "choose another --run-dir or pass overwrite=true to replace it"
    )


def _resumable(cfg) -> bool:
    """Saved state of this run directory may exist (validated at start-up, not here)."""
    if cfg.checkpoint.resume == "never":
        return False
    if cfg.checkpoint.resume != "auto":
        return True  # a named checkpoint: the start-up checks it
    return _saved(cfg)


def _saved(cfg) -> bool:
    """A committed checkpoint or a snapshot of this run directory exists."""
    from megatron_mecefo.checkpoint import layout
    from megatron_mecefo.snapshot.paths import run_snapshot_root

    ckpt = layout.checkpoint_root(cfg.checkpoint, cfg.run_dir)
    if any((f / layout.MARKER).is_file() for f in layout.candidates(ckpt)):
        return True
    return any(run_snapshot_root(cfg.snapshot, cfg.run_dir).glob("node*/rank*.slot*"))


def interrupted_rerun(cfg, dp: int) -> bool:
    """The run directory holds this same run (its `identity.json` has this config's hash at DP
    size `dp`), stopped before it finished (no `summary.json`) and before it saved anything (no
    committed checkpoint, no snapshot): starting it again from step 0 loses nothing, so the
    command that was interrupted works as it is."""
    from megatron_mecefo.training import identity

    run_dir = Path(cfg.run_dir)
    if (run_dir / "summary.json").exists() or _saved(cfg):
        return False
    saved = identity.read_file(run_dir)
    return saved is not None and saved["config_hash"] == identity.config_hash(cfg, dp)


def _check_parity(cfg, nodes: int) -> None:
    snap = cfg.snapshot
    if not snap.enabled or snap.parity != "rs":
        return  # xor on one node: no other node to hold parity; snapshots still cover crashes
    need = snap.parity_units + 1
    small = min(len(g) for g in snap.parity_groups(nodes))
    if small < need:
        raise ConfigError(
            f"snapshot.parity=rs with rs_parity={snap.rs_parity} needs parity groups of at least "
            f"{need} nodes; this job has {nodes} node(s) (smallest group {small}): lower "
            "snapshot.rs_parity, use parity=xor, or parity=none"
        )


def already_complete(cfg, world_size: int) -> str | None:
    """The one line for a run directory whose run already trained to `training.max_steps` with
    this config (its summary says so, and nothing asks to start over), else None."""
    from megatron_mecefo.training import identity
    from megatron_mecefo.training.run_dir import already_complete as line

    run_dir = Path(cfg.run_dir)
    if cfg.overwrite or cfg.checkpoint.resume != "auto":
        return None
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    saved = identity.read_file(run_dir)
    if summary.get("stopped_at") is not None or saved is None:
        return None
    if saved["config_hash"] != identity.config_hash(cfg, dp_size(cfg, world_size)):
        return None  # another trajectory: the start-up says what changed
    last = (summary.get("start_step") or 0) + int(summary.get("steps") or 0) - 1
    if last != cfg.training.max_steps - 1:
        return None
    return line(cfg, cfg.training.max_steps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_mecefo.precheck", description=__doc__)
    p.add_argument("--world-size", type=int, required=True, help="ranks the job will have")
    p.add_argument("--nodes", type=int, help="nodes the job will have (parity groups)")
    p.add_argument("trainer_args", nargs=argparse.REMAINDER, help="-- then mecefo-train args")
    args = p.parse_args(argv)
    trainer_args = args.trainer_args[1:] if args.trainer_args[:1] == ["--"] else args.trainer_args
    try:
        targs = parse_args(trainer_args)
        cfg = load_run_config(targs)
        with contextlib.suppress(MecefoError):  # a layout error is reported by `check`
            done = already_complete(resolve_global_batch(cfg, args.world_size), args.world_size)
            if done is not None:
                print(done, flush=True)
                return COMPLETE
        check(cfg, targs, world_size=args.world_size, nodes=args.nodes)
    except MecefoError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return int(exc.exit_code)
    except SystemExit as exc:  # argparse: its usage line is already printed
        return int(exc.code or 0) and int(ExitCode.CONFIG_ERROR)
    except KeyboardInterrupt:  # Ctrl-C while the launcher checks: nothing was started
        print("interrupted (SIGINT): nothing was started", file=sys.stderr, flush=True)
        return 130
    return int(ExitCode.OK)


if __name__ == "__main__":
    sys.exit(main())
