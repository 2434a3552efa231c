"""An agent's first contact with the job's store: wait for it quietly, for a bounded time.

Node 0 starts the tcp store (`mecefo-coordinator`) while the other nodes' agents start too, so an
agent may come up first: it waits with plain socket connects (no C++ client: torch's TCPStore
prints a warning with ~30 C++ frames for every timed-out attempt), says so in one line, and gives
up after `MECEFO_COORDINATOR_WAIT_S`. An etcd cluster is already running when a job starts: its
endpoints get a short probe, so a wrong address is one line within seconds. Either failure is a
`StoreUnreachableError` (exit 6, COORDINATOR_LOST). No torch import here.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

from megatron_mecefo.errors import ConfigError, ExitCode, MecefoError

WAIT_ENV = "MECEFO_COORDINATOR_WAIT_S"
"""Seconds an agent waits for the tcp store on node 0 to listen (as pretrain.sbatch does)."""
WAIT_DEFAULT_S = 120.0
QUIET_S = 2.0
"""A store that answers within this is waited for without a word (node 0 starting up)."""
ETCD_PROBE_S = 10.0
"""How long the etcd endpoints get to answer one request at start-up."""


class StoreUnreachableError(MecefoError):
    """The job's store did not answer at start-up."""

    exit_code = ExitCode.COORDINATOR_LOST


def wait_s(environ=os.environ) -> float:
    """`MECEFO_COORDINATOR_WAIT_S`, or the default (a value that is not > 0: `ConfigError`)."""
    raw = environ.get(WAIT_ENV) or str(WAIT_DEFAULT_S)
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ConfigError(f"{WAIT_ENV} must be a number of seconds > 0, got {raw!r}")
    return value


def wait_for_tcp_store(address: str, timeout_s: float, log: Callable[[str], None]) -> None:
    """Return once the tcp store at HOST:PORT accepts connections; one line if it is not up
    within `QUIET_S`; `StoreUnreachableError` after `timeout_s`."""
    from megatron_mecefo.control.keys import parse_address

    host, port = parse_address(address)
    start = time.monotonic()
    deadline = start + timeout_s
    said = False
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout_s)):
                return
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
        if time.monotonic() >= deadline:
            raise StoreUnreachableError(
                f"the job's store at {address} did not answer within {timeout_s:.0f} s ({why}): "
                f"is node 0's agent (mecefo-coordinator) running there? ({WAIT_ENV} sets the wait)"
            )
        if not said and time.monotonic() - start >= QUIET_S:
            log(f"waiting up to {timeout_s:.0f} s for the job's store at {address} (node 0)")
            said = True
        time.sleep(0.25)


def probe_etcd(endpoints: list[str], timeout_s: float = ETCD_PROBE_S) -> None:
    """One request to the etcd cluster at `endpoints` ("HOST:PORT"); `StoreUnreachableError`
    naming them if no member answers within `timeout_s`."""
    from megatron_mecefo.control import etcd_store

    hosts = ",".join(endpoints)
    pairs, _ = etcd_store.parse(etcd_store.address(endpoints, "probe"))
    client = etcd_store.EtcdClient(pairs, timeout_s)
    try:
        client.status(timeout_s)
    except etcd_store.EtcdUnavailable as exc:
        last = str(exc).rpartition("(last: ")[2].rstrip(")")
        raise StoreUnreachableError(
            f"etcd at {hosts} did not answer within {timeout_s:.0f} s (last: {last}): is it "
            "running there? (--etcd-endpoints, MECEFO_ETCD_ENDPOINTS)"
        ) from None
