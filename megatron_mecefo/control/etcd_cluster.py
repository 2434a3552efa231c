"""A 3-member etcd cluster on this machine, for `mecefo-launch --store etcd` without
`MECEFO_ETCD_ENDPOINTS`, the tests and the benchmarks.

Members are Debian's `etcd` (package `etcd-server`; `scripts/install_etcd.sh`), on free loopback
ports, with their data under one folder. Each dies with the process that started it (PDEATHSIG),
so a killed launcher leaves no member behind. A production cluster is the site's own: pass its
endpoints instead (`launch/README.md`).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from megatron_mecefo.control import proc
from megatron_mecefo.errors import ConfigError

ETCD_BIN = "etcd"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_etcd() -> str:
    """The etcd server binary; a ConfigError that says how to install it when missing."""
    path = shutil.which(ETCD_BIN)
    if path is None:
        raise ConfigError(
            "--store etcd without MECEFO_ETCD_ENDPOINTS starts a local 3-member etcd cluster, but "
            "no `etcd` is on PATH: install it with `bash scripts/install_etcd.sh` (Debian's "
            "etcd-server), or give a cluster's endpoints in MECEFO_ETCD_ENDPOINTS"
        )
    return path


class LocalEtcd:
    """`members` etcd processes forming one cluster (see the module docstring)."""

    def __init__(self, data_dir: str | Path, members: int = 3, *, log=print):
        self.data_dir = Path(data_dir)
        self.log = log
        self.names = [f"m{i}" for i in range(members)]
        self.client_ports = [_free_port() for _ in self.names]
        self.peer_ports = [_free_port() for _ in self.names]
        self.procs: list[subprocess.Popen | None] = [None] * members
        self.token = f"mecefo-{time.time_ns()}"

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.client_ports]

    def _cmd(self, i: int) -> list[str]:
        cluster = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer_ports))
        client = f"http://127.0.0.1:{self.client_ports[i]}"
        peer = f"http://127.0.0.1:{self.peer_ports[i]}"
        return [
            find_etcd(),
            f"--name={self.names[i]}",
            f"--data-dir={self.data_dir / self.names[i]}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={cluster}",
            "--initial-cluster-state=new",
            f"--initial-cluster-token={self.token}",
            # a loopback cluster: elect within ~1 s of losing the leader
            "--heartbeat-interval=100",
            "--election-timeout=1000",
            "--logger=zap",
            "--log-level=error",
        ]

    def start_member(self, i: int) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.data_dir / f"{self.names[i]}.log", "ab")
        self.procs[i] = subprocess.Popen(
            self._cmd(i),
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=proc.die_with_parent,
        )
        log.close()

    def start(self, timeout_s: float = 30.0) -> list[str]:
        """Start every member and wait until the cluster has a leader; its endpoints."""
        for i in range(len(self.names)):
            self.start_member(i)
        self.wait_healthy(timeout_s)
        where = ",".join(self.endpoints)
        self.log(f"[etcd] {len(self.names)} members on {where} ({self.data_dir})")
        return self.endpoints

    def _status(self, i: int) -> dict | None:
        """Member `i`'s status, or None if it is down or does not answer within 1 s."""
        from megatron_mecefo.control.etcd_store import EtcdClient

        if self.procs[i] is None or self.procs[i].poll() is not None:
            return None
        client = EtcdClient([("127.0.0.1", self.client_ports[i])], 1.0)
        try:
            return client.status(timeout_s=1.0)
        except Exception:  # noqa: BLE001 - that member cannot say
            return None

    def leader(self, timeout_s: float = 10.0) -> int:
        """Index of the member that leads now."""
        deadline = time.monotonic() + timeout_s
        while True:
            for i in range(len(self.names)):
                status = self._status(i)
                if status and status.get("leader") == status["header"]["member_id"]:
                    return i
            if time.monotonic() > deadline:
                raise TimeoutError(f"no etcd leader within {timeout_s:.0f} s")
            time.sleep(0.1)

    def restart_member(self, i: int, timeout_s: float) -> None:
        """Start a stopped member again and wait until it answers; TimeoutError after
        `timeout_s`."""
        self.start_member(i)
        deadline = time.monotonic() + timeout_s
        while self._status(i) is None:
            if time.monotonic() > deadline:
                name = self.names[i]
                raise TimeoutError(f"etcd member {name} not serving after {timeout_s:.0f} s")
            time.sleep(0.1)

    def wait_healthy(self, timeout_s: float) -> None:
        """Until a member leads (a quorum is up); raises TimeoutError after `timeout_s`."""
        for i, p in enumerate(self.procs):
            if p is not None and p.poll() is not None:
                tail = (self.data_dir / f"{self.names[i]}.log").read_text(errors="replace")
                raise RuntimeError(f"etcd member {self.names[i]} exited: {tail[-800:]}")
        self.leader(timeout_s)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                p.wait(10)

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    """`python -m megatron_mecefo.control.etcd_cluster --data-dir D --endpoints-file F`: start 3
    members, write their endpoints (comma-separated) to F, and keep them until SIGTERM/SIGINT or
    the parent's death (`launch/local/run.sh` uses it for simulated nodes on `--store etcd`)."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m megatron_mecefo.control.etcd_cluster")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--endpoints-file", required=True)
    p.add_argument("--members", type=int, default=3)
    args = p.parse_args(argv)
    proc.die_with_parent(signal.SIGTERM)
    stop = {"now": False}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.update(now=True))
    cluster = LocalEtcd(args.data_dir, args.members, log=lambda m: print(m, flush=True))
    try:
        endpoints = cluster.start()
    except (ConfigError, RuntimeError, TimeoutError) as exc:
        cluster.stop()
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    Path(args.endpoints_file).write_text(",".join(endpoints))
    try:
        while not stop["now"]:
            time.sleep(0.2)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
