"""Every replica lost with the distributed optimizer: each recovered its own newest snapshot, and
they must stand on one step before shards are exchanged (`StateSync._one_recovered_step`). The
other member is simulated by the all-reduce adding its slot."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_mecefo.failover.trainer.transfer import StateSync


class _OtherMember:
    """SUM all-reduce where the other member (position 1) reports `step`."""

    def __init__(self, step: int):
        self.step = step

    def all_reduce(self, tensor, group) -> bool:
        tensor[1] += self.step
        return True


def _sync(mine: int, other: int, loads: list):
    membership = SimpleNamespace(
        size=2, position=0, group=None, members=(0, 1), replica=0, collectives=_OtherMember(other)
    )
    plane = SimpleNamespace(next_step=mine)
    sync = StateSync(plane, membership, rank=0, backend="gloo", has_state=True, log=lambda _: None)

    def recover(at_most=None):  # a snapshot keeps two slots: this one and the one before
        loads.append(at_most)
        return mine if at_most is None or at_most >= mine else max(mine - 1, at_most)

    sync.recover = recover
    return sync, plane


def test_the_replica_ahead_reloads_the_step_the_other_recovered():
    loads: list = []
    sync, plane = _sync(mine=8, other=7, loads=loads)
    best, steps = sync._one_recovered_step(8, torch.tensor([8, 7]), gen=1, deadline=0.0)
    assert (best, steps.tolist()) == (7, [7, 7])
    assert loads == [7] and plane.next_step == 7


def test_the_replica_behind_keeps_its_step():
    loads: list = []
    sync, plane = _sync(mine=7, other=8, loads=loads)
    # the other member (ahead) reloads 7 in its own process; here it reports 7 the next round
    sync.membership.collectives = _OtherMember(7)
    best, _ = sync._one_recovered_step(8, torch.tensor([7, 8]), gen=1, deadline=0.0)
    assert best == 7 and loads == [] and plane.next_step == 7
