"""One chaos schedule's job: its `mecefo-launch` agents (tcp: node 0 starts the coordinator;
etcd: a 3-member etcd cluster the tool starts, and the agents elect a coordinator), the probe
that reads its progress, and the process helpers `run.py` fires faults with.

Every job process carries the job's tag in its environment (`checks.TAG_ENV`); the etcd members
do not (they belong to the tool, which stops them after the checks).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JOB_ENV = dict(os.environ)
"""The environment jobs start with: the tool quiets torch's C++ warnings (its store client
logs a stack trace whenever the coordinator goes away), the jobs keep theirs."""
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatron_mecefo.control import keys  # noqa: E402
from megatron_mecefo.failover.node.agent_cli import AGENT_MODULE, launch_command  # noqa: E402
from megatron_mecefo.failover.node.candidate import CandidateId  # noqa: E402
from tools.chaos import checks  # noqa: E402
from tools.chaos.schedule import Schedule  # noqa: E402

CONFIG = ROOT / "configs" / "run" / "demo_cpu.yaml"
ROLE = {
    "agent": AGENT_MODULE,
    "coordinator": "megatron_mecefo.failover.authority.coordinator_cli",
    "store": "megatron_mecefo.failover.authority.store_host",
    "smp": "megatron_mecefo.snapshot.smp",
    "trainer": "megatron_mecefo.train",
    "spare": "megatron_mecefo.warm_spare",
}


def layout_overrides(s: Schedule) -> list[str]:
    """The trainer's config overrides of the schedule's layout (none for TP 1, PP 1)."""
    out = []
    if s.tp > 1:
        out.append(f"parallel.tensor_model_parallel_size={s.tp}")
    if s.pp > 1:
        out.append(f"parallel.pipeline_model_parallel_size={s.pp}")
    if s.dist_opt:
        out.append("training.use_distributed_optimizer=true")
    return out


class Job:
    """One schedule's `mecefo-launch` agents, tagged, with its run dir and logs under `folder`."""

    def __init__(self, schedule: Schedule, folder: Path, args: argparse.Namespace):
        self.s = schedule
        self.tag = f"chaos-{schedule.seed}-{schedule.index}-{uuid.uuid4().hex[:8]}"
        self.folder = folder / self.tag
        self.run_dir = self.folder / "run"
        self.args = args
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.agents: dict[int, subprocess.Popen] = {}
        self.killed_agents: set[int] = set()
        self.etcd = None
        """`control.etcd_cluster.LocalEtcd` of a job on the etcd store (started by `start`)."""
        self.env = {
            **JOB_ENV,
            checks.TAG_ENV: self.tag,
            "PYTHONWARNINGS": "ignore",
            "OMP_NUM_THREADS": "1",
        }

    def trainer_args(self) -> list[str]:
        s = self.s
        return [
            "--config", str(CONFIG),
            "--max-steps", str(s.max_steps),
            "--run-dir", str(self.run_dir),
            f"data.demo_dir={self.args.demo_dir}",
            "failover.audit=true",
            "logging.print_interval=5",
            "training.eval_interval=0",
            "training.micro_batch_size=4",
            f"snapshot.interval={s.snapshot_interval}",
            "recovery.wait_all_s=20",
            *layout_overrides(s),
            *s.inject_args(),
        ]  # fmt: skip

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.s.store == "etcd":
            from megatron_mecefo.control import etcd_store
            from megatron_mecefo.control.etcd_cluster import LocalEtcd

            self.etcd = LocalEtcd(self.folder / "etcd", log=lambda _m: None)
            endpoints = ",".join(self.etcd.start())
            self.address = etcd_store.address(self.etcd.endpoints, self.tag)
            store = ["--store", "etcd", "--etcd-endpoints", endpoints, "--job-id", self.tag]
        spares = []  # default: the launcher's (a replica's ranks on the node restart warm)
        if self.args.warm_spares is not None:
            spares = ["--warm-spares", str(self.args.warm_spares)]
        for node in range(self.s.nodes):
            if self.etcd is not None:
                where = store
            elif node == 0:
                where = ["--coordinator-port", str(self.port)]
            else:
                where = ["--coordinator", self.address]
            cmd = launch_command(
                self.trainer_args(), nproc_per_node=self.s.nproc, nnodes=self.s.nodes,
                node_rank=node, flags=["--restart-delay-s", "0.5", *spares, *where],
            )  # fmt: skip
            with open(self.folder / f"node{node}.log", "w") as log:
                self.agents[node] = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
                    start_new_session=True,
                )  # fmt: skip
            if node == 0 and self.s.nodes > 1 and self.etcd is None:
                self._wait_listening(self.agents[0], 120.0)

    def _wait_listening(self, agent: subprocess.Popen, bound_s: float) -> None:
        """Start the other nodes once the coordinator store listens (bounded)."""
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline and agent.poll() is None:
            with socket.socket() as sock:
                sock.settimeout(0.5)
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.2)

    def processes(self, role: str | None = None) -> list[checks.Proc]:
        procs = checks.tagged_processes(self.tag)
        if role is None:
            return procs
        return [p for p in procs if f"-m {ROLE[role]} " in p.cmdline + " "]

    def live_agents(self) -> list[int]:
        return [
            n for n, p in self.agents.items() if n not in self.killed_agents and p.poll() is None
        ]

    def ended(self) -> bool:
        """Every agent the schedule did not kill exited; if some were killed, their orphaned
        trainers are gone too (else the run ends when the remaining agents do)."""
        if self.live_agents():
            return False
        if not self.killed_agents:
            return True
        return not (self.processes("trainer") or self.processes("spare"))

    def exit_codes(self) -> dict[int, int | None]:
        return {n: p.poll() for n, p in self.agents.items() if n not in self.killed_agents}

    def stop_etcd(self) -> None:
        """Stop the job's etcd members (after the checks: they hold its keys)."""
        if self.etcd is not None:
            self.etcd.stop()

    def kill_all(self) -> None:
        """SIGKILL every process of the job (agents' sessions, then anything tagged), bounded."""
        for proc in self.agents.values():
            _killpg(proc.pid)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            left = self.processes()
            if not left:
                break
            checks.kill_processes(left)
            time.sleep(0.2)
        for proc in self.agents.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


