"""The errors of the store clients that do not come from torch (`tcp_client.py`,
`etcd_store.py`): `RuntimeError`s, as torch's `DistStoreError` is, so a caller catches both alike
(`keys.is_store_error` tells either from other errors without importing torch)."""

from __future__ import annotations


class StoreError(RuntimeError):
    """A store call that failed: the server gone, a reply that breaks the protocol, no endpoint
    that answers."""


class StoreTimeout(StoreError):
    """A wait (or a get of a key never set) that outlasted its timeout."""
