"""The trainer side of failover: one `FailoverManager` per trainer process under `mecefo-launch`.

It is the session's `RunControl`: it registers and heartbeats, prepares the data without a
special rank, joins the first generation that admits this replica, and per step

    plan = begin_step(step)        form a pending generation (regroup.py), the takeover plan
    result = engine.train_step()   reduce over the LiveMembership, commit by vote (commit.py)
    end_step(result)               a step not committed is redone; a committed one is audited

The protocol, per step attempt (g, step, a):
1. every member reduces gradients on generation g's group; a collective that errors, or that is
   still running when the coordinator publishes a generation without one of g's members, is
   abandoned and recorded (`collectives.py`);
2. the commit vote: an update is applied only if the whole membership reduced (`commit.py`);
3. at the next step start, members adopt the decision's generation if it differs (build its group
   directly on a PrefixStore, then sync state: joiners receive model, optimizer, RNG and step from
   a live peer, `transfer.py`); an aborted step is redone with the new plan. No micro-batch is
   lost or counted twice.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_mecefo.control import keys, local_beat
from megatron_mecefo.control.records import Registration, post_event, posted_events
from megatron_mecefo.data.build_lock import shared_preparation
from megatron_mecefo.errors import DistributedSetupError, QuorumTimeoutError
from megatron_mecefo.failover.liveness.heartbeat import Heartbeat
from megatron_mecefo.failover.trainer import groups
from megatron_mecefo.failover.trainer.collectives import AbortableCollectives, CollectiveBound
from megatron_mecefo.failover.trainer.commit import CommitVote
from megatron_mecefo.failover.trainer.membership import LiveMembership
from megatron_mecefo.failover.trainer.plane import ControlPlane, JobDone
from megatron_mecefo.failover.trainer.regroup import Regroup
from megatron_mecefo.failover.trainer.rerun import AnomalyRerun
from megatron_mecefo.failover.trainer.straggler import StragglerWatch
from megatron_mecefo.failover.trainer.transfer import StateSync
from megatron_mecefo.plan.from_config import plans_for_members
from megatron_mecefo.plan.rebalance import rebalanced_plans
from megatron_mecefo.plan.step_plan import RankStepPlan
from megatron_mecefo.training import boundary
from megatron_mecefo.training import state as train_state
from megatron_mecefo.training.run_control import RunControl
from megatron_mecefo.training.stop import StopFlag

EVENTS_WAIT_S = 15.0
"""How long the leader waits at the end for posted events to reach events.jsonl: an elected
coordinator's lease TTL (5 s), its restore and a tick, with room to spare."""


