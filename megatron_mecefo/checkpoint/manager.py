"""The checkpoint hook: resume at start, save every `interval` steps (async), commit, prune;
and the resume policy (`find_resume`: which checkpoints this run may load).

A failed save never stops training: it is reported and the next interval tries again. A folder
whose save did not complete (no commit marker), whose marker or files fail their checksums, or
that is not on this run's current line (`training.identity`) is never loaded; the recovery order
(`snapshot.recovery`) falls back to the next older one and says why.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_mecefo.checkpoint import layout
from megatron_mecefo.checkpoint.layout import checkpoint_root
from megatron_mecefo.config.checkpoint import CheckpointConfig
from megatron_mecefo.errors import CheckpointError
from megatron_mecefo.training.hooks import TrainHook
from megatron_mecefo.training.identity import StateIdentity, config_changes


def find_resume(
    cfg: CheckpointConfig,
    run_dir: str,
    identity: StateIdentity,
    *,
    resume: str | None = None,
    log: Callable[[str], None] = print,
) -> list[tuple[Path, dict | None]]:
    """The checkpoints `resume` (default `cfg.resume`) may load, newest first: (folder, commit
    marker checked against its own checksum; None if it fails: a committed checkpoint that is
    corrupt). File checksums are checked when one is loaded (`CheckpointManager.resume`).

    `auto` takes the current line only (`StateIdentity.relation`: current or ancestor); an
    abandoned line is logged and never resumed. A named folder is a branch: `identity` already
    starts a new line from it (`identity.resolve`), so it must be that line's parent.

    Raises:
        CheckpointError: the named folder is missing, not committed, corrupt or not the branch
            point; or, under `auto`, the current line was saved with another config, or the only
            checkpoints there belong to another run.
    """
    resume = cfg.resume if resume is None else resume
    if resume == "never":
        return []
    if resume != "auto":
        folder = Path(resume)
        marker = layout.load_marker(folder)
        relation = identity.relation(marker.get("identity"), int(marker["next_step"]))
        if relation != "ancestor":
            raise CheckpointError(
                f"checkpoint.resume={folder}: "
                + (
                    "written without a state identity (by an older version); it cannot be "
                    "checked, so it is not loaded"
                    if relation == "unidentified"
                    else f"not the branch point of lineage {identity.lineage_id}"
                )
            )
        theirs = (marker.get("identity") or {}).get("config_hash")
        note = (
            f"; it was written with config {theirs} ("
            + (config_changes(marker.get("config"), identity.config or {}) or "?")
            + f"), this run has {identity.config_hash}: loaded on purpose"
            if theirs != identity.config_hash
            else ""
        )
        log(
            f"checkpoint.resume={folder}: a rollback/branch at step {marker['next_step']}: new "
            f"lineage {identity.lineage_id} (parent {marker['identity']['lineage'][-1]}){note}"
        )
        return [(folder, marker)]
    root = checkpoint_root(cfg, run_dir)
    found: list[tuple[Path, dict | None]] = []
    foreign, abandoned = [], []
    for folder in layout.candidates(root):
        if not (folder / layout.MARKER).is_file():
            log(f"skipping checkpoint {folder.name}: no {layout.MARKER} (the save never completed)")
            continue
        try:
            marker = layout.load_marker(folder)
        except CheckpointError as exc:
            found.append((folder, None))  # committed but corrupt: tried (and refused) in order
            log(f"checkpoint {exc}")
            continue
        step = int(marker["next_step"])
        relation = identity.relation(marker.get("identity"), step)
        if relation in ("current", "ancestor"):
            found.append((folder, marker))
        elif relation == "changed":
            changes = config_changes(marker.get("config"), identity.config or {})
            raise CheckpointError(
                f"checkpoint {folder} of this run was written with config "
                f"{marker['identity']['config_hash']}, this run's config is "
                f"{identity.config_hash}"
                + (f" ({changes})" if changes else "")
                + ": resume=auto never loads another config's state; to continue from it with "
                f"this config set checkpoint.resume={folder} (a new lineage), to start a new "
                "run use another run_dir or checkpoint.dir"
            )
        elif relation == "abandoned":
            abandoned.append(folder.name)
        else:
            foreign.append((folder, marker, relation))
    if foreign and found:
        log(
            f"checkpoints {', '.join(f.name for f, _, _ in foreign)} belong to another run: ignored"
        )
    if abandoned:
        log(
            f"checkpoints {', '.join(sorted(abandoned))} belong to an abandoned lineage of this "
            "run (rolled back): kept, never resumed"
        )
    if foreign and not found:
        folder, marker, relation = foreign[0]
        who = (
            "written without a state identity (an older version)"
            if relation == "unidentified"
            else f"of run {marker['identity']['run_id']}, config "
            f"{marker['identity']['config_hash']}"
        )
        raise CheckpointError(
            f"{root} holds checkpoints of another run ({folder.name}: {who}; this run is "
            f"{identity.describe()}): resume=auto never loads them and never starts over on "
            "them; set checkpoint.resume=<folder> to branch from one, checkpoint.resume=never "
            "to start a new run beside them, or use another checkpoint.dir"
        )
    return found


SHARD_WAIT_S = 60.0
"""How long the committing rank waits for the other members' optimizer shard files."""
ROLLBACK_WAIT_POLLS = 600
"""Before a rollback, pending async saves get this many completion polls, 0.1 s apart (about
60 s): a count, not a clock, so every rank of the saving group polls (a collective) as often."""