class Probe:
    """Reads the job's progress: the coordinator store (job step, generation, ranks' pids) and
    metrics.jsonl. The store may be gone (coordinator killed): every read is bounded, and a
    failed connection is retried at most once a second."""

    def __init__(self, job: Job):
        self.job = job
        self.store = None
        self._retry_at = 0.0
        self.metrics_step = -1
        self._offset = 0
        self.step_seen = -1
        self.step_changed = time.monotonic()

    def _get(self, key: str) -> bytes | None:
        now = time.monotonic()
        if self.store is None and now >= self._retry_at:
            try:
                self.store = keys.connect(self.job.address, 2.0)
            except Exception:  # noqa: BLE001 - not up yet, or gone
                self._retry_at = now + 1.0
                return None
        if self.store is None:
            return None
        try:
            return self.store.get(key) if self.store.check([key]) else None
        except Exception:  # noqa: BLE001 - the store went away
            self.store, self._retry_at = None, now + 1.0
            return None

    def step(self) -> int:
        """The step the job is in: the store's job/step, or one past metrics' last step."""
        path = self.job.run_dir / "metrics.jsonl"
        if path.exists():
            with open(path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self._offset += len(complete)
            for line in complete.splitlines():
                try:
                    self.metrics_step = max(self.metrics_step, json.loads(line)["step"])
                except (ValueError, KeyError):
                    pass
        raw = self._get(keys.JOB_STEP)
        step = max(self.metrics_step + 1, int(raw) if raw else -1)
        if step > self.step_seen:
            self.step_seen, self.step_changed = step, time.monotonic()
        return step

    def generation(self) -> int:
        raw = self._get(keys.GEN)
        return int(raw) if raw else 0

    def coordinator(self) -> tuple[int, checks.Proc] | None:
        """etcd store: the elected coordinator candidate's node and process, if it runs."""
        raw = self._get(keys.COORD_LEADER)
        if raw is None:
            return None
        holder = CandidateId.parse(raw.decode())
        for p in self.job.processes("coordinator"):
            if f" --elect {holder} " in p.cmdline + " ":
                return holder.node, p
        return None

    def rank_pid(self, rank: int) -> int | None:
        """The pid of `rank`'s current process, if it is alive and belongs to the job."""
        raw = self._get(keys.registration(rank))
        if raw is None:
            return None
        pid = int(json.loads(raw)["pid"])
        return pid if pid in {p.pid for p in self.job.processes()} else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kill(pid: int, sig: signal.Signals) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
