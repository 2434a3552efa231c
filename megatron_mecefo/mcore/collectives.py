"""Small agreements over the default process group (no failover): every rank of the group calls
them in the same order. Failover's own agreements go through the store (`failover/trainer`).
Imports torch on first use only."""

from __future__ import annotations

from collections.abc import Callable


def share_over_default_group() -> Callable[[str], str]:
    """Rank 0's proposal, broadcast over the default process group (all ranks call it)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return lambda proposal: proposal

    def share(proposal: str) -> str:
        box = [proposal]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    return share


def agree_min_over_default_group(device) -> Callable[[int], int]:
    """`agree_min` over the default process group (identity when it has one rank)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return lambda x: x

    def agree(value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)  # every rank of the group calls this in order
        return int(t.item())

    return agree
