"""Optimizer shards at a regroup (the distributed optimizer under failover).

Each shard of the flat parameter space belongs to a logical replica and is held by
`failover.shard_copies` live replicas (`optim/placement.py`, node-diverse). Holders update their
copies from the same all-reduced gradients, so the copies stay bit-identical. After the state
step is agreed (`transfer.py`), this brings every shard to its new holders:

1. every member says which shards it holds *at the agreed step* (a k x n matrix, all-reduced);
2. a shard with a live copy goes from its first live holder to each new holder that lacks it
   (p2p, tag 1000 + shard); that is adoption after a death and hand-back after a rejoin;
3. a shard with no live copy is read from the checkpoint every member loaded at that step, or,
   at step 0, rebuilt from the (identical) initial parameters;
4. otherwise there is no exact source, and approximate state is never used: every rank rolls
   back (exits to be restarted, and the recovery order loads the newest snapshot or checkpoint,
   whose shards are exact), or, with neither enabled or after such a recovery, the job stops
   with one line naming the shards (`transfer.StateSync._shards_lost`);
5. holders drop the shards they no longer hold, and the primaries all-gather the parameters.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from megatron_mecefo.optim import placement as place
from megatron_mecefo.optim.sharded import ShardedOptimizer, ShardState

TAG = 1000


def sync_shards(
    opt: ShardedOptimizer,
    membership,
    *,
    best: int,
    mine: int,
    p2p: Callable[[Any, str], None],
    collective: Callable[[torch.Tensor], None],
    abort: Callable[[str], None],
    lost_handler: Callable[[list[int]], None],
) -> dict[str, Any]:
    """Move shards to the placement of `membership.members` (collective over the members).

    `mine`: this member's state step (it holds valid shards iff `mine == best`). `p2p(work,
    what)` waits for a send or receive (raises on a lost peer); `collective(t)` SUM-all-reduces
    `t` (raises); `abort(reason)` ends the job; `lost_handler(shards)` is called (and must raise)
    when shards have no exact source. Returns what moved (for events and benchmarks).
    """
    m = membership
    members = tuple(m.members)
    n, size, me = opt.layout.num_shards, len(members), m.position
    t0 = time.monotonic()
    where = opt.placement(members)
    table = torch.zeros(size, n + 1, dtype=torch.int64)  # [shards held at best..., disk step ok]
    if mine == best:
        for s in opt.held:
            table[me, s] = 1
    table[me, n] = int(opt.disk is not None and opt.disk[1] == best)
    if size > 1:
        collective(table)
    have, disk = table[:, :n], table[:, n]
    from_disk, fresh, lost = [], [], []
    for s in range(n):
        if have[:, s].any():
            continue
        if disk.all() and size:  # every member loaded the same checkpoint at `best`
            from_disk.append(s)
        elif best == 0:
            fresh.append(s)
        else:
            lost.append(s)
    if lost:
        lost_handler(lost)
    works, received, sending, moved = [], {}, [], 0
    for s in range(n):
        live = [j for j in range(size) if have[j, s]]
        if not live:
            continue
        src = live[0]
        for h in where[s]:
            dst = members.index(h)
            if have[dst, s]:
                continue
            length = opt.layout.shard_len(s)
            moved += 12 * length
            if me == src:
                st = opt.held[s]
                payload = torch.cat([st.master, st.exp_avg, st.exp_avg_sq]).contiguous()
                works.append((m.group.send([payload], dst, TAG + s), "shard send"))
                sending.append(payload)  # alive until the send completes
            elif me == dst:
                buf = torch.empty(3 * length, dtype=torch.float32, device=opt.device)
                works.append((m.group.recv([buf], src, TAG + s), "shard receive"))
                received[s] = buf
    for work, what in works:
        p2p(work, what)
    for s, buf in received.items():
        master, exp_avg, exp_avg_sq = buf.chunk(3)
        opt.held[s] = ShardState(master.clone(), exp_avg.clone(), exp_avg_sq.clone())
    for s in place.held_by(m.replica, where):
        if s in from_disk:
            opt.held[s] = opt.read_disk(s)
        elif s in fresh:
            opt.held[s] = opt.fresh_shard(s)
    opt.disk = None
    opt.set_holdings(where)
    missing = [s for s in place.held_by(m.replica, where) if s not in opt.held]
    if missing:  # a bug, never a state to train on
        abort(f"replica {m.replica} did not receive optimizer shards {missing}")
    return {
        "where": where,
        "bytes": moved,
        "from_disk": from_disk,
        "fresh": fresh,
        "seconds": time.monotonic() - t0,
    }
