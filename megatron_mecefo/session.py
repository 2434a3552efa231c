"""One set-up path for a training run, with or without failover: parallel state, the state
identity, recovery, engine, checkpoints, snapshots, the run directory, the loop and the summary.

What differs between a plain (torchrun) run and one under `mecefo-launch` is a `RunControl`
(`training/run_control.py`): `StaticRun` here (megatron's fixed DP group, every rank starts
together, a step commits locally) or failover's `FailoverManager` (a live membership: replicas
leave and rejoin, a step commits by vote, the first live leader owns the run directory). The
session never branches on which. It wires checkpoint, snapshot and recovery, so it sits above
them, beside `train.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_mecefo.errors import ExitCode
from megatron_mecefo.training.hooks import TrainHook
from megatron_mecefo.training.membership import Membership
from megatron_mecefo.training.run_control import RunControl
from megatron_mecefo.training.stop import StopFlag, StopRequest


class StaticRun(RunControl):
    """A plain run: every rank of megatron's DP group trains every step; no failover."""

    def __init__(self, cfg, *, rank: int = 0, world_size: int = 1):
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.first = rank == 0
        self.stop_flag: StopFlag | None = None
        self.start_step = 0

    def open(self, stop_flag: StopFlag) -> None:
        self.stop_flag = stop_flag

    def joined(self, start_step: int) -> None:
        self.start_step = start_step

    def job_summary(self, summary: dict[str, Any]) -> dict[str, Any]:
        """This launch's steps, counted from the metric rows (a resumed run's file holds the
        earlier launches' rows too)."""
        from pathlib import Path

        from megatron_mecefo.metrics.summary import job_wide

        return job_wide(
            summary,
            Path(self.cfg.run_dir) / "metrics.jsonl",
            start_step=self.start_step,
            expected_microbatches=self.num_replicas * self.cfg.training.num_microbatches,
        )

    def init_parallel(self, cfg):
        from megatron_mecefo.mcore.parallel import data_parallel_layout, init_parallel

        ctx = init_parallel(cfg.parallel)
        self.rank, self.world_size, self.first = ctx.rank, ctx.world_size, ctx.is_rank0
        self.membership = Membership.static(*data_parallel_layout())
        return ctx

    def share_identity(self):
        from megatron_mecefo.mcore.collectives import share_over_default_group

        return share_over_default_group()

    def logger(self, component: str):
        if component == "recovery":
            return lambda m: print(f"[recovery] rank {self.rank}: {m}", flush=True)
        return (lambda m: print(m, flush=True)) if self.first else (lambda m: None)

    def should_stop(self, engine, result) -> bool:
        return StopRequest(self.stop_flag, self.world_size).should_stop(engine, result)

    def close(self, engine) -> None:
        engine.close()


