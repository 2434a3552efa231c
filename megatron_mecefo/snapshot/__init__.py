"""In-memory snapshots (REFT-style): per-node snapshot process, shared-memory slots, and erasure
coding of each node's snapshot across a parity group of nodes (`codec`, `parity`).
"""
