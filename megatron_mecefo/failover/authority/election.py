"""Electing the coordinator on an etcd store: no node is special.

Every node agent of an `--store etcd` job keeps one candidate (`coordinator_cli --elect`). A
candidate campaigns by creating `keys.COORD_LEADER` on its own lease (a transaction that succeeds
only while the key is absent); the one that creates it is the coordinator while it keeps the lease
alive. A renewal thread renews it every TTL/8. When the leader's process or node dies, the lease
expires after the TTL, the key goes with it, and the next candidate to try takes over from the
state in etcd (`Coordinator.restore`). Training does not wait for it: trainers and agents talk to
etcd, not to the coordinator.

A stale leader (paused past its TTL, then resumed) stands down before its next tick: `expired()`
compares the time since its last renewal with the TTL on the monotonic clock, which a pause does
not stop. Should it still reach a write, `publish_generation` is a transaction on the epoch that
the new leader bumped, and is refused (`records.Fenced`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from megatron_mecefo.control import keys

DEFAULT_TTL_S = 5
"""Lease TTL of the coordinator and the election's bound on a takeover (plus one poll). It must
outlast an etcd leader change (about 1-2 s with `etcd_cluster.py`'s election timeout of 1 s) with
room for renewals, or a leader change in etcd would also change the coordinator."""
RENEWALS_PER_TTL = 8
"""Renewals per TTL, each bounded at one interval: several tries fit in an etcd leader change."""


class Leadership:
    """Held by the elected candidate while `expired()` is False."""

    def __init__(self, address: str, lease: int, ttl_s: int, log: Callable[[str], None]):
        self.address = address
        self.lease = lease
        self.ttl_s = ttl_s
        self.log = log
        self.renewed = time.monotonic()
        self.lost_reason: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="lease-renewal", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        interval = self.ttl_s / RENEWALS_PER_TTL
        store = keys.connect(self.address, interval)
        while not self._stop.wait(interval):
            started = time.monotonic()
            try:
                left = store.keepalive(self.lease)
            except Exception as exc:  # noqa: BLE001 - etcd unreachable: expired() decides
                if self.lost_reason is None and self.expired():
                    self.lost_reason = f"lease not renewed for {self.ttl_s} s ({exc})"
                continue
            if left <= 0:
                self.lost_reason = self.lost_reason or "lease expired"
                return
            if started - self.renewed <= self.ttl_s:  # granted while still ours
                self.renewed = started

    def expired(self) -> bool:
        """No renewal within the TTL (a pause counts), or etcd said the lease is gone."""
        return self.lost_reason is not None or time.monotonic() - self.renewed > self.ttl_s

    def resign(self, store) -> None:
        """Hand the leadership back at once (a clean exit), not after the TTL."""
        self._stop.set()
        try:
            store.revoke(self.lease)
        except Exception:  # noqa: BLE001 - it expires by itself
            pass


def campaign(
    store,
    address: str,
    candidate: str,
    *,
    ttl_s: int = DEFAULT_TTL_S,
    poll_s: float = 0.5,
    should_stop: Callable[[], bool],
    log: Callable[[str], None] = print,
) -> Leadership | None:
    """Campaign until elected (a `Leadership`) or `should_stop()` (None)."""
    lease = store.grant(ttl_s)
    granted = time.monotonic()
    logged = None
    while not should_stop():
        holder = store.create(keys.COORD_LEADER, candidate, lease=lease)
        if holder is None:
            leadership = Leadership(address, lease, ttl_s, log)
            leadership.renewed = granted
            return leadership
        if holder != logged:
            log(f"[coordinator] candidate {candidate}: {holder.decode()} leads; standing by")
            logged = holder
        time.sleep(poll_s)
        if store.keepalive(lease) <= 0:  # ours expired while we waited (a pause): a new one
            lease = store.grant(ttl_s)
        granted = time.monotonic()
    store.revoke(lease)
    return None