class FailoverManager(RunControl):
    """Trainer-side failover for one process (see the module docstring for the protocol)."""

    def __init__(
        self,
        cfg,
        *,
        address: str,
        rank: int,
        world_size: int,
        tp_size: int,
        pp_size: int = 1,
        incarnation: int,
        backend: str,
        before_transfer=None,
        log=print,
    ):
        per_replica = tp_size * pp_size
        if world_size % per_replica:
            raise DistributedSetupError(
                f"world size {world_size} is not divisible by TP x PP = {tp_size} x {pp_size}; "
                f"launch a multiple of {per_replica} ranks"
            )
        self.cfg = cfg
        self.fcfg = fcfg = cfg.failover
        self.rank, self.world, self.tp, self.pp = rank, world_size, tp_size, pp_size
        self.replica_size = per_replica
        """Ranks of one replica (TP x PP): a replica is alive only while all of them are."""
        # megatron orders a replica's ranks TP fastest, then PP: position = pp_rank x TP + tp_rank
        self.replica, self.position = divmod(rank, per_replica)
        self.incarnation = incarnation
        self.backend = backend
        self.log = log
        self.first = rank == 0 and incarnation == 0
        self.fresh = incarnation == 0
        # a restarted rank continues the current line, never a rollback the command line asked for
        self.resume = cfg.checkpoint.resume if incarnation == 0 else "auto"
        self.plane = ControlPlane(address, fcfg.coordinator_timeout_s, incarnation=incarnation)
        self.bound = CollectiveBound(
            backend, fcfg.collective_timeout_floor_s, fcfg.collective_timeout_factor
        )
        self.membership = LiveMembership(
            num_replicas=world_size // per_replica,
            replica=self.replica,
            members=(self.replica,),
            group=None,
            generation=0,
            collectives=AbortableCollectives(backend, self._lost, self._reducing, self.bound),
        )
        self.vote = CommitVote(
            self.plane,
            self.membership,
            rank=rank,
            replica_size=per_replica,
            stop_flag=StopFlag(),
            failure_wait_s=fcfg.failure_wait_s,
            regroup_timeout_s=fcfg.regroup_timeout_s,
            log=log,
        )
        self.membership.vote = self.vote
        self.rerun = AnomalyRerun(
            self.plane,
            self.membership,
            self.vote,
            position=self.position,
            writes_events=lambda: self.is_leader,
            timeout_s=cfg.anomaly.check_timeout_s,
            log=log,
        )
        self.straggler = StragglerWatch(cfg.straggler, replica_size=per_replica)
        self._retire_asked = False  # this rank, as leader, asked for a straggler's eviction
        self.vote.pace_of = self.straggler.pace
        if fcfg.audit and self.position == 0:
            self.vote.before_vote = self._log_tasks
        self.sync = StateSync(
            self.plane,
            self.membership,
            rank=rank,
            backend=backend,
            has_state=incarnation == 0,
            log=log,
        )
        self.sync.before_transfer = before_transfer
        self.sync.posts_shard_events = self.position == 0
        self.sync.can_recover = cfg.snapshot.interval > 0 or cfg.checkpoint.interval > 0
        self.rerun.can_roll_back = self.sync.can_recover
        self.regroup = Regroup(
            self.plane,
            self.membership,
            self.sync,
            rank=rank,
            position=self.position,
            backend=backend,
            group_timeout_s=cfg.parallel.timeout_s,
            regroup_timeout_s=fcfg.regroup_timeout_s,
            log=log,
        )
        self.metrics_writer = lambda: self.is_leader
        self._plan_cache: tuple[tuple, RankStepPlan | None] | None = None
        self._step_plan: RankStepPlan | None = None  # this step's, for the audit
        self._engine = None  # the engine of the step in progress, for the audit
        self._job_degraded = False
        self._audit_files: dict[str, Any] = {}  # audit kind -> its open jsonl file

    @property
    def store(self):
        return self.plane.store

    @property
    def num_replicas(self) -> int:
        return self.membership.num_replicas

    @property
    def is_leader(self) -> bool:
        """Writes metrics and the summary: the first rank of the lowest live replica."""
        return self.position == 0 and self.membership.members[0] == self.replica

    is_writer = is_leader

    def _lost(self) -> str | None:
        m = self.membership
        return self.plane.membership_lost(m.generation, m.members)

    def _reducing(self) -> None:
        self.plane.set_phase("reduce")

    # ------------------------------------------------------------------ start-up
    def open(self, stop_flag: StopFlag) -> None:
        self.vote.stop_flag = stop_flag
        self.register()

    def register(self) -> None:
        """Announce this incarnation to the coordinator and start heartbeating."""
        store, fcfg = self.store, self.fcfg
        store.set(keys.progress(self.rank), f"{self.incarnation}:-1:idle")
        reg = Registration(
            incarnation=self.incarnation,
            pid=os.getpid(),
            host=keys.this_host(),
            tp=self.tp,
            pp=self.pp,
            world=self.world,
            node=int(os.environ.get(keys.NODE_RANK_ENV, 0)),
        )
        self.plane.hb = Heartbeat(
            self.plane.address,
            self.rank,
            interval_s=fcfg.heartbeat_interval_s,
            coordinator_timeout_s=fcfg.coordinator_timeout_s,
            stop_flag=self.vote.stop_flag,
            incarnation=self.incarnation,
            beat_dir=os.environ.get(local_beat.BEAT_DIR_ENV),
        )
        recoverable = self.cfg.snapshot.enabled or self.cfg.checkpoint.interval > 0
        recovery = {
            "mode": self.cfg.recovery.mode,
            "recoverable": recoverable,
            "wait_all_s": self.cfg.recovery.wait_all_s,
        }
        store.set(keys.RECOVERY, json.dumps(recovery))
        keys.register(store, self.rank, reg.to_json())
        self.plane.hb.start()

    def init_parallel(self, cfg):
        """Default process group = this replica's TP x PP ranks (on a store prefix of the
        replica's incarnation); then megatron's groups, which see one replica (DP = 1)."""
        from megatron_mecefo.mcore.parallel import init_parallel

        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
        if self.backend == "nccl":  # before the first NCCL group: torch reads it at construction
            groups.apply_nccl_policy(os.environ, cfg.parallel.timeout_s)
        if self.replica_size == 1:
            store = dist.HashStore()
        else:
            client = keys.connect(
                self.plane.address, self.fcfg.regroup_timeout_s, torch_client=True
            )
            store = dist.PrefixStore(f"replica/{self.replica}/{self.incarnation}", client)
        dist.init_process_group(
            self.backend,
            store=store,
            rank=self.position,
            world_size=self.replica_size,
            timeout=timeout,
        )
        return init_parallel(cfg.parallel)

    def share_identity(self):
        # one identity for the launch: the first trainer's proposal, through the store
        from megatron_mecefo.checkpoint.resume import share_over_store

        return share_over_store(self.store)

    def data_preparation(self) -> dict[str, Any]:
        return shared_preparation(
            self.cfg.data,
            self.store,
            builder=self.position == 0,
            rank=self.rank,
            timeout_s=self.fcfg.start_timeout_s,
            log=self.log,
        )

    def logger(self, component: str):
        if component == "engine":
            return (lambda m: print(m, flush=True)) if self.first else (lambda m: None)
        prefix = "checkpoint" if component == "checkpoint" else "recovery"
        return lambda m: print(f"[{prefix}] rank {self.rank}: {m}", flush=True)

    def shard_placement(self) -> dict[str, Any]:
        import os

        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.replica_size))
        return {
            "copies": self.fcfg.shard_copies,
            "replicas_per_node": max(1, local // self.replica_size),
            "placed": False,
        }

    def saves_checkpoints(self) -> bool:
        return self.membership.members[0] == self.replica

    def start(self, engine, load_state) -> int | None:
        """A fresh start loads the newest state it can find; a restarted rank takes it from a
        live peer, or (every replica lost) from the recovery order. None: the job ended first."""
        self.sync.recover = load_state
        if self.incarnation == 0:
            self.plane.next_step = load_state() or 0
        try:
            step = self.join(engine)
        except JobDone:
            return None
        if not self.sync.has_state:  # built without initial weights (`fresh`): never train so
            raise RuntimeError(f"rank {self.rank} joined at step {step} without any state")
        return step

    def join(self, engine) -> int:
        """Wait for a generation that includes this replica, form it, sync state.

        Returns the first step to run. Raises `JobDone` if the job ended meanwhile, and
        `QuorumTimeoutError` if no generation includes this replica within the regroup timeout
        (for instance its TP peer never came back; the agent restarts this rank).
        """
        fcfg = self.fcfg
        wait_s = fcfg.start_timeout_s if self.incarnation == 0 else fcfg.regroup_timeout_s
        deadline = time.monotonic() + wait_s
        while True:
            # the heartbeat's generation (from the agent when aggregated): 16k ranks waiting for
            # the first generation must not poll the store every 20 ms
            gen = self.plane.latest_gen
            if self.plane.job_done():
                raise JobDone()
            if gen > 0 and self.plane.record(gen).admits(self.rank, self.replica, self.incarnation):
                break
            if time.monotonic() > deadline:
                raise QuorumTimeoutError(
                    f"replica {self.replica} was not admitted within {wait_s:.0f} s "
                    "(failover.start_timeout_s / regroup_timeout_s)"
                )
            time.sleep(0.02)
        self.regroup.adopt(engine, gen, f"pg/{gen}", is_leader=lambda: self.is_leader)
        boundary.note_joined(self.plane.next_step)
        return self.plane.next_step

    def layout(self, ctx) -> dict[str, Any]:
        return {
            "world_size": self.world,
            "dp_size": self.num_replicas,
            "tp_size": self.tp,
            "pp_size": self.pp,
            "backend": self.backend,
            "failover": True,
        }

    def logs_metrics(self, ctx) -> bool:
        return self.position == 0

    def claims_run_dir(self) -> bool:
        # the first leader, whichever replica it is: a rank 0 that stalls or dies at start-up
        # cannot leave the job without a run directory (it re-checks: rank 0 may not have)
        return self.is_leader and not self.store.check([keys.RUN_DIR])

    def run_dir_created(self, start_step: int) -> None:
        from megatron_mecefo.metrics.summary import file_size

        store = self.store
        store.set(keys.JOB_START_STEP, str(start_step))
        events_start = file_size(Path(self.cfg.run_dir) / "events.jsonl")  # before the
        store.set(keys.JOB_EVENTS_START, str(events_start))  # coordinator writes this launch's
        store.set(keys.RUN_DIR, f"{os.path.abspath(self.cfg.run_dir)}|{time.time()}")

    def joined(self, start_step: int) -> None:
        from megatron_mecefo.training.run_dir import truncate_audit, truncate_metrics

        if start_step > 0 and self.incarnation > 0:  # a resumed launch: the checkpoint says it
            print(
                f"rank {self.rank} (incarnation {self.incarnation}) rejoined at step {start_step}",
                flush=True,
            )
        if self.is_leader and self.incarnation > 0:  # after an in-job recovery that rolled back
            truncate_metrics(Path(self.cfg.run_dir) / "metrics.jsonl", start_step)
            truncate_audit(Path(self.cfg.run_dir), start_step)

    def job_summary(self, summary: dict[str, Any]) -> dict[str, Any]:
        """A restarted leader saw part of the job: summarise all of it (`metrics/summary.py`)."""
        from megatron_mecefo.metrics.summary import job_wide

        events, events_seq = posted_events(self.store, wait_s=2.0)
        return job_wide(
            summary,
            Path(self.cfg.run_dir) / "metrics.jsonl",
            start_step=keys.get_int(self.store, keys.JOB_START_STEP),
            expected_microbatches=self.num_replicas * self.cfg.training.num_microbatches,
            events=events,
            events_seq=events_seq,
            events_start=keys.get_int(self.store, keys.JOB_EVENTS_START),
        )

    def stop(self) -> None:
        if self.plane.hb is not None:
            self.plane.hb.stop()
        for file in self._audit_files.values():
            file.close()

    # ------------------------------------------------------------------ each step
    def begin_step(self, engine, step: int) -> RankStepPlan:
        if self.vote.pending is not None:
            gen, key = self.vote.pending
            self.vote.pending = None
            self.regroup.adopt(engine, gen, key, is_leader=lambda: self.is_leader)
        self.plane.set_phase("compute", step)
        self._engine = engine
        self._step_plan = self._plan(step) or engine.default_plan()
        return self._step_plan

    def end_step(self, engine, result) -> dict[str, Any]:
        m = self.membership
        self.rerun.after_attempt(engine, result.step, result.committed)
        if not result.committed:
            # the job-wide count, once per aborted attempt: summary.json counts these events
            if self.store.add(keys.redone(m.generation, result.step, self.vote.attempt), 1) == 1:
                post_event(
                    self.store,
                    "step_redone",
                    step=result.step,
                    dp_rank=None,
                    generation=m.generation,
                    attempt=self.vote.attempt - 1,
                )
            return {}
        self.plane.next_step = result.step + 1
        self.bound.step_took(result.step_time_s)
        self._watch_pace(result)
        if self.is_leader:
            self.store.set(keys.COMMITTED, str(result.step))
        if self.fcfg.audit and train_state.is_sharded(engine.optimizer):
            self._log_shards(engine, result.step + 1)
        generation, attempt = self.vote.committed_as
        return {
            "generation": generation,
            "attempt": attempt,  # with the generation, names the tasks audit's committed rows
            "replicas_alive": m.size,
            "job_degraded": bool(self._job_degraded),  # any replica ran degraded micro-batches
        }

    def should_stop(self, engine, result) -> bool:
        return self.vote.stop_after == result.step

    def on_train_end(self, engine, summary: dict[str, Any]) -> None:
        if self.fcfg.audit:
            path = Path(self.cfg.run_dir) / "audit" / f"state_rank{self.rank}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            info = {"next_step": self.plane.next_step, **train_state.digest(engine)}
            path.write_text(json.dumps(info))
        if self.is_leader:
            self._await_events_written()
            keys.raise_flag(self.store, keys.DONE, "1")
        times = self.vote.times_s
        summary["failover"] = {  # this process's view; the job's counts come from events
            "regroups": self.regroup.count,
            "rejoin_bytes": self.sync.rejoin_bytes,
            "rejoin_s": self.sync.rejoin_s,
            "final_generation": self.membership.generation,
            "vote_ms_median": round(1000 * statistics.median(times), 3) if times else None,
        }

    def _await_events_written(self) -> None:
        """Before DONE (after which no candidate campaigns): until the coordinator wrote every
        posted event to events.jsonl, bounded. An elected coordinator killed near the end is
        replaced within its lease TTL, and the new one writes what it left."""
        deadline = time.monotonic() + EVENTS_WAIT_S
        while True:
            posted = keys.get_int(self.store, keys.EVENT_SEQ, 0)
            written = keys.get_int(self.store, keys.EVENTS_WRITTEN, 0)
            if written >= posted:
                return
            if time.monotonic() > deadline:
                print(
                    f"[failover] events.jsonl lacks events {written + 1}..{posted}: no "
                    f"coordinator wrote them within {EVENTS_WAIT_S:.0f} s",
                    flush=True,
                )
                return
            time.sleep(0.05)

    # ------------------------------------------------------------------ plans and audit
    def _watch_pace(self, result) -> None:
        """A committed step: this rank's pace, and the shares the paces it brought call for."""
        watch, m = self.straggler, self.membership
        watch.forget(self.vote.committed_as[0])
        watch.took(result.compute_s)
        if self.vote.last_paces is None:
            return
        # a takeover's shares are uneven by design: its paces say nothing about the machines
        full = len(m.members) == self.num_replicas
        changed = watch.judge(self.vote.last_paces, m.members) if full else False
        if self.is_leader and (watch.too_slow or self._retire_asked):
            # renewed at each comparison, withdrawn once nobody is too slow: a standby that
            # comes later never replaces a replica that has recovered
            if watch.too_slow:
                request = {"replicas": watch.too_slow, "step": result.step + 1}
                self.store.set(keys.RETIRE, json.dumps(request))
            else:
                self.store.delete_key(keys.RETIRE)
            self._retire_asked = bool(watch.too_slow)
        if changed and self.is_leader:
            slow = sorted(r for r, w in (watch.speeds or {}).items() if w < 1.0)
            post_event(
                self.store,
                "rebalanced",
                step=result.step + 1,
                dp_rank=slow[0] if slow else None,
                detail=(
                    f"replica(s) {slow} compute slower than the others: shares in "
                    f"proportion to {json.dumps(watch.speeds)}"
                    if slow
                    else "no straggler: even shares"
                ),
            )

    def _plan(self, step: int) -> RankStepPlan | None:
        members = self.membership.members
        # weights are a generation's: a joiner has none, so the old members forget theirs before
        # the new generation's first step (not at its first commit: a rank replaced and back
        # within one step kept them, and replica 3's samples ran twice, as slices and whole)
        self.straggler.forget(self.membership.generation)
        speeds = self.straggler.speeds
        key = (members, tuple(sorted(speeds.items())) if speeds else None)
        if self._plan_cache is None or self._plan_cache[0] != key:
            plan, self._job_degraded = None, False
            if len(members) == self.num_replicas and speeds:
                plan = rebalanced_plans(
                    speeds,
                    num_microbatches=self.cfg.training.num_microbatches,
                    micro_batch_size=self.cfg.training.micro_batch_size,
                    whole_microbatches=self.cfg.parallel.pipeline_model_parallel_size > 1,
                )[self.replica]
            elif len(members) < self.num_replicas:
                plans = plans_for_members(self.cfg, members, self.num_replicas)
                plan = plans[self.replica]
                self._job_degraded = any(p.num_degraded for p in plans.values())
                if self.is_leader:
                    self._post_takeover(step, plans)
            self._plan_cache = (key, plan)
        return self._plan_cache[1]

    def _post_takeover(self, step: int, plans: dict[int, RankStepPlan]) -> None:
        work = {r: [len(p.tasks), p.num_degraded] for r, p in plans.items() if len(p.tasks) > 0}
        post_event(
            self.store,
            "takeover",
            step=step,
            dp_rank=None,
            generation=self.membership.generation,
            detail=(
                f"policy {self.cfg.mecefo.takeover_policy}; dead {list(self.membership.dead)}; "
                f"replica: [micro-batches, degraded] {json.dumps(work)}"
            ),
        )

    def _log_shards(self, engine, next_step: int) -> None:
        """Each held shard's digest after a committed step: every holder of a shard, and a
        failure-free run, must agree at the same step."""
        digests = {str(s): d for s, d in engine.optimizer.digests().items()}
        line = {"next_step": next_step, "replica": self.replica, "position": self.position}
        self._audit("shards").write(json.dumps({**line, "shards": digests}) + "\n")

    def _audit(self, kind: str):
        """`run_dir/audit/<kind>_rank<R>.jsonl`, opened (line-buffered, appending) on first use."""
        if kind not in self._audit_files:
            path = Path(self.cfg.run_dir) / "audit" / f"{kind}_rank{self.rank}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._audit_files[kind] = open(path, "a", buffering=1)
        return self._audit_files[kind]

    def _log_tasks(self, step: int, generation: int, attempt: int) -> None:
        """This attempt's micro-batches, logged before the vote: the attempt that metrics.jsonl
        names for the step (generation, attempt) is the one that committed them."""
        # a slice adds its sample range: [replica, micro, degraded, start, stop]
        tasks = [
            [t.source_dp_rank, t.micro_index, int(t.degraded), *(t.samples or ())]
            for t in self._step_plan.tasks
        ]
        line = {"step": step, "replica": self.replica, "inc": self.incarnation, "tasks": tasks}
        line["compute_s"] = round(self._engine.last_compute_s, 6)  # this attempt's
        line.update(gen=generation, attempt=attempt)
        line["micro_batch_size"] = self.cfg.training.micro_batch_size
        self._audit("tasks").write(json.dumps(line) + "\n")
