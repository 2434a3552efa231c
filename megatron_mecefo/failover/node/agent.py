"""The per-node agent of `mecefo-launch`: starts this node's ranks, watches them, restarts them.

It never kills a survivor. A rank that dies is reported to the coordinator at once (fast
detection) and restarted with the same rank id, per `restart_policy.py`, so it can rejoin; a rank
the coordinator evicts (hung, or fenced) is SIGKILLed first; a rank exiting with a fatal code stops
the node with that code. Every tick (0.1 s) it publishes one node report (`records.NodeReport`:
what the kernel says of its ranks, with their beats when aggregated) and hands the job's state to
its trainers through the node-local channel (`control/local_beat.py`). A standby agent runs no
rank until the coordinator gives it a lost node. The command line and the process start-up are
`agent_cli.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_mecefo.control import keys, local_beat
from megatron_mecefo.control.proc import ignore_stop_signal, signal_group
from megatron_mecefo.control.records import node_report, read_registration
from megatron_mecefo.errors import ExitCode
from megatron_mecefo.failover.liveness import gpu_health
from megatron_mecefo.failover.node import restart_policy
from megatron_mecefo.failover.node.fork_server import ForkServer
from megatron_mecefo.failover.node.node_lease import NodeLease, check_fresh_launch, uses_leases
from megatron_mecefo.failover.node.snapshot_process import (
    snapshot_process_command,
    start_snapshot_process,
)
from megatron_mecefo.metrics import rank_log
from megatron_mecefo.snapshot.paths import NODE_DIR_ENV, SMP_ENV

FORK_SERVER_READY_S = 180.0
"""How long a node's first start waits for its fork server to import (a rank started as a new
process instead would import just as long, beside the others)."""


class Agent:
    """Starts, watches and restarts this node's ranks."""

    def __init__(self, args: argparse.Namespace, address: str):
        self.args = args
        self.address = address
        self.world = args.nnodes * args.nproc_per_node
        self.node: int | None = None  # the node whose ranks this agent runs (None: a standby)
        self.ranks: list[int] = []
        self.incarnation: dict[int, int] = {}
        self.snapshot_dir: Path | None = None
        self.smp_cmd: list[str] | None = None
        self.procs: dict[int, subprocess.Popen] = {}
        self.restart_at: dict[int, tuple[float, int]] = {}  # rank -> (not before, job step)
        self.finished: set[int] = set()
        self.store = keys.connect(address, 10.0)
        self.spares: list[subprocess.Popen] = []
        self.fork_server: ForkServer | None = None  # --start-method fork
        self.evicted: set[int] = set()  # ranks whose current incarnation was evicted
        self.stop_reason: str | None = None  # set by SIGUSR1; posted to the store once
        self.smp: subprocess.Popen | None = None
        self.preempted = False  # a rank exited PREEMPTED (stopped on request after a checkpoint)
        self.saw_done = False
        """The job's DONE flag was read: it trained to its last step, so a store that goes away
        now (the coordinator stops) ends this node well, not with COORDINATOR_LOST."""
        self.started_at: dict[int, float] = {}  # rank -> when its current incarnation started
        self.quick_deaths: dict[int, int] = {}  # rank -> deaths in a row soon after a start
        self.term_deadline: float | None = None  # SIGTERM with a grace time: hard stop after
        self.report_seq = 0
        self.beat_dir: Path | None = None  # the node-local heartbeat channel (aggregated beats)
        self.beat_channel: local_beat.ChannelFolder | None = None
        self.channel_error: str | None = None  # why the channel folder is unusable, once logged
        if os.environ.get(local_beat.AGGREGATE_ENV, "1") != "0":
            self.beat_channel = local_beat.make_folder()
            self.beat_dir = self.beat_channel.path
            local_beat.start_janitor(self.beat_dir)
        self.evict_seq_seen = b""  # keys.EVICT_SEQ at the last eviction check
        self.record_gen = 0  # the newest generation record written to the beat folder
        self.flag_values: dict[str, str] = {}  # ABORT / STOP reasons once read
        self.standby_logged = False
        self.gave_up: dict[int, int] = {}  # rank -> its last exit code, when no longer restarted
        self.replica_size: int | None = None  # TP x PP: for the default warm spares
        if args.warm_spares is None:
            self.replica_size = replica_size_of(args.trainer_args)
        check_fresh_launch(self.store, getattr(args, "job_id", ""))
        keys.control_keys(self.store)
        self.agent_id = self.store.add(keys.AGENT_IDS, 1)
        self.lease = NodeLease(self.store, self.agent_id) if uses_leases(self.store) else None
        if not args.standby:
            node = args.node_rank
            owner = self.store.compare_set(keys.node_owner(node), "", str(self.agent_id))
            if owner.decode() == str(self.agent_id):
                self._take_node(node, adopted=False)
            else:  # a lost node that came back: a standby took its ranks
                self.log(f"node {node} is run by agent {owner.decode()} now; standing by")

    def log(self, msg: str) -> None:
        who = f"{self.node}" if self.node is not None else f"standby {self.args.node_rank}"
        print(f"[agent {who}] {msg}", flush=True)

    def _take_node(self, node: int, *, adopted: bool) -> None:
        """Run `node`'s ranks from now on. An adopted node's ranks start with incarnations newer
        than any the store has seen for them, so they rejoin like restarted ranks."""
        self.node = node
        n = self.args.nproc_per_node
        self.ranks = [node * n + i for i in range(n)]
        self.incarnation = {r: self._next_incarnation(r) if adopted else 0 for r in self.ranks}
        self.snapshot_dir, self.smp_cmd = snapshot_process_command(
            self.args.trainer_args, self.args.nnodes, self.address, self.ranks, node
        )

    def _next_incarnation(self, rank: int) -> int:
        seen = [keys.get_int(self.store, keys.evict(rank), -1)]
        reg = read_registration(self.store, rank)
        if reg is not None:
            seen.append(reg.incarnation)
        return max(seen) + 1

    def _start_node(self, *, wait_s: float = 0.0) -> None:
        self._start_smp()
        for rank in self.ranks:
            self.spawn(rank, wait_s=wait_s)
        self._top_up_spares()

    def _rank_env(self, rank: int) -> dict[str, str]:
        return {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank - self.ranks[0]),
            "WORLD_SIZE": str(self.world),
            "LOCAL_WORLD_SIZE": str(self.args.nproc_per_node),
            keys.COORDINATOR_ENV: self.address,
            keys.INCARNATION_ENV: str(self.incarnation[rank]),
            keys.NODE_RANK_ENV: str(self.node),
            **({local_beat.BEAT_DIR_ENV: str(self.beat_dir)} if self.beat_dir else {}),
            **(
                {NODE_DIR_ENV: str(self.snapshot_dir), SMP_ENV: "1"}
                if self.smp_cmd is not None
                else {}
            ),
        }

    @staticmethod
    def _process_env() -> dict[str, str]:
        """The agent's environment for a process it starts: one OpenMP thread unless set (a
        rank per core; torch's default, a thread per core in every rank, oversubscribes)."""
        return {"OMP_NUM_THREADS": "1", **os.environ}

    def _trainer_env(self) -> dict[str, str]:
        """The fork server's environment: the node-wide part of a rank's (`_rank_env`)."""
        env = {**self._process_env(), keys.COORDINATOR_ENV: self.address}
        if self.beat_dir is not None:
            env[local_beat.BEAT_DIR_ENV] = str(self.beat_dir)
        return env

    def _renew_lease(self) -> None:
        if self.lease is not None:
            self.lease.renew()

    def _start_fork_server(self) -> None:
        if getattr(self.args, "start_method", "exec") == "fork":
            self.fork_server = ForkServer(self._trainer_env(), self.log)

    def _fork(self, rank: int, wait_s: float) -> bool:
        """Start `rank` from the fork server (waiting up to `wait_s` for it to be ready)."""
        server = self.fork_server
        if server is None or not server.wait_ready(wait_s, self._renew_lease):
            return False
        proc = server.start(self._rank_env(rank), self.args.trainer_args)
        if proc is None:
            return False
        self.procs[rank] = proc
        return True

    def spawn(self, rank: int, *, wait_s: float = 0.0) -> None:
        """Start `rank`: fork it from the fork server if it is ready (within `wait_s`), else hand
        it to a warm spare if one is alive, else start a fresh process."""
        self.started_at[rank] = time.monotonic()
        if self._fork(rank, wait_s):
            return
        self.spares = [p for p in self.spares if p.poll() is None]
        spare = self.spares.pop(0) if self.spares else None
        if spare is not None:
            order = {"env": self._rank_env(rank), "args": list(self.args.trainer_args)}
            spare.stdin.write(json.dumps(order) + "\n")
            spare.stdin.close()
            self.procs[rank] = spare
        else:
            env = {**self._process_env(), **self._rank_env(rank)}
            cmd = [sys.executable, "-m", "megatron_mecefo.train", *self.args.trainer_args]
            self.procs[rank] = subprocess.Popen(
                cmd, env=env, start_new_session=True, preexec_fn=ignore_stop_signal
            )

    def _warm_spares_wanted(self) -> int:
        """`--warm-spares`, or by default (auto) as many as one replica has ranks on this node:
        a replica (TP x PP ranks) leaves and comes back whole, so all its ranks here restart
        together, and each one started cold would hold the whole replica back. Until this node's
        ranks register (that tells TP x PP) the default is 1 if the command line could not say."""
        if self.args.warm_spares is not None:
            return self.args.warm_spares
        if self.replica_size is None and self.ranks:
            reg = read_registration(self.store, self.ranks[0])
            self.replica_size = reg.replica_size if reg is not None else None
        if self.replica_size is None:
            return 1
        return spares_for_replicas(self.ranks, self.replica_size)

    def _top_up_spares(self) -> None:
        self.spares = [p for p in self.spares if p.poll() is None]
        if self.fork_server is not None and self.fork_server.ready is not False:
            return  # the fork server starts any rank warm (None: it is still importing)
        env = self._process_env()
        want = self._warm_spares_wanted()
        if self.node is None:  # a standby starts a whole node at once
            want = max(want, self.args.nproc_per_node)
        while len(self.spares) < want:
            self.spares.append(
                subprocess.Popen(
                    [sys.executable, "-m", "megatron_mecefo.warm_spare"],
                    env=env,
                    stdin=subprocess.PIPE,
                    text=True,
                    start_new_session=True,  # its own group: killed with what it forks
                    preexec_fn=ignore_stop_signal,
                )
            )

    def run(self) -> int:
        self.store.add(keys.AGENTS_ACTIVE, 1)
        code = None
        try:
            self._start_fork_server()
            if self.node is not None:
                self._start_node(wait_s=FORK_SERVER_READY_S)
            else:
                self._top_up_spares()
            code = self._watch()
            return code
        finally:
            self._stop_children()
            if self.beat_channel is not None:
                self.beat_channel.remove()
            # a store that did not answer for 10 s would hold each goodbye for its full timeout
            # (measured: 20 s more to stop after an etcd quorum loss); the lease expires anyway
            if code != ExitCode.COORDINATOR_LOST:
                try:
                    self.store.add(keys.AGENTS_ACTIVE, -1)
                except Exception:  # noqa: BLE001 - the coordinator may be gone already
                    pass
                if self.lease is not None:
                    self.lease.release()

    def _watch(self) -> int:
        last_ok = time.monotonic()
        while self.node is None or len(self.finished) < len(self.ranks):
            if self.term_deadline is not None and time.monotonic() > self.term_deadline:
                self.log("SIGTERM grace time over: stopping this node's ranks now")
                return 128 + signal.SIGTERM
            try:
                if self.lease is not None:
                    self.lease.renew()
                code = self._tick() if self.node is not None else self._standby_tick()
                last_ok = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - store unreachable, or a local file error
                if self.saw_done and keys.is_store_error(exc):
                    self.log("the job finished and its store is gone; stopping this node")
                    return int(ExitCode.PREEMPTED if self.preempted else ExitCode.OK)
                if time.monotonic() - last_ok > 10.0:
                    if isinstance(exc, OSError) and exc.filename is not None:  # not the store
                        self.log(f"cannot use {exc.filename} ({exc.strerror}); stopping this node")
                        return int(ExitCode.FAILURE)
                    self.log(f"coordinator unreachable ({exc}); stopping this node")
                    return int(ExitCode.COORDINATOR_LOST)
                code = None
            if code is not None:
                return code
            time.sleep(0.1)
        if self.gave_up and not self._job_done():
            rank, rc = next(iter(self.gave_up.items()))
            code = rc if rc > 0 else int(ExitCode.FAILURE)
            self.log(f"rank {rank} was given up and the job did not finish; exit {code}")
            return code
        return int(ExitCode.PREEMPTED if self.preempted else ExitCode.OK)

    def _job_done(self) -> bool:
        """The leader raised DONE: the job trained to its last step (False if unreachable)."""
        try:
            return keys.flag_raised(self.store.get(keys.FLAGS), keys.DONE)
        except Exception:  # noqa: BLE001 - the store is gone: nothing says the job finished
            return False

    def request_stop(self, reason: str) -> None:
        """Called from the signal handler: only records it (the store is used in `_tick`)."""
        self.stop_reason = self.stop_reason or reason

    def _tick(self) -> int | None:
        # GEN, the job's flags, the eviction counter and this node's owner in one request
        gen_raw, flags, evict_seq, owner = self.store.multi_get(
            [keys.GEN, keys.FLAGS, keys.EVICT_SEQ, keys.node_owner(self.node)]
        )
        stop_set = keys.flag_raised(flags, keys.STOP)
        if self.stop_reason is not None and not stop_set:
            self.log(f"stop requested ({self.stop_reason}): ranks checkpoint and stop")
            keys.raise_flag(self.store, keys.STOP, f"node {self.node}: {self.stop_reason}")
            stop_set = True
        self.saw_done = self.saw_done or keys.flag_raised(flags, keys.DONE)
        done = self.saw_done or stop_set
        if owner.decode() != str(self.agent_id):
            self._hand_over()
            return None
        gen = int(gen_raw)
        self._report_liveness(gen, flags, stop_set)
        if self.replica_size is None and self.args.warm_spares is None and not done:
            self._top_up_spares()  # more spares once TP x PP is known (`_warm_spares_wanted`)
        check_evictions = evict_seq != self.evict_seq_seen  # only when one was set since
        self.evict_seq_seen = evict_seq
        if self.fork_server is not None and self.fork_server.died() and not done:
            self.log(f"the fork server exited ({self.fork_server.proc.returncode}); restarting it")
            self.fork_server.stop()
            self._start_fork_server()
        if self.smp is not None and self.smp.poll() is not None and not done:
            self.log(f"the snapshot process exited ({self.smp.returncode}); restarting it")
            self._start_smp()
        for rank, proc in list(self.procs.items()):
            rc = proc.poll()
            if rc is None:
                if check_evictions:
                    self._maybe_evict(rank, proc)
                continue
            del self.procs[rank]
            signal_group(proc, signal.SIGKILL)  # leftovers it forked (checkpoint writers)
            self.evicted.discard(rank)
            if rc in restart_policy.FINISHED:
                self.finished.add(rank)
                self.preempted = self.preempted or rc == ExitCode.PREEMPTED
                continue
            if rc == ExitCode.COORDINATOR_LOST and self.saw_done:  # it started as the job ended
                self.log(f"rank {rank} found no store: the job had finished")
                self.finished.add(rank)
                continue
            if rc in restart_policy.FATAL:
                self.log(f"rank {rank} exited with {ExitCode(rc).name}; stopping this node")
                if rc in restart_policy.DETERMINISTIC:  # a restart would repeat it: end the job
                    reason = f"rank {rank} exited {ExitCode(rc).name} (its error line says why)"
                    with contextlib.suppress(Exception):
                        keys.raise_flag(self.store, keys.ABORT, reason)
                return rc
            self._on_death(rank, rc, done)
        for rank, (not_before, step) in list(self.restart_at.items()):
            if done:
                del self.restart_at[rank]
                self.finished.add(rank)
            elif time.monotonic() >= not_before and self._restart_due(rank, step):
                del self.restart_at[rank]
                bad = gpu_health.check_gpu(gpu_health.device_id(rank - self.ranks[0]))
                if bad is not None:
                    self.log(f"not restarting rank {rank}: its GPU is unhealthy ({bad})")
                    self.finished.add(rank)
                    self.gave_up[rank] = int(ExitCode.FAILURE)
                    continue
                self.incarnation[rank] += 1
                self.log(f"restarting rank {rank} (incarnation {self.incarnation[rank]})")
                self.spawn(rank)
                self._top_up_spares()
        return None

    def _restart_due(self, rank: int, step: int) -> bool:
        """A rank held back until job step `step` (an injected downtime) restarts once the job
        gets there, or at once while the job recovers from losing every replica: the job cannot
        advance then, and the recovery needs the rank's saved state."""
        if keys.get_int(self.store, keys.JOB_STEP) >= step:
            return True
        if keys.get_int(self.store, keys.RECOVERING) != 1:
            return False
        self.log(
            f"the job recovers from the loss of every replica: rank {rank} restarts now, "
            f"not at job step {step}"
        )
        return True

    def _report_liveness(self, gen: int, flags: bytes, stop_set: bool) -> None:
        """One key per node: what the kernel says of each rank (see `liveness.py`), with each
        rank's beat when they beat through this agent; then the trainers' control file."""
        self.report_seq += 1
        procs = {r: (self.incarnation[r], p.pid) for r, p in self.procs.items()}
        beats = None
        channel = self._channel_ready()
        if channel:
            beats = local_beat.read_beats(self.beat_dir, {r: self.incarnation[r] for r in procs})
            asked = [(r, b["stop"]) for r, b in sorted(beats.items()) if b.get("stop")]
            if asked and not stop_set:  # a rank got SIGUSR1: every member must stop with it
                keys.raise_flag(self.store, keys.STOP, f"rank {asked[0][0]}: {asked[0][1]}")
                flags, stop_set = flags + f"{keys.STOP};".encode(), True
        seq = f"{self.agent_id}:{self.report_seq}"
        self.store.set(keys.node_key(self.node), node_report(seq, procs, beats))
        if channel:
            record = self.store.get(keys.gen_record(gen)) if gen > self.record_gen else None
            control = local_beat.Control(seq=self.report_seq, gen=gen)
            if keys.flag_raised(flags, keys.ABORT):
                control.abort = self._flag_value(keys.ABORT)
            if stop_set:
                control.stop = self._flag_value(keys.STOP)
            control.done = keys.flag_raised(flags, keys.DONE)
            try:  # the record before the control file that announces it
                if record is not None:
                    local_beat.write_record(self.beat_dir, gen, record)
                    self.record_gen = gen
                local_beat.write_control(self.beat_dir, control)
            except OSError as exc:  # removed meanwhile: recreated at the next tick
                self._channel_unusable(exc)

    def _channel_ready(self) -> bool:
        """The channel folder is there, recreated (with the current record) if something outside
        removed it. False while it cannot be: the ranks then beat to the store themselves, and
        only this node's beats take that path (one line says what is missing)."""
        if self.beat_channel is None:
            return False
        try:
            recreated = self.beat_channel.ensure()
        except OSError as exc:
            self._channel_unusable(exc)
            return False
        if recreated:
            self.log(f"the node-local folder {self.beat_dir} was removed; recreated it")
            self.record_gen = 0  # rewrite the current generation's record
        self.channel_error = None
        return True

    def _channel_unusable(self, exc: OSError) -> None:
        why = f"{exc.filename or self.beat_dir}: {exc.strerror or exc}"
        if why != self.channel_error:
            self.log(
                f"the node-local folder {self.beat_dir} cannot be used ({why}); this node's "
                "ranks beat to the store until it can"
            )
            self.channel_error = why

    def _flag_value(self, key: str) -> str:
        """A raised flag's reason, read from the store once: the flag stays raised, and a second
        raiser would only change the reason's text."""
        if key not in self.flag_values:
            self.flag_values[key] = self.store.get(key).decode()
        return self.flag_values[key]

    def _standby_tick(self) -> int | None:
        """A standby: beat, and take over the node the coordinator assigns (if any)."""
        flags = self.store.get(keys.FLAGS)
        if keys.flag_raised(flags, keys.ABORT):
            return int(ExitCode.JOB_ABORTED)
        if keys.flag_raised(flags, keys.DONE):
            return int(ExitCode.OK)
        if keys.flag_raised(flags, keys.STOP):
            return int(ExitCode.PREEMPTED)
        self.report_seq += 1
        self.store.set(keys.standby(self.agent_id), json.dumps({"seq": self.report_seq}))
        if not self.standby_logged:  # the coordinator reads standbys from this log only
            self.store.append(keys.STANDBY_LOG, f"{self.agent_id},")
            self.standby_logged = True
        self._top_up_spares()
        if self.store.check([keys.assign(self.agent_id)]):
            given = self.store.get(keys.assign(self.agent_id)).decode()
            if given == keys.RETIRED:  # this machine computed too slowly: it takes no node
                return None
            node = int(given)
            self._take_node(node, adopted=True)
            self.log(f"taking over node {node}: ranks {self.ranks}")
            self._start_node()
        return None

    def _hand_over(self) -> None:
        """The coordinator gave this node to a standby (this agent was silent too long, or its
        ranks computed too slowly): stop this node's ranks and become a standby, so they never
        run twice."""
        owner = self.store.get(keys.node_owner(self.node)).decode()
        mine = keys.assign(self.agent_id)  # set before the owner changed (`SparePool._give`)
        retired = self.store.check([mine]) and self.store.get(mine).decode() == keys.RETIRED
        why = " (its ranks computed too slowly: retired)" if retired else ""
        self.log(
            f"node {self.node} was given to agent {owner}{why}; stopping its ranks, standing by"
        )
        for proc in list(self.procs.values()):
            signal_group(proc, signal.SIGKILL)
        if self.smp is not None:
            signal_group(self.smp, signal.SIGKILL)
            self.smp = None
        self.node, self.ranks, self.procs = None, [], {}
        self.restart_at.clear()
        self.finished.clear()
        self.evicted.clear()
        self.gave_up.clear()

    def _maybe_evict(self, rank: int, proc: subprocess.Popen) -> None:
        key = keys.evict(rank)
        if self.store.check([key]) and int(self.store.get(key)) == self.incarnation[rank]:
            if rank not in self.evicted:
                self.log(f"rank {rank} was evicted by the coordinator; killing it")
                self.evicted.add(rank)
            signal_group(proc, signal.SIGKILL)

    def _on_death(self, rank: int, rc: int, done: bool) -> None:
        inc = self.incarnation[rank]
        how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        keys.report_dead(self.store, rank, inc)
        if done:
            self.finished.add(rank)
            return
        if rc == ExitCode.EVICTED:  # a persistent numerical fault: a restart would repeat it
            self.log(f"rank {rank} was evicted for a persistent NaN/Inf; not restarting it")
            self.finished.add(rank)
            self.gave_up[rank] = rc
            return
        if inc >= self.args.max_restarts:
            self.log(f"rank {rank} died ({how}) after {inc} restarts; not restarting it")
            self.finished.add(rank)
            self.gave_up[rank] = rc
            return
        down_key = keys.downtime(rank, inc)
        step = keys.get_int(self.store, down_key, -1)
        lived_s = time.monotonic() - self.started_at.get(rank, time.monotonic())
        quick = restart_policy.is_quick_death(lived_s)
        streak = self.quick_deaths.get(rank, -1) + 1 if quick else 0
        self.quick_deaths[rank] = streak
        delay_s = restart_policy.restart_delay_s(self.args.restart_delay_s, streak)  # backoff
        self.restart_at[rank] = (time.monotonic() + delay_s, step)
        when = f"at job step {step}" if step >= 0 else f"in {delay_s:.1f} s"
        self.log(f"rank {rank} (incarnation {inc}) died ({how}); restarting it {when}")
        rank_log.echo_tail(self.log, rank)

    def _start_smp(self) -> None:
        if self.smp_cmd is not None:
            self.smp = start_snapshot_process(self.smp_cmd)

    def _stop_children(self) -> None:
        if self.fork_server is not None:
            self.fork_server.stop()
        if self.smp is not None and self.smp.poll() is None:
            self.procs[-100] = self.smp  # stopped with the others (SIGTERM; its folder stays)
        for i, spare in enumerate(self.spares):
            if spare.poll() is None:
                spare.stdin.close()  # EOF: the spare exits
                self.procs[-1 - i] = spare
        for proc in self.procs.values():
            if proc.poll() is None:
                signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(proc, signal.SIGKILL)
                proc.wait()
            signal_group(proc, signal.SIGKILL)


def spares_for_replicas(ranks: list[int], replica_size: int) -> int:
    """The most ranks one replica (`replica_size` consecutive global ranks) has among `ranks`."""
    per_replica: dict[int, int] = {}
    for rank in ranks:
        per_replica[rank // replica_size] = per_replica.get(rank // replica_size, 0) + 1
    return max(per_replica.values(), default=1)


def replica_size_of(trainer_args: list[str]) -> int | None:
    """TP x PP of the trainers' command line, read as the trainers will read it (without torch:
    the config packages import it lazily), or None when it cannot be read (the trainers say
    why)."""
    from megatron_mecefo.config.cli import load_run_config, parse_args

    try:
        par = load_run_config(parse_args(list(trainer_args))).parallel
    except (Exception, SystemExit):  # noqa: BLE001 - not the agent's error to report
        return None
    return par.tensor_model_parallel_size * par.pipeline_model_parallel_size