def run_session(cfg, control: RunControl, hooks: Sequence[TrainHook] = ()) -> ExitCode:
    """The whole life of one trainer process; returns its exit code."""
    from megatron_mecefo import precheck
    from megatron_mecefo.checkpoint.manager import CheckpointManager
    from megatron_mecefo.checkpoint.resume import resolve
    from megatron_mecefo.config.loader import to_dict
    from megatron_mecefo.mcore.collectives import agree_min_over_default_group
    from megatron_mecefo.metrics.logger import MetricsLogger
    from megatron_mecefo.snapshot.hook import SnapshotHook
    from megatron_mecefo.snapshot.paths import node_dir
    from megatron_mecefo.snapshot.recovery import Recovery
    from megatron_mecefo.training.engine import build_engine
    from megatron_mecefo.training.loop import train
    from megatron_mecefo.training.run_dir import RunDir, already_complete

    control.open(StopFlag().install())
    ctx = control.init_parallel(cfg)
    shm = node_dir(cfg.snapshot, cfg.run_dir) if cfg.snapshot.enabled else None
    identity = resolve(  # what state this run may load (all ranks, in order)
        cfg, dp_size=control.num_replicas, share=control.share_identity(), resume=control.resume
    )
    recovery = Recovery(
        cfg,
        rank=control.rank,
        snapshot_dir=shm,
        identity=identity,
        resume=control.resume,
        agree_min=agree_min_over_default_group(ctx.device),  # over this replica's ranks
        log=control.logger("recovery"),
    )
    # the same run, interrupted before it saved anything (precheck.py): it starts again
    replace = cfg.overwrite or precheck.interrupted_rerun(cfg, control.num_replicas)
    if control.first:  # an occupied run directory fails here, before the expensive part
        RunDir(
            cfg.run_dir,
            overwrite=replace,
            resuming=control.fresh and bool(recovery.candidates()),
        )
    engine = build_engine(
        cfg,
        ctx,
        log=control.logger("engine"),
        membership=control.membership,
        shard_placement=control.shard_placement(),
        init_weights=control.fresh,  # a restarted rank takes its weights from a peer or a save
        **control.data_preparation(),
    )
    ckpt = CheckpointManager(
        cfg.checkpoint,
        cfg.run_dir,
        max_steps=cfg.training.max_steps,
        tp_size=ctx.tp_size,
        pp_size=ctx.pp_size,
        identity=identity,
        saves_here=control.saves_checkpoints,
        log=control.logger("checkpoint"),
    )
    snapshots = SnapshotHook(
        cfg.snapshot,
        shm,
        control.rank,
        max_steps=cfg.training.max_steps,
        log=control.logger("snapshot"),
        identity=identity,
    )
    snapshots.attach(engine)
    start_step = control.start(
        engine, lambda at_most=None: recovery.load(engine, ckpt, at_most=at_most)
    )
    if start_step is None:
        print(f"rank {control.rank}: the job finished before this rank could rejoin", flush=True)
        return ExitCode.OK
    if start_step >= cfg.training.max_steps:  # a rerun of a finished run: touch nothing
        if control.is_writer:
            print(already_complete(cfg, start_step), flush=True)
        control.close(engine)
        return ExitCode.OK
    if control.claims_run_dir():
        run_dir = RunDir(cfg.run_dir, overwrite=replace, resuming=start_step > 0)
        try:
            run_dir.create(cfg, control.layout(ctx), resume_step=start_step, identity=identity)
        except BaseException:
            run_dir.discard_if_created()
            raise
        control.run_dir_created(start_step)
    control.joined(start_step)
    logger = MetricsLogger(
        cfg.logging,
        cfg.run_dir,
        enabled=control.logs_metrics(ctx),
        writer=control.metrics_writer,
        total_steps=cfg.training.max_steps,
        start_step=start_step,
        run_config=to_dict(cfg),
    )
    try:
        summary = train(
            engine, logger, [*hooks, snapshots, ckpt], control=control, start_step=start_step
        )
    finally:
        logger.close()
        control.stop()
    if control.is_writer:
        summary = control.job_summary(summary)
        RunDir(cfg.run_dir, overwrite=True).write_summary(summary)
        print_summary(summary, cfg.run_dir)
    control.close(engine)
    return exit_code_of(summary)


def exit_code_of(summary: dict) -> ExitCode:
    """OK, or PREEMPTED when the run stopped early on request (a final checkpoint was saved)."""
    return ExitCode.OK if summary.get("stopped_at") is None else ExitCode.PREEMPTED


def print_summary(summary: dict, run_dir: str) -> None:
    print(
        f"done: {summary['steps']} steps, loss {summary['first_loss']:.4f} -> "
        f"{summary['final_loss']:.4f}",
        flush=True,
    )
    for step, val in summary["val_losses"]:  # 0-based, as the step lines and metrics.jsonl
        print(f"  val_loss @ step {step:>5}: {val:.4f}")
    floor = summary.get("entropy_floor_nats_per_token")
    if floor is not None and summary["final_val_loss"] is not None:
        print(
            f"  entropy floor of the demo corpus: {floor:.4f} nats/token "
            f"(gap {summary['final_val_loss'] - floor:+.4f})"
        )
    if summary.get("mean_tokens_per_s"):
        print(f"  throughput: {summary['mean_tokens_per_s']:.0f} tokens/s")
    fo = summary.get("failover")
    if fo:
        print(
            f"  failover: {fo['failures']} failure(s), {fo['rejoins']} rejoin(s), "
            f"{fo['steps_redone']} step(s) redone, {fo['steps_degraded']} step(s) with degraded "
            f"micro-batches, samples lost {fo['samples_lost']}, detection ms {fo['detection_ms']}, "
            f"regroup ms {fo['regroup_ms']}"
        )
    if summary.get("stopped_at") is not None:
        print(
            f"  stopped on request after step {summary['stopped_at'] - 1} with a final checkpoint;"
            " relaunch (or requeue) the same command to resume",
            flush=True,
        )
    print(f"  metrics: {run_dir}/metrics.jsonl", flush=True)
