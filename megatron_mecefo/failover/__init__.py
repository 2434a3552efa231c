"""Failover for real process deaths: coordinator, per-node agent, membership generations, commit
vote, takeover plans per step, rejoin from a live peer, failure injection.

Reading order: `keys` (the store schema), `coordinator` (the single membership authority),
`agent` (`mecefo-launch`), `membership` (what the engine reads), `manager` (the trainer side:
heartbeat, regroup, commit vote, state transfer), `inject` (real signals).
Importing this package imports nothing heavy; submodules import torch where they need it.
"""
