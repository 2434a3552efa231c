"""The trainer side of failover: join, per-step plans, abortable collectives, the commit vote,
regroup at step boundaries, and state transfer to (re)joining replicas.

One `FailoverManager` per trainer process. It owns the engine's `membership` (generation, group)
and `commit_vote`, and is the loop's plan hook. The protocol, per step attempt (g, step, a):

1. every member reduces gradients on generation g's group; a collective that errors, or that is
   still running when the coordinator publishes a generation without one of g's members, is
   abandoned and recorded (collectives run on staging copies, so an abandoned one never writes
   into live buffers);
2. the commit vote: members whose reduction succeeded bump `vote/g/step/a`; the one that makes it
   complete sets `decision/g/step/a = commit:<next gen>` with compare-and-set; a member that
   failed (or sees g lose a member) sets `abort:<next gen>` instead. The first write wins, so every
   member applies the same verdict: an update is applied only if the whole membership reduced;
3. at the next step start, members adopt `<next gen>` if it differs (build its group directly on
   a PrefixStore, then sync state: joiners receive model, optimizer, RNG and step from a live
   peer); an aborted step is redone with the new plan. No micro-batch is lost or counted twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import statistics
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_mecefo.errors import FencedError, JobAbortedError, QuorumTimeoutError
from megatron_mecefo.failover import groups, inject, keys, local_beat
from megatron_mecefo.failover.heartbeat import Heartbeat
from megatron_mecefo.failover.inject import Injector
from megatron_mecefo.failover.membership import Membership
from megatron_mecefo.mecefo.config import MecefoConfig
from megatron_mecefo.plan import (
    AccuracyCosts,
    CostModel,
    RankStepPlan,
    flop_cost_model,
    load_accuracy_costs,
    make_step_plans,
)
from megatron_mecefo.training import state as train_state
from megatron_mecefo.training.hooks import TrainHook
from megatron_mecefo.training.stop import StopFlag

_WAIT_SLICE = timedelta(milliseconds=20)


class _Superseded(Exception):
    """A newer generation was published while we waited; retarget it."""

    def __init__(self, gen: int):
        super().__init__(f"superseded by generation {gen}")
        self.gen = gen


class JobDone(Exception):
    """The job finished while this rank waited to join."""


class AbortableCollectives:
    """Collectives on a generation's group that give up when the membership moves on."""

    def __init__(self, manager: FailoverManager):
        self._manager = manager
        self.failed: str | None = None

    def reset(self) -> None:
        self.failed = None

    def all_reduce(self, tensor: torch.Tensor, group) -> bool:
        # issued even after a failure in this step: every member must run the same sequence of
        # collectives on the group, or a later one would pair with a different one elsewhere
        self._manager.set_phase("reduce")
        stage = tensor.clone()  # an abandoned collective may still write into its buffer later
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        error = self._manager.wait_work(group.allreduce([stage], opts), "all-reduce")
        if error is not None:
            self.failed = self.failed or error
            return False
        tensor.copy_(stage)
        return True