class CheckpointManager(TrainHook):
    """Saves from the ranks `saves_here()` selects (all ranks of the default process group of the
    saving replica), at the same loop points on each of them."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir: str,
        *,
        max_steps: int,
        tp_size: int,
        pp_size: int = 1,
        identity: StateIdentity | None = None,
        saves_here: Callable[[], bool] = lambda: True,
        log: Callable[[str], None] = print,
    ):
        self.cfg = cfg
        self.identity = identity
        """Written into every commit marker; pruning keeps to its line (None: a marker without
        identity, never resumed, and no pruning)."""
        self.root = checkpoint_root(cfg, run_dir)
        self.max_steps = max_steps
        self.tp_size, self.pp_size = tp_size, pp_size
        self.saves_here = saves_here
        self.log = log
        self._saves = None
        self._shards: int | None = None  # the optimizer shards a sharded save must find
        self._queue_started = False
        self.stats: dict[str, Any] = {"saved": [], "failed": 0, "save_block_s": [], "resumed": None}

    @property
    def enabled(self) -> bool:
        return self.cfg.interval > 0

    # ------------------------------------------------------------------ resume
    def resume(self, engine, found: tuple[Path, dict] | None) -> int:
        """Load `found` (from `find_resume`; the caller has checked its files' checksums);
        returns the next step to run (0 when there is nothing to resume)."""
        from megatron_mecefo.mcore import checkpointing

        if found is None:
            return 0
        folder, marker = found
        theirs = (marker.get("tp"), marker.get("pp", 1))
        same_layout = theirs == (self.tp_size, self.pp_size)
        if not same_layout:
            self.log(
                f"checkpoint {folder.name} was written with TP x PP = {theirs[0]} x {theirs[1]}, "
                f"this run has {self.tp_size} x {self.pp_size}: weights and optimizer are "
                "resharded, RNG states start fresh"
            )
        try:
            next_step = checkpointing.load(engine, str(folder), with_rng=same_layout)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            raise CheckpointError(f"cannot load {folder}: {_last_line(exc)}") from exc
        self.stats["resumed"] = {"folder": str(folder), "next_step": next_step}
        self.log(f"resumed from {folder} at step {next_step}")
        return next_step

    # ------------------------------------------------------------------ hook
    def before_step(self, engine, step: int) -> None:
        if self._queue_started or not (self.enabled and self.cfg.async_save and self.saves_here()):
            return
        from megatron_mecefo.mcore import checkpointing

        # megatron's result queue is a Manager process it spawns at the first async save: start
        # it before training, so a job killed mid-run never kills one half-started (its server
        # would print a BrokenPipeError traceback into the log)
        checkpointing.start_writer_queue_ignoring_stop_signals()
        self._queue_started = True

    def after_step(self, engine, result, record: dict[str, Any]) -> None:
        next_step = result.step + 1
        if record.get("stop_requested"):  # the final checkpoint of a stop, even with interval 0
            self.save(engine, next_step)
            return
        if not self.enabled:
            return
        self._poll(blocking=False)
        if next_step % self.cfg.interval == 0 or next_step == self.max_steps:
            self.save(engine, next_step)

    def on_train_end(self, engine, summary: dict[str, Any]) -> None:
        self._poll(blocking=True)
        if self._saves is not None:
            self._saves.close()
            self._saves = None
        summary["checkpoint"] = {
            "saved_steps": self.stats["saved"],
            "failed_saves": self.stats["failed"],
            "resumed": self.stats["resumed"],
            "mean_save_block_s": (
                sum(self.stats["save_block_s"]) / len(self.stats["save_block_s"])
                if self.stats["save_block_s"]
                else None
            ),
        }

    def on_rollback(self, engine) -> None:
        """Let the saves in flight finish and commit before the process exits for a rollback:
        the rollback loads the newest committed checkpoint, and it may be one of them."""
        if self._saves is None or not self._saves.pending:
            return
        self.log(f"rollback: finishing {self._saves.pending} checkpoint save(s) in flight first")
        for _ in range(ROLLBACK_WAIT_POLLS):
            self._poll(blocking=False)  # collective over the saving group: same count on each
            if not self._saves.pending:
                return
            time.sleep(0.1)
        self.log(
            f"warning: {self._saves.pending} checkpoint save(s) did not finish within "
            f"{ROLLBACK_WAIT_POLLS / 10:.0f} s; the rollback uses older state"
        )

    # ------------------------------------------------------------------ save
    def save(self, engine, next_step: int) -> None:
        """Write the checkpoint `step_<next_step>` (async when configured)."""
        from megatron_mecefo.mcore import checkpointing

        folder = layout.step_dir(self.root, next_step)
        start = time.perf_counter()
        sharded = checkpointing.is_sharded(engine.optimizer)
        if not self.saves_here():  # failover: another replica saves the model, this its shards
            if sharded:
                self._write_shards(engine, folder)
            return
        try:
            if checkpointing.default_group_rank() == 0:
                self._clear(folder)
                folder.mkdir(parents=True, exist_ok=True)
            checkpointing.barrier()
            if sharded:
                self._write_shards(engine, folder)
            request = checkpointing.save(
                engine, str(folder), next_step, async_save=self.cfg.async_save
            )
            self._shards = engine.optimizer.layout.num_shards if sharded else None
        except Exception as exc:  # noqa: BLE001 - a failed save must not stop training
            self.stats["failed"] += 1
            self.log(f"warning: checkpoint at step {next_step} failed ({exc}); training goes on")
            return
        self.stats["save_block_s"].append(time.perf_counter() - start)
        if request is None:
            checkpointing.barrier()
            self._commit(folder, next_step, start)
        else:
            if self._saves is None:
                self._saves = checkpointing.AsyncSaves()
            self._saves.schedule(request, lambda: self._commit(folder, next_step, start))

    def _commit(self, folder: Path, next_step: int, start: float) -> None:
        from megatron_mecefo.mcore import checkpointing

        if checkpointing.default_group_rank() != 0:
            return
        if self._shards is not None and not self._shards_complete(folder, self._shards):
            return
        ident = self.identity
        extra = {
            "tp": self.tp_size,
            "pp": self.pp_size,
            "epoch_s": time.time(),
            "config": ident and ident.config,
        }
        layout.write_marker(
            folder, next_step, extra, identity=ident.to_dict() if ident is not None else None
        )
        removed = (
            layout.prune(self.root, self.cfg.keep_latest, ident, keep=folder)
            if ident is not None
            else []
        )
        self.stats["saved"].append(next_step)
        self.log(
            f"checkpoint {folder.name} committed ({time.perf_counter() - start:.1f} s"
            f"{', pruned ' + ', '.join(p.name for p in removed) if removed else ''})"
        )

    def _write_shards(self, engine, folder: Path) -> None:
        """Every member writes the optimizer shards it serves (the distributed optimizer)."""
        from megatron_mecefo.mcore import checkpointing

        try:
            engine.optimizer.write_served(str(folder), *checkpointing.stage_and_tp_rank())
        except Exception as exc:  # noqa: BLE001 - a failed save must not stop training
            self.log(f"warning: optimizer shards of {folder.name} not written ({exc})")

    def _shards_complete(self, folder: Path, num_shards: int) -> bool:
        """Wait (bounded) for every member's shard files; a commit without them would be a
        checkpoint that cannot be resumed."""
        from megatron_mecefo.optim import shard_files

        deadline = time.monotonic() + SHARD_WAIT_S
        while missing := shard_files.missing(folder, self.pp_size, self.tp_size, num_shards):
            if time.monotonic() > deadline:
                self.stats["failed"] += 1
                self.log(
                    f"warning: checkpoint {folder.name} not committed: {len(missing)} optimizer "
                    f"shard files missing after {SHARD_WAIT_S:.0f} s (e.g. {missing[0]})"
                )
                return False
            time.sleep(0.05)
        return True

    def _clear(self, folder: Path) -> None:
        """Make `folder` free for a new save: a checkpoint of another line or run there is moved
        aside (`layout.set_aside`, never deleted); one of this line (a step redone after an
        in-job recovery) loses its marker first, so a crash mid-save leaves no valid-looking
        folder."""
        if not (folder / layout.MARKER).is_file():
            return  # nothing, or a save that never completed: overwritten
        marker = layout.read_marker(folder)
        relation = (
            self.identity.relation(marker.get("identity"), int(marker["next_step"]))
            if marker is not None and self.identity is not None
            else "unidentified"
        )
        if relation not in ("current", "ancestor"):
            dest = layout.set_aside(self.root, folder, marker)
            self.log(f"{folder.name} holds a checkpoint of another lineage or run: moved to {dest}")
            return
        (folder / layout.MARKER).unlink(missing_ok=True)

    def _poll(self, *, blocking: bool) -> None:
        if self._saves is None:
            return
        try:
            self._saves.poll(blocking=blocking)
        except Exception as exc:  # noqa: BLE001 - a failed write is reported, never fatal
            self.stats["failed"] += 1
            self.log(f"warning: an async checkpoint write failed ({exc}); training goes on")


def _last_line(exc: BaseException) -> str:
    """The innermost one-line reason (torch wraps megatron's error in a multi-line report)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]
