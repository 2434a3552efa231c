"""etcd store only: each node agent's lease, and the check that a job id names one launch.

An agent holds a lease (TTL `LEASE_TTL_S`) with the key `keys.agent_alive(agent id)` on it, and
renews it from its tick, rewriting the key's time stamp. A node that dies loses its key when the
lease expires, with no one writing anything: etcd itself keeps the count of live agents. At start,
an agent that finds the job's keys with a generation published but no agent alive is looking at an
earlier launch that stopped (quorum lost, the job killed): it refuses with one line rather than
join its state.
"""

from __future__ import annotations

import time

from megatron_mecefo.control import keys
from megatron_mecefo.errors import ConfigError

LEASE_TTL_S = 5
"""As the coordinator's agent timeout: a node is lost after this much silence either way."""


def uses_leases(store) -> bool:
    return keys.has_leases(store)


def check_fresh_launch(store, job: str) -> None:
    """Raise ConfigError when `job`'s keys hold a stopped launch (see the module docstring)."""
    if not uses_leases(store) or not store.check([keys.GEN]):
        return
    gen = keys.get_int(store, keys.GEN)
    if gen > 0 and live_agents(store) == 0:
        raise ConfigError(
            f"etcd already holds an earlier launch of job {job!r} that stopped (generation {gen}, "
            "no agent alive): a job id names one launch; pass a new --job-id (MECEFO_JOB_ID; "
            "under Slurm a requeue adds SLURM_RESTART_COUNT)"
        )


def live_agents(store, now: float | None = None) -> int:
    """Agents whose key exists and was rewritten within 2 TTLs: an etcd that regains its quorum
    gives every lease a new TTL, so a key alone can outlive its agent by one TTL."""
    now = time.time() if now is None else now
    stamps = store.values_with_prefix(keys.AGENT_ALIVE)
    return sum(1 for v in stamps if now - float(v or 0) < 2 * LEASE_TTL_S)


class NodeLease:
    """This agent's lease and key; `renew()` from every tick (it renews every TTL/3)."""

    def __init__(self, store, agent_id: int, ttl_s: int = LEASE_TTL_S):
        self.store, self.agent_id, self.ttl_s = store, agent_id, ttl_s
        self.lease = store.grant(ttl_s)
        store.put(keys.agent_alive(agent_id), str(time.time()), lease=self.lease)
        self.renewed = time.monotonic()

    def renew(self) -> None:
        if time.monotonic() - self.renewed < self.ttl_s / 3:
            return
        if self.store.keepalive(self.lease) <= 0:  # expired (this agent was paused): a new one
            self.lease = self.store.grant(self.ttl_s)
        self.store.put(keys.agent_alive(self.agent_id), str(time.time()), lease=self.lease)
        self.renewed = time.monotonic()

    def release(self) -> None:
        try:
            self.store.revoke(self.lease)
        except Exception:  # noqa: BLE001 - it expires by itself
            pass
