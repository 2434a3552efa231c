"""`ControlPlane.membership_lost`: what makes a rank abandon a reduction it is blocked in. A lost
node replaced by a standby within a beat publishes a failure generation and then a join that lists
the same replicas again; a rank that sees only the join must still abandon (a CI run once waited
120 s for gloo's timeout there)."""

from __future__ import annotations

import dataclasses
import datetime
import json

import torch.distributed as dist

from megatron_mecefo.control import keys
from megatron_mecefo.failover.trainer.plane import ControlPlane


@dataclasses.dataclass
class _Beat:
    latest_gen: int
    job_done: bool = False
    beat_dir: None = None


def _plane(records: list[dict], latest: int) -> ControlPlane:
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )
    for gen, record in enumerate(records, 1):
        store.set(keys.gen_record(gen), json.dumps(record))
    plane = ControlPlane(f"127.0.0.1:{store.port}", 10.0, incarnation=0)
    plane.hb = _Beat(latest)
    plane._keep_store = store  # the server lives as long as the plane
    return plane


START = {"members": [0, 1, 2, 3], "incarnations": {"0": 0, "1": 0, "2": 0, "3": 0}}
FAILURE = {"members": [2, 3], "removed": [0, 1], "reason": "failure"}
JOIN = {"members": [0, 1, 2, 3], "added": [0, 1], "reason": "join",
        "incarnations": {"0": 1, "1": 1, "2": 0, "3": 0}}  # fmt: skip


def test_a_failure_superseded_by_a_join_still_abandons_the_reduction():
    plane = _plane([START, FAILURE, JOIN], latest=3)
    assert plane.membership_lost(1, (0, 1, 2, 3)) == "generation 2 removed replicas [0, 1]"


def test_new_incarnations_of_the_same_replicas_abandon_it_too():
    plane = _plane([START, JOIN], latest=2)  # no failure generation in between
    assert plane.membership_lost(1, (0, 1, 2, 3)) == (
        "generation 2 has new incarnations of ranks [0, 1]"
    )


def test_a_join_of_new_replicas_does_not():
    grow = {"members": [0, 1, 2, 3, 4], "added": [4], "reason": "join",
            "incarnations": {"0": 0, "1": 0, "2": 0, "3": 0, "4": 0}}  # fmt: skip
    plane = _plane([START, grow], latest=2)
    assert plane.membership_lost(1, (0, 1, 2, 3)) is None
    assert plane.membership_lost(2, (0, 1, 2, 3, 4)) is None  # nothing newer
