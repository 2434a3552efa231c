"""A trainer process under `mecefo-launch`: register, build, join, train, finish.

Megatron sees only this replica (its TP ranks form the default process group, on a store prefix
of the replica's incarnation); everything across replicas goes through the failover membership.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_mecefo.errors import DistributedSetupError, ExitCode
from megatron_mecefo.failover import groups, inject, keys
from megatron_mecefo.failover.manager import FailoverManager, JobDone
from megatron_mecefo.mcore.parallel import resolve_backend
from megatron_mecefo.metrics.summary import file_size, job_wide


def init_replica_parallel(
    cfg, backend: str, address: str, replica: int, tp_rank: int, tp: int, inc: int
):
    """Default process group = this replica's TP ranks; then megatron's groups (DP = 1)."""
    from megatron_mecefo.mcore.parallel import init_parallel

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
    if backend == "nccl":  # before the first NCCL group: torch reads it at construction
        groups.apply_nccl_policy(os.environ, cfg.parallel.timeout_s)
    if tp == 1:
        store = dist.HashStore()
    else:
        client = keys.connect(address, cfg.failover.regroup_timeout_s)
        store = dist.PrefixStore(f"replica/{replica}/{inc}", client)
    dist.init_process_group(backend, store=store, rank=tp_rank, world_size=tp, timeout=timeout)
    return init_parallel(cfg.parallel)


def run_with_failover(cfg, args, say) -> int:
    """The whole life of one trainer process under failover; returns its exit code."""
    from megatron_mecefo.checkpoint.manager import CheckpointManager
    from megatron_mecefo.metrics.logger import MetricsLogger
    from megatron_mecefo.snapshot.hook import SnapshotHook
    from megatron_mecefo.snapshot.paths import node_dir
    from megatron_mecefo.snapshot.recovery import Recovery, agree_min_over_default_group
    from megatron_mecefo.training import identity as state_identity
    from megatron_mecefo.training.engine import build_engine
    from megatron_mecefo.training.loop import train
    from megatron_mecefo.training.run_dir import RunDir, truncate_audit, truncate_metrics

    address = os.environ[keys.COORDINATOR_ENV]
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    incarnation = int(os.environ.get(keys.INCARNATION_ENV, 0))
    tp = cfg.parallel.tensor_model_parallel_size
    if world % tp:
        raise DistributedSetupError(
            f"world size {world} is not divisible by TP = {tp}; launch a multiple of {tp} ranks"
        )
    specs = inject.specs_of(args.inject, args.failures, cfg, world)
    backend = resolve_backend(cfg.parallel)
    from megatron_mecefo.training.stop import StopFlag

    stop_flag = StopFlag().install()
    manager = FailoverManager(
        cfg,
        address=address,
        rank=rank,
        world_size=world,
        tp_size=tp,
        incarnation=incarnation,
        backend=backend,
        injections=specs,
        stop_flag=stop_flag,
        log=lambda m: print(m, flush=True),
    )
    manager.register()
    replica, tp_rank = divmod(rank, tp)
    first = rank == 0 and incarnation == 0
    shm = node_dir(cfg.snapshot, cfg.run_dir) if cfg.snapshot.enabled else None
    log = lambda m: print(f"[recovery] rank {rank}: {m}", flush=True)  # noqa: E731
    ctx = init_replica_parallel(cfg, backend, address, replica, tp_rank, tp, incarnation)
    # one identity for the launch (the first trainer's proposal, through the store); a restarted
    # rank continues the current line, never a rollback the command line asked for at start
    resume = cfg.checkpoint.resume if incarnation == 0 else "auto"
    identity = state_identity.resolve(
        cfg,
        dp_size=world // tp,
        share=state_identity.share_over_store(manager.store),
        resume=resume,
    )
    recovery = Recovery(
        cfg,
        rank=rank,
        snapshot_dir=shm,
        identity=identity,
        resume=resume,
        agree_min=agree_min_over_default_group(ctx.device),  # over this replica's TP ranks
        log=log,
    )
    # a fresh job start (every rank's first incarnation) takes the newest state it can find; a
    # restarted rank takes it from a live peer, or (every replica lost) from the recovery order
    resuming = incarnation == 0 and bool(recovery.candidates())
    run_dir = RunDir(cfg.run_dir, overwrite=cfg.overwrite or not first, resuming=resuming)
    lead_say = say if first else (lambda *a, **k: None)
    engine = build_engine(
        cfg,
        ctx,
        log=lambda m: lead_say(m, flush=True),
        membership=manager.membership,
        **manager.data_preparation(),
    )
    manager.attach(engine)
    ckpt = CheckpointManager(
        cfg.checkpoint,
        cfg.run_dir,
        max_steps=cfg.training.max_steps,
        tp_size=tp,
        identity=identity,
        saves_here=lambda: manager.membership.members[0] == manager.replica,
        log=lambda m: print(f"[checkpoint] rank {rank}: {m}", flush=True),
    )
    manager.recover = lambda: recovery.load(engine, ckpt)
    if incarnation == 0:
        manager.next_step = recovery.load(engine, ckpt) or 0
    snapshots = SnapshotHook(
        cfg.snapshot, shm, rank, max_steps=cfg.training.max_steps, log=log, identity=identity
    )
    snapshots.attach(engine)
    try:
        start_step = manager.join(engine)
    except JobDone:
        say(f"rank {rank}: the job finished before this rank could rejoin", flush=True)
        return ExitCode.OK
    if start_step >= cfg.training.max_steps:  # a rerun of a finished run: touch nothing
        from megatron_mecefo.train import already_complete

        if manager.is_leader:
            say(already_complete(cfg, start_step), flush=True)
        return ExitCode.OK
    if manager.is_leader and not manager.store.check([keys.RUN_DIR]):
        # the first leader, whichever replica it is: a rank 0 that stalls or dies at start-up
        # cannot leave the job without a run directory (it re-checks: rank 0 may not have)
        run_dir = RunDir(cfg.run_dir, overwrite=cfg.overwrite, resuming=start_step > 0)
        layout = {"world_size": world, "dp_size": world // tp, "tp_size": tp, "backend": backend}
        run_dir.create(cfg, {**layout, "failover": True}, resume_step=start_step, identity=identity)
        manager.store.set(keys.JOB_START_STEP, str(start_step))
        events_start = file_size(Path(cfg.run_dir) / "events.jsonl")  # before the coordinator
        manager.store.set(keys.JOB_EVENTS_START, str(events_start))  # writes this launch's events
        manager.store.set(keys.RUN_DIR, f"{os.path.abspath(cfg.run_dir)}|{time.time()}")
    if start_step > 0:
        say(f"rank {rank} (incarnation {incarnation}) rejoined at step {start_step}", flush=True)
    if manager.is_leader and incarnation > 0:  # after an in-job recovery that rolled back
        truncate_metrics(Path(cfg.run_dir) / "metrics.jsonl", start_step)
        truncate_audit(Path(cfg.run_dir), start_step)
    from megatron_mecefo.config.loader import to_dict

    logger = MetricsLogger(
        cfg.logging,
        cfg.run_dir,
        enabled=tp_rank == 0,
        writer=lambda: manager.is_leader,
        total_steps=cfg.training.max_steps,
        start_step=start_step,
        run_config=to_dict(cfg),
    )
    try:
        summary = train(engine, logger, [manager, snapshots, ckpt], start_step=start_step)
    finally:
        logger.close()
        manager.close()
    if manager.is_leader:  # a restarted leader saw part of the job: summarise all of it
        events, events_seq = posted_events(manager.store)
        summary = job_wide(
            summary,
            Path(cfg.run_dir) / "metrics.jsonl",
            start_step=summary["failover"].pop("job_start_step"),
            expected_microbatches=manager.num_replicas * cfg.training.num_microbatches,
            events=events,
            events_seq=events_seq,
            events_start=keys.get_int(manager.store, keys.JOB_EVENTS_START),
        )
        run_dir.write_summary(summary)
        from megatron_mecefo.train import print_summary

        print_summary(summary, cfg.run_dir)
    from megatron_mecefo.train import exit_code_of

    return exit_code_of(summary)


def posted_events(store, wait_s: float = 2.0) -> tuple[list[dict], int]:
    """Every event posted to the store so far, and the last one's sequence number: what
    events.jsonl holds once the coordinator has drained (it copies them every 50 ms; reading the
    store does not wait for it). A poster bumps the counter before it writes the event: one not
    written yet is waited for, at most `wait_s` (its poster may have died in between)."""
    last = keys.get_int(store, keys.EVENT_SEQ, 0)
    names = [keys.event(i) for i in range(1, last + 1)]
    deadline = time.monotonic() + wait_s
    while True:
        present = [k for k in names if store.check([k])]
        if len(present) == len(names) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return ([json.loads(v) for v in store.multi_get(present)] if present else []), last
