"""Which live replicas hold each optimizer shard (pure functions; no torch).

Shard s belongs to logical replica s. With `copies` = R, the first R live replicas of its
preference order hold it, each on a different node where it can: the owner s first, then
s + k x (replicas per node) for k = 1, 2, ... (the same place on the next nodes, which spreads
the copies evenly), then the rest in ring order. Every holder updates its copy each step from the
same reduced gradients, so the copies are bit-identical: a copy on another node survives the
owner's death and its node's loss. The first holder serves the shard in the parameter
all-gather. Every member computes the same placement from the generation's member list.
"""

from __future__ import annotations

from collections.abc import Sequence


def preference(shard: int, num_replicas: int, replicas_per_node: int) -> list[int]:
    """Replicas in the order shard `shard` prefers them as holders."""
    n, stride = num_replicas, max(1, replicas_per_node)
    order: list[int] = []
    for k in range(n):
        r = (shard + k * stride) % n
        if r in order:
            break
        order.append(r)
    order += [(shard + k) % n for k in range(n) if (shard + k) % n not in order]
    return order


def holders(
    shard: int,
    members: Sequence[int],
    *,
    num_replicas: int,
    copies: int,
    replicas_per_node: int = 1,
) -> tuple[int, ...]:
    """The live replicas that hold `shard` (owner first when alive; at most `copies`)."""
    alive = set(members)
    prefs = [r for r in preference(shard, num_replicas, replicas_per_node) if r in alive]
    node = (lambda r: r // replicas_per_node) if replicas_per_node > 0 else (lambda r: r)
    chosen: list[int] = []
    for r in prefs:  # one copy per node first
        if len(chosen) < copies and node(r) not in {node(c) for c in chosen}:
            chosen.append(r)
    for r in prefs:  # then fill from the same nodes
        if len(chosen) < copies and r not in chosen:
            chosen.append(r)
    ordered = [r for r in prefs if r in chosen]
    return tuple(ordered)


def placement(
    members: Sequence[int], *, num_replicas: int, copies: int, replicas_per_node: int = 1
) -> tuple[tuple[int, ...], ...]:
    """`holders` of every shard 0..n-1 (index = shard)."""
    return tuple(
        holders(
            s,
            members,
            num_replicas=num_replicas,
            copies=copies,
            replicas_per_node=replicas_per_node,
        )
        for s in range(num_replicas)
    )


def held_by(replica: int, where: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The shards `replica` holds under placement `where`."""
    return tuple(s for s, hs in enumerate(where) if replica in hs)


def served_by(replica: int, where: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The shards `replica` serves in the parameter all-gather (it is their first holder)."""
    return tuple(s for s, hs in enumerate(where) if hs and hs[0] == replica)