class FailoverManager(TrainHook):
    """Trainer-side failover for one process (see the module docstring for the protocol)."""

    def __init__(
        self,
        cfg,
        *,
        address: str,
        rank: int,
        world_size: int,
        tp_size: int,
        incarnation: int,
        backend: str,
        injections=(),
        stop_flag: StopFlag | None = None,
        log=print,
    ):
        self.cfg = cfg
        self.fcfg = cfg.failover
        self.address = address
        self.rank, self.world, self.tp = rank, world_size, tp_size
        self.replica, self.tp_rank = divmod(rank, tp_size)
        self.num_replicas = world_size // tp_size
        self.incarnation = incarnation
        self.backend = backend
        self.log = log
        self.store = keys.connect(address, self.fcfg.coordinator_timeout_s)
        self.collectives = AbortableCollectives(self)
        self.membership = Membership(
            num_replicas=self.num_replicas,
            replica=self.replica,
            members=(self.replica,),
            group=None,
            generation=0,
            collectives=self.collectives,
        )
        self.injector = Injector(injections, self.store, rank, incarnation)
        self.hb: Heartbeat | None = None
        self.stop_flag = stop_flag or StopFlag()
        self._stop_after: int | None = None
        self.recover: Any = None
        """() -> next step or None: the recovery order (snapshot, parity, disk), used when no
        member holds live state (every replica was lost at once)."""
        self.attempt = 0
        self.next_step = 0
        self.has_state = incarnation == 0
        self._pending: tuple[int, str] | None = None
        self._records: dict[int, dict] = {}
        self._plan_cache: tuple[tuple[int, ...], RankStepPlan | None] | None = None
        self._job_degraded = False
        self._graveyard: list[Any] = []  # abandoned groups: never destroyed while work may hang
        self._task_log = None
        self.stats = {
            "steps_redone": 0,
            "steps_degraded": 0,
            "samples_lost": 0,
            "regroups": 0,
            "rejoin_bytes": 0,
            "rejoin_s": None,
        }
        self._done_checked = 0.0
        self._vote_times: list[float] = []  # commit vote wall time per step (incl. waiting)
        self._started = time.monotonic()

    # ------------------------------------------------------------------ start-up
    def register(self) -> None:
        """Announce this incarnation to the coordinator and start heartbeating."""
        self.store.set(keys.progress(self.rank), f"{self.incarnation}:-1:idle")
        reg = {
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "host": keys.this_host(),
            "tp": self.tp,
            "world": self.world,
            "node": int(os.environ.get(keys.NODE_RANK_ENV, 0)),
        }
        self.hb = Heartbeat(
            self.address,
            self.rank,
            interval_s=self.fcfg.heartbeat_interval_s,
            coordinator_timeout_s=self.fcfg.coordinator_timeout_s,
            stop_flag=self.stop_flag,
            incarnation=self.incarnation,
            beat_dir=os.environ.get(local_beat.BEAT_DIR_ENV),
        )
        recoverable = self.cfg.snapshot.enabled or self.cfg.checkpoint.interval > 0
        self.store.set(
            keys.RECOVERY,
            json.dumps(
                {
                    "mode": self.cfg.recovery.mode,
                    "recoverable": recoverable,
                    "wait_all_s": self.cfg.recovery.wait_all_s,
                }
            ),
        )
        keys.register(self.store, self.rank, json.dumps(reg))
        self.hb.start()

    def attach(self, engine) -> None:
        """Give the engine our membership and commit vote (it was built with `membership`)."""
        engine.membership = self.membership
        engine.reducer.membership = self.membership
        engine.commit_vote = self.commit_vote

    def join(self, engine) -> int:
        """Wait for a generation that includes this replica, form it, sync state.

        Returns the first step to run. Raises `JobDone` if the job ended meanwhile, and
        `QuorumTimeoutError` if no generation includes this replica within the regroup timeout
        (for instance its TP peer never came back; the agent restarts this rank).
        """
        wait_s = self.fcfg.start_timeout_s if self.incarnation == 0 else self.fcfg.regroup_timeout_s
        deadline = time.monotonic() + wait_s
        while True:
            # the heartbeat's generation (from the agent when aggregated): 16k ranks waiting for
            # the first generation must not poll the store every 20 ms
            gen = self.hb.latest_gen if self.hb is not None else keys.get_int(self.store, keys.GEN)
            if self._job_done():
                raise JobDone()
            if gen > 0 and self._admits_me(self._record(gen)):
                break
            if time.monotonic() > deadline:
                raise QuorumTimeoutError(
                    f"replica {self.replica} was not admitted within {wait_s:.0f} s "
                    "(failover.start_timeout_s / regroup_timeout_s)"
                )
            time.sleep(0.02)
        self._adopt(engine, gen, f"pg/{gen}")
        return self.next_step

    def _admits_me(self, record: dict) -> bool:
        """The generation lists this replica, for this incarnation of this rank."""
        incs = record.get("incarnations", {})
        mine = incs.get(str(self.rank), self.incarnation)
        return self.replica in record["members"] and mine == self.incarnation

    def data_preparation(self) -> dict[str, Any]:
        """`build_engine`'s data arguments under failover. No rank is special, so a stalled or
        restarted rank 0 cannot leave the others waiting: every replica's TP rank 0 is a builder;
        builders take turns under a file lock beside the data (the first builds, the others find
        the cache; a dead builder's lock goes with its process), then mark the data ready in the
        store. The other TP ranks wait for that mark."""
        if self.tp_rank == 0:
            return {"data_rank": 0, "data_barrier": lambda: None, "data_guard": self._data_lock}
        return {"data_rank": 1, "data_barrier": self._wait_data_ready, "data_guard": None}

    @contextlib.contextmanager
    def _data_lock(self):
        from megatron_mecefo.data.pipeline import build_dir

        folder = Path(build_dir(self.cfg.data)).absolute()
        folder.parent.mkdir(parents=True, exist_ok=True)
        # beside the folder, not in it: the demo corpus refuses a folder holding anything else
        with open(folder.parent / f".{folder.name}.mecefo-build.lock", "a+") as fh:
            deadline = time.monotonic() + self.fcfg.start_timeout_s
            next_note = time.monotonic() + 30
            while True:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise QuorumTimeoutError(
                            f"another rank held the data-preparation lock in {folder} for "
                            f"{self.fcfg.start_timeout_s:.0f} s (failover.start_timeout_s)"
                        ) from None
                    if time.monotonic() > next_note:
                        self.log(f"rank {self.rank}: waiting for another rank to prepare the data")
                        next_note += 30
                    time.sleep(0.1)
            try:
                yield
                self.store.set(keys.DATA_READY, "1")
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _wait_data_ready(self) -> None:
        deadline = time.monotonic() + self.fcfg.start_timeout_s
        while not self.store.check([keys.DATA_READY]):
            if time.monotonic() > deadline:
                raise QuorumTimeoutError(
                    f"no replica prepared the data within {self.fcfg.start_timeout_s:.0f} s "
                    "(failover.start_timeout_s)"
                )
            time.sleep(0.05)

    # ------------------------------------------------------------------ hook
    def plan_for_step(self, engine, step: int) -> RankStepPlan | None:
        if self._pending is not None:
            gen, key = self._pending
            self._pending = None
            self._adopt(engine, gen, key)
        self.set_phase("compute", step)
        self.injector.maybe_fire(step, self.membership.generation)
        return self._plan(step)

    def after_step(self, engine, result, record: dict[str, Any]) -> None:
        m = self.membership
        self.next_step = result.step + 1
        expected = m.num_replicas * self.cfg.training.num_microbatches
        self.stats["samples_lost"] += max(0, expected - result.global_microbatches)
        plan = self._plan_cache[1] if self._plan_cache else None
        self.stats["steps_degraded"] += int(self._job_degraded)
        record["generation"] = m.generation
        record["replicas_alive"] = m.size
        record["global_microbatches"] = result.global_microbatches
        record["job_degraded"] = bool(self._job_degraded)  # any replica ran degraded micro-batches
        if self.fcfg.audit and self.tp_rank == 0:
            self._log_tasks(engine, result.step, plan)

    def should_stop(self, engine, result) -> bool:
        return self._stop_after == result.step

    def on_step_aborted(self, engine, result) -> None:
        self.stats["steps_redone"] += 1
        attempt = f"redone/{self.membership.generation}/{result.step}/{self.attempt}"
        if self.store.add(attempt, 1) == 1:  # the job-wide count, once per aborted attempt
            self.store.add(keys.STEPS_REDONE, 1)
            keys.post_event(  # summary.json counts these (metrics/summary.py)
                self.store,
                "step_redone",
                step=result.step,
                dp_rank=None,
                generation=self.membership.generation,
                attempt=self.attempt - 1,
            )

    def on_train_end(self, engine, summary: dict[str, Any]) -> None:
        if self.fcfg.audit:
            path = Path(self.cfg.run_dir) / "audit" / f"state_rank{self.rank}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            info = {"next_step": self.next_step, **train_state.digest(engine)}
            path.write_text(json.dumps(info))
        if self.is_leader:
            keys.raise_flag(self.store, keys.DONE, "1")
        summary["failover"] = self.summary()

    # ------------------------------------------------------------------ plans
    @property
    def is_leader(self) -> bool:
        """Writes metrics and the summary: TP rank 0 of the lowest live replica."""
        return self.tp_rank == 0 and self.membership.members[0] == self.replica

    def _plan(self, step: int) -> RankStepPlan | None:
        members = self.membership.members
        if self._plan_cache is None or self._plan_cache[0] != members:
            plan, self._job_degraded = None, False
            if len(members) < self.num_replicas:
                plans = make_step_plans(
                    alive=members,
                    num_replicas=self.num_replicas,
                    num_microbatches=self.cfg.training.num_microbatches,
                    policy=self.cfg.mecefo.takeover_policy,
                    cost=self._cost_model(),
                    target_ratio=self.cfg.mecefo.hybrid_target_ratio,
                    choose_techniques=self.cfg.mecefo.hybrid_techniques == "auto",
                    allowed_techniques=self.cfg.mecefo.techniques,
                    granularity=self.cfg.mecefo.takeover_granularity,
                    micro_batch_size=self.cfg.training.micro_batch_size,
                    objective=self.cfg.mecefo.hybrid_objective,
                    accuracy_budget=self.cfg.mecefo.hybrid_accuracy_budget,
                    accuracy=self._accuracy_costs()
                    if self.cfg.mecefo.takeover_policy == "hybrid"
                    else None,
                )
                plan = plans[self.replica]
                self._job_degraded = any(p.num_degraded for p in plans.values())
                if self.is_leader:
                    self._post_takeover(step, plans)
            self._plan_cache = (members, plan)
        return self._plan_cache[1]

    def _accuracy_costs(self) -> AccuracyCosts:
        """The measured accuracy-cost table; where the run skips attention in other layers than
        the table was measured at, the skip's part is scaled by the ratio of skipped layers."""
        mec, layers = self.cfg.mecefo, self.cfg.model.num_layers
        table = load_accuracy_costs(mec.accuracy_costs or None)
        if table.skip_attention_layers == mec.skip_attention_layers:
            return table
        measured = MecefoConfig(skip_attention_layers=table.skip_attention_layers)
        ours = len(mec.skip_layer_indices(layers))
        return table.with_skip_fraction(ours / len(measured.skip_layer_indices(layers)))

    def _cost_model(self) -> CostModel:
        """FLOP fallback cost model, with a cost for every subset of the configured techniques
        (the candidates of `hybrid_techniques: auto`)."""
        mc, mec = self.cfg.model, self.cfg.mecefo
        return flop_cost_model(
            allowed=mec.techniques,
            num_layers=mc.num_layers,
            hidden_size=mc.hidden_size,
            ffn_hidden_size=mc.ffn_hidden_size,
            seq_length=mc.seq_length,
            vocab_size=mc.vocab_size,
            micro_batch_size=self.cfg.training.micro_batch_size,
            rank_fraction=mec.rank if mec.rank < 1 else mec.rank / mc.hidden_size,
            skip_layer_fraction=len(mec.skip_layer_indices(mc.num_layers)) / mc.num_layers,
        )

    def _post_takeover(self, step: int, plans: dict[int, RankStepPlan]) -> None:
        work = {r: [len(p.tasks), p.num_degraded] for r, p in plans.items() if len(p.tasks) > 0}
        keys.post_event(
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

    # ------------------------------------------------------------------ progress / waiting
    def set_phase(self, phase: str, step: int | None = None) -> None:
        if self.hb is not None:
            s = self.next_step if step is None else step
            self.hb.progress = f"{self.incarnation}:{s}:{phase}"

    def wait_work(self, work, what: str, *, p2p: bool = False) -> str | None:
        """Poll an async collective; the reason it failed or was abandoned, or None if done.

        Gloo's send/recv work never reports `is_completed()`; with `p2p` a helper thread waits
        on it and we poll the thread instead.
        """
        if p2p:
            done = threading.Event()
            errors: list[BaseException] = []

            def waiter() -> None:
                try:
                    work.wait()
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    errors.append(exc)
                done.set()

            threading.Thread(target=waiter, name="mecefo-p2p-wait", daemon=True).start()
            work = _ThreadWork(done, errors)
        if self.backend == "gloo" and not p2p:
            return self._wait_gloo(work, what)
        delay, last_check = 0.0, time.monotonic()
        while not work.is_completed():
            time.sleep(delay)
            delay = min(2 * delay or 5e-5, 1e-3)
            now = time.monotonic()
            if now - last_check > 0.02:
                last_check = now
                lost = self._membership_lost()
                if lost is not None:
                    return f"{what} abandoned: {lost}"
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses
            return f"{what} failed: {str(exc).splitlines()[0]}"
        return None

    def _wait_gloo(self, work, what: str) -> str | None:
        """Gloo work honours `wait(timeout)` without breaking the collective: block in slices
        (woken the moment it completes), checking the membership between slices."""
        while True:
            try:
                work.wait(_WAIT_SLICE)
                return None
            except RuntimeError:
                if work.is_completed():  # finished meanwhile, or failed: ask it which
                    try:
                        work.wait()
                        return None
                    except RuntimeError as exc:
                        return f"{what} failed: {str(exc).splitlines()[0]}"
            lost = self._membership_lost()
            if lost is not None:
                return f"{what} abandoned: {lost}"

    def _membership_lost(self) -> str | None:
        """Whether a generation newer than ours dropped one of our members."""
        latest = self.hb.latest_gen if self.hb is not None else 0
        if latest <= self.membership.generation:
            return None
        members = set(self._record(latest)["members"])
        gone = [r for r in self.membership.members if r not in members]
        return f"generation {latest} removed replicas {gone}" if gone else None

    def _record(self, gen: int) -> dict:
        """Generation `gen`'s record: from the agent's folder when it fetched it for the node
        (aggregated heartbeats), else from the store."""
        if gen not in self._records:
            beat_dir = self.hb.beat_dir if self.hb is not None else None
            raw = local_beat.read_record(beat_dir, gen) if beat_dir is not None else None
            if raw is None:
                raw = self.store.get(keys.gen_record(gen))
            self._records[gen] = json.loads(raw)
        return self._records[gen]

    # ------------------------------------------------------------------ commit vote
    def commit_vote(self, step: int, ok: bool) -> bool:
        """Same verdict on every member: commit iff every member's reduction succeeded.

        TP = 1: one tiny all-reduce of the members' success flags (every member issues it, so
        the collective sequence never diverges); a member that sees all of them succeed writes
        `commit` with compare-and-set. TP > 1: a store counter over every rank of every member
        (a TP slice's all-reduce cannot vouch for the other slices).
        """
        t0 = time.perf_counter()
        m = self.membership
        g, a = m.generation, self.attempt
        dkey = keys.decision(g, step, a)
        latest = max(g, self.hb.latest_gen)
        verdict = None
        # the writer of the decision also decides a requested stop, so every member agrees on it
        commit = f"commit:{latest}:stop" if self.stop_flag.is_set else f"commit:{latest}"
        if self.tp == 1:
            votes = torch.tensor([1.0 if ok else 0.0], dtype=torch.float64)
            if m.all_reduce(votes) and ok and int(votes.item()) == m.size:
                verdict = self.store.compare_set(dkey, "", commit).decode()
        elif ok:
            count = self.store.add(keys.vote(g, step, a), 1)
            if count == m.size * self.tp:
                verdict = self.store.compare_set(dkey, "", commit).decode()
            else:
                verdict = self._await_decision(dkey, g, failed=False)
        if verdict is None:
            verdict = self._await_decision(dkey, g, failed=True)
        self._vote_times.append(time.perf_counter() - t0)
        kind, next_gen, *flags = verdict.split(":")
        committed, next_gen = kind == "commit", int(next_gen)
        if committed:
            self.attempt = 0
            if "stop" in flags:
                self._stop_after = step
        else:
            self.attempt += 1
            why = self.collectives.failed or "another member's reduction failed"
            self.log(f"[failover] rank {self.rank}: step {step} not committed ({why}); redoing")
        if next_gen != g:
            self._pending = (next_gen, f"pg/{next_gen}")
        elif not committed:  # same members, but the group saw an error: rebuild it
            self._pending = (g, f"pg/{g}/s{step}a{a}")
        return committed

    def _await_decision(self, dkey: str, g: int, *, failed: bool) -> str:
        start = time.monotonic()
        delay, last_gen_check = 0.0, 0.0
        while True:
            if self.store.check([dkey]):
                return self.store.get(dkey).decode()
            now = time.monotonic()
            if now - last_gen_check > 0.02:
                last_gen_check = now
                latest = keys.get_int(self.store, keys.GEN)
                if latest > g:
                    gone = set(self.membership.members) - set(self._record(latest)["members"])
                    if gone:
                        return self.store.compare_set(dkey, "", f"abort:{latest}").decode()
                if failed and now - start > self.fcfg.failure_wait_s:
                    return self.store.compare_set(dkey, "", f"abort:{max(g, latest)}").decode()
            if now - start > self.fcfg.regroup_timeout_s:
                raise QuorumTimeoutError(
                    f"no commit decision for generation {g} within {self.fcfg.regroup_timeout_s} s"
                )
            time.sleep(delay)
            delay = min(2 * delay or 1e-4, 2e-3)

    # ------------------------------------------------------------------ regroup
    def _adopt(self, engine, gen: int, key: str) -> None:
        """Form generation `gen` (or a newer one if it is superseded meanwhile) and sync state."""
        deadline = time.monotonic() + self.fcfg.regroup_timeout_s
        t0 = time.monotonic()
        self.set_phase("idle")
        while True:
            members = tuple(self._record(gen)["members"])
            if self.replica not in members:
                raise FencedError(
                    f"replica {self.replica} is not in generation {gen} (declared dead); "
                    "exiting so the agent restarts it to rejoin"
                )
            try:
                group = self._build_group(key, members, gen, deadline)
                self._install(gen, members, group)
                self._sync_state(engine, gen, deadline)
                break
            except _Superseded as newer:
                gen, key = newer.gen, f"pg/{newer.gen}"
        self.stats["regroups"] += 1
        self.log(
            f"[failover] rank {self.rank}: generation {gen}, members {list(members)}, "
            f"formed in {1000 * (time.monotonic() - t0):.0f} ms"
        )
        record = self._record(gen)
        if self.is_leader and gen > 1:
            failed_at = record.get("failure_epoch_s")
            keys.post_event(
                self.store,
                "regroup",
                step=self.next_step,
                dp_rank=(record["removed"] or record["added"] or [None])[0],
                generation=gen,
                **({"latency_ms": 1000 * (time.time() - failed_at)} if failed_at else {}),
                detail=f"{record['reason']}: members {list(members)}, removed "
                f"{record['removed']}, added {record['added']}",
            )

    def _build_group(self, key: str, members: tuple[int, ...], gen: int, deadline: float):
        if len(members) == 1:
            return None
        pos, size = members.index(self.replica), len(members)
        timeout = timedelta(seconds=self.cfg.parallel.timeout_s)
        result: dict[str, Any] = {}

        def build() -> None:
            try:
                client = keys.connect(self.address, self.fcfg.regroup_timeout_s)
                prefix = dist.PrefixStore(f"{key}/tp{self.tp_rank}", client)
                result["group"] = _new_group(self.backend, prefix, pos, size, timeout)
            except Exception as exc:  # noqa: BLE001 - surfaced below
                result["error"] = exc

        thread = threading.Thread(target=build, name=f"mecefo-group-{gen}", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.01)
            self._check_superseded(gen, deadline)
        if "error" in result:
            self.log(
                f"[failover] rank {self.rank}: building generation {gen} failed: "
                f"{result['error']}; waiting for the coordinator"
            )
            raise _Superseded(self._wait_newer_generation(gen, deadline))
        return result["group"]

    def _job_done(self) -> bool:
        """The job finished (the leader set DONE): from the agent's control file, else asked of
        the store at most every 0.2 s."""
        if self.hb is not None and self.hb.job_done:
            return True
        now = time.monotonic()
        if now - self._done_checked > 0.2:
            self._done_checked = now
            return self.store.check([keys.DONE])
        return False

    def _check_superseded(self, gen: int, deadline: float) -> None:
        latest = self.hb.latest_gen
        if latest > gen:
            raise _Superseded(latest)
        if self._job_done():  # a late joiner: the others finished meanwhile
            raise JobDone()
        if time.monotonic() > deadline:
            raise QuorumTimeoutError(
                f"generation {gen} did not form within {self.fcfg.regroup_timeout_s} s"
            )

    def _wait_newer_generation(self, gen: int, deadline: float) -> int:
        while True:
            latest = self.hb.latest_gen if self.hb is not None else 0
            if latest <= gen:  # the heartbeat's copy lags by up to a beat: ask the store
                latest = keys.get_int(self.store, keys.GEN)
            if latest > gen:
                return latest
            if self._job_done():
                raise JobDone()
            if time.monotonic() > deadline:
                raise QuorumTimeoutError(f"no new generation after {gen} failed to form")
            time.sleep(0.02)

    def _install(self, gen: int, members: tuple[int, ...], group) -> None:
        m = self.membership
        if m.group is not None:  # NCCL: aborted and destroyed; gloo: kept (failover/groups.py)
            groups.retire_group(m.group, self.backend, self._graveyard, log=self.log)
        if gen != m.generation:
            self.attempt = 0  # vote keys are per (generation, step, attempt)
        m.generation, m.members, m.group = gen, members, group
        self.collectives.reset()

    def _sync_state(self, engine, gen: int, deadline: float) -> None:
        """Agree on the newest state among members; send it to any member that lacks it."""
        m = self.membership
        mine = self.next_step if self.has_state else -1
        best, steps = self._exchange_steps(mine, gen, deadline)
        if best < 0 and self.recover is not None:  # every replica was lost: recovery order
            recovered = self.recover()
            if recovered is not None:
                self.next_step, self.has_state = recovered, True
                keys.post_event(
                    self.store,
                    "recovery",
                    step=recovered,
                    dp_rank=self.replica,
                    ranks=[self.rank],
                    generation=gen,
                    latency_ms=1000 * (time.monotonic() - self._started),
                    detail=f"no live replica: loaded step {recovered} locally",
                )
            best, steps = self._exchange_steps(
                self.next_step if self.has_state else -1, gen, deadline
            )
        if best < 0:  # a joiner whose only source died mid-transfer, with nothing saved
            reason = "no live replica holds the training state to rejoin from, and none is saved"
            if self.store.compare_set(keys.ABORT, "", reason).decode() == reason:
                self.store.append(keys.FLAGS, f"{keys.ABORT};")
                keys.post_event(
                    self.store, "abort", step=self.next_step, dp_rank=None, detail=reason
                )
            raise JobAbortedError(reason)
        if m.size == 1:
            return
        source = int((steps == best).nonzero()[0])
        receivers = [i for i in range(m.size) if int(steps[i]) < best]
        if not receivers:
            return
        t0 = time.monotonic()
        if m.position == source or m.position in receivers:
            self.injector.maybe_fire(inject.AT_REJOIN, gen)
        if m.position == source:
            payload = train_state.to_bytes(train_state.state_dict(engine, best))
            size = torch.tensor([payload.numel()], dtype=torch.int64)
            for dst in receivers:
                for tag, tensor in ((1, size), (2, payload)):
                    if (
                        self.wait_work(m.group.send([tensor], dst, tag), "state send", p2p=True)
                        is not None
                    ):
                        raise _Superseded(self._wait_newer_generation(gen, deadline))
            self.log(
                f"[failover] rank {self.rank}: sent state of step {best} "
                f"({payload.numel() / 1e6:.2f} MB) to replicas {[m.members[i] for i in receivers]}"
            )
        elif m.position in receivers:
            size = torch.zeros(1, dtype=torch.int64)
            if self.wait_work(m.group.recv([size], source, 1), "state receive", p2p=True):
                raise _Superseded(self._wait_newer_generation(gen, deadline))
            payload = torch.empty(int(size), dtype=torch.uint8)
            if self.wait_work(m.group.recv([payload], source, 2), "state receive", p2p=True):
                raise _Superseded(self._wait_newer_generation(gen, deadline))
            self.next_step = train_state.load_state_dict(engine, train_state.from_bytes(payload))
            self.has_state = True
            elapsed = time.monotonic() - t0
            self.stats["rejoin_bytes"] = int(payload.numel())
            self.stats["rejoin_s"] = elapsed
            keys.post_event(
                self.store,
                "rejoin",
                step=self.next_step,
                dp_rank=self.replica,
                ranks=[self.rank],
                generation=gen,
                latency_ms=1000 * (time.monotonic() - self._started),
                bytes=int(payload.numel()),
                transfer_ms=1000 * elapsed,
                detail=(
                    f"state of step {best} from replica {m.members[source]}: "
                    f"{payload.numel() / 1e6:.2f} MB in {1000 * elapsed:.0f} ms "
                    f"({payload.numel() / 1e6 / max(elapsed, 1e-9):.1f} MB/s)"
                ),
            )

    def _exchange_steps(self, mine: int, gen: int, deadline: float) -> tuple[int, torch.Tensor]:
        """Every member's state step (-1: none) and the newest one."""
        m = self.membership
        steps = torch.zeros(m.size, dtype=torch.int64)  # summed: each member fills its own slot
        steps[m.position] = mine
        if m.size > 1 and not self.collectives.all_reduce(steps, m.group):
            raise _Superseded(self._wait_newer_generation(gen, deadline))
        return int(steps.max()), steps

    # ------------------------------------------------------------------ reporting
    def _log_tasks(self, engine, step: int, plan: RankStepPlan | None) -> None:
        if self._task_log is None:
            path = Path(self.cfg.run_dir) / "audit" / f"tasks_rank{self.rank}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._task_log = open(path, "a", buffering=1)
        plan = plan or engine.default_plan()
        # a slice adds its sample range: [replica, micro, degraded, start, stop]
        tasks = [
            [t.source_dp_rank, t.micro_index, int(t.degraded), *(t.samples or ())]
            for t in plan.tasks
        ]
        line = {"step": step, "replica": self.replica, "inc": self.incarnation, "tasks": tasks}
        line["micro_batch_size"] = self.cfg.training.micro_batch_size
        self._task_log.write(json.dumps(line) + "\n")

    def summary(self) -> dict[str, Any]:
        """This rank's failover counters plus the job's failures and latencies (from the store)."""
        events = posted_events(self.store)
        by_type: dict[str, list[dict]] = {}
        for ev in events:
            by_type.setdefault(ev["type"], []).append(ev)

        def latencies(kind: str) -> list[float]:
            return [round(e["latency_ms"], 1) for e in by_type.get(kind, []) if "latency_ms" in e]

        return {
            **self.stats,
            "steps_redone": keys.get_int(self.store, keys.STEPS_REDONE),  # job-wide
            "job_start_step": keys.get_int(self.store, keys.JOB_START_STEP),
            "failures": len(by_type.get("failure", [])),
            "rejoins": len(by_type.get("rejoin", [])),
            "detection_ms": latencies("detection"),
            "regroup_ms": [
                round(e["latency_ms"], 1) for e in by_type.get("regroup", []) if "latency_ms" in e
            ],
            "final_generation": self.membership.generation,
            "vote_ms_median": (
                round(1000 * statistics.median(self._vote_times), 3) if self._vote_times else None
            ),
        }

    def close(self) -> None:
        if self.hb is not None:
            self.hb.stop()
        if self._task_log is not None:
            self._task_log.close()


class _ThreadWork:
    """`is_completed`/`wait` over a helper thread that waits on real work."""

    def __init__(self, done: threading.Event, errors: list[BaseException]):
        self._done, self._errors = done, errors

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        if self._errors:
            raise self._errors[0]


def posted_events(store) -> list[dict]:
    """Every event posted to the store so far (what the coordinator writes to events.jsonl)."""
    last = keys.get_int(store, keys.EVENT_SEQ, 0)
    found = [keys.event(i) for i in range(1, last + 1)]
    found = [k for k in found if store.check([k])]
    return [json.loads(v) for v in store.multi_get(found)] if found else []


def _new_group(backend: str, store, rank: int, size: int, timeout: timedelta):
    """A process group built directly on `store` (no default group, no dead rank involved)."""
    if backend == "nccl":  # explicit watchdog policy, non-blocking communicators
        return groups.new_nccl_group(store, rank, size, timeout)
    return dist.ProcessGroupGloo(store, rank, size, timeout)
