"""Superseded process groups (failover/trainer/groups.py) on CPU: an NCCL stand-in group is
aborted and released when a generation replaces it (`Regroup._install` does this), an abort that
hangs is bounded; a real gloo group's abandoned collective ends within the failover bound and the
superseded group, released from a thread, takes its transport thread with it; the NCCL watchdog
policy is set explicitly without overriding a site's values, and matches the block pretrain.sbatch
exports. The real NCCL path is
tests/gpu/test_nccl_groups_gpu.py."""

from __future__ import annotations

import gc
import os
import re
import threading
import time
import types
import weakref
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_mecefo.failover.trainer import groups
from megatron_mecefo.failover.trainer.collectives import AbortableCollectives, CollectiveBound
from megatron_mecefo.failover.trainer.regroup import Regroup

pytestmark = pytest.mark.timeout(60)

SBATCH = Path(__file__).resolve().parents[3] / "launch" / "slurm" / "pretrain.sbatch"


class FakeGroup:
    def __init__(self, hang_s: float = 0.0):
        self.aborted = threading.Event()
        self.hang_s = hang_s

    def abort(self) -> None:
        time.sleep(self.hang_s)
        self.aborted.set()


def test_superseded_nccl_group_is_aborted_and_released():
    graveyard, group = [], FakeGroup()
    ref = weakref.ref(group)
    assert groups.retire_group(group, "nccl", graveyard, log=lambda m: None) is True
    assert group.aborted.is_set() and graveyard == []
    del group
    gc.collect()
    assert ref() is None  # nothing holds it: torch destroys the communicator


def _gloo_loops() -> int:
    """This process's gloo transport threads (one per live gloo group)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            n += Path(f"/proc/self/task/{tid}/comm").read_text().strip() == "gloo_tcp_loop"
        except OSError:
            pass  # the thread ended meanwhile
    return n


def test_a_superseded_gloo_group_ends_its_bounded_work_and_goes_with_its_thread():
    """Two ranks of a real gloo group in one process (threads): rank 0 reduces, rank 1 never
    does (it died). The reduction fails within the failover bound, not the group's 20 s; both
    groups are then retired and their transport threads end (a kept group keeps its thread, which
    spins at a full core on a dead peer's unread data: pytorch/gloo#246)."""
    store, built = dist.HashStore(), [None, None]
    before = _gloo_loops()

    def build(rank: int) -> None:
        built[rank] = dist.ProcessGroupGloo(
            dist.PrefixStore("g", store), rank, 2, timedelta(seconds=20)
        )

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert _gloo_loops() == before + 2
    bound = CollectiveBound("gloo", floor_s=0.5, factor=5.0)
    assert bound() is None  # no step timed yet: the group's own timeout
    bound.step_took(0.05)
    assert bound() == timedelta(seconds=0.5)
    coll = AbortableCollectives("gloo", lambda: None, lambda: None, bound)
    start = time.monotonic()
    assert coll.all_reduce(torch.ones(8), built[0]) is False
    assert "Timed out" in coll.failed and time.monotonic() - start < 5.0, coll.failed
    graveyard = []
    while built:
        assert groups.retire_group(built.pop(), "gloo", graveyard) is True
    assert graveyard == []
    deadline = time.monotonic() + 10
    while _gloo_loops() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gloo_loops() == before


def test_the_bound_follows_the_slowest_step_and_leaves_nccl_alone():
    bound = CollectiveBound("gloo", floor_s=10.0, factor=5.0)
    bound.step_took(1.0)
    assert bound() == timedelta(seconds=10)  # the floor
    bound.step_took(4.0)
    bound.step_took(0.5)
    assert bound() == timedelta(seconds=20)  # 5 x the slowest step
    nccl = CollectiveBound("nccl", floor_s=10.0, factor=5.0)
    nccl.step_took(4.0)
    assert nccl() is None  # superseded NCCL groups are aborted instead


def test_no_collective_is_issued_on_a_lost_generation():
    """Once a newer generation dropped a member, nobody uses the old group again: a collective
    issued there would only add work that waits on the dead peer."""

    class Refuses:
        def allreduce(self, *a):
            raise AssertionError("issued on a lost generation")

        _allgather_base = allreduce

    reduced = []
    coll = AbortableCollectives(
        "gloo", lambda: "generation 2 removed replicas [1]", lambda: reduced.append(1)
    )
    assert coll.all_reduce(torch.ones(2), Refuses()) is False
    assert coll.all_gather(torch.ones(4), torch.ones(2), Refuses()) is False
    assert coll.failed == "all-reduce not issued: generation 2 removed replicas [1]"
    assert reduced == [1]  # the reduce phase is still reported


def test_abort_that_hangs_is_bounded_and_the_group_kept():
    graveyard, group, said = [], FakeGroup(hang_s=5.0), []
    start = time.monotonic()
    assert groups.retire_group(group, "nccl", graveyard, timeout_s=0.3, log=said.append) is False
    assert time.monotonic() - start < 2.0
    assert graveyard == [group] and "did not finish" in said[0]


def test_regroup_install_aborts_the_previous_nccl_group():
    """`Regroup._install` on a stand-in regroup: the new generation's group replaces the old one,
    which is aborted (NCCL) rather than only abandoned; the membership forgets the old errors."""
    old, new = FakeGroup(), FakeGroup()
    resets = []
    membership = types.SimpleNamespace(
        generation=1, members=(0, 1, 2), group=old, begin_attempt=lambda: resets.append(1)
    )
    fake = types.SimpleNamespace(
        membership=membership, backend="nccl", _graveyard=[], log=lambda m: None
    )
    Regroup._install(fake, 2, (0, 1), new)
    assert old.aborted.is_set() and fake._graveyard == []
    assert membership.group is new and membership.generation == 2 and resets == [1]
    fake.backend, membership.group = "gloo", old
    Regroup._install(fake, 3, (0,), new)
    assert fake._graveyard == [] and membership.group is new  # gloo: released, never kept


def test_policy_is_explicit_and_a_site_value_wins():
    env = {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "1200"}
    applied = groups.apply_nccl_policy(env, timeout_s=120)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # abort the comm, keep the process
    assert env["TORCH_NCCL_BLOCKING_WAIT"] == "0"
    assert env["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "120"
    assert env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "1200"
    assert "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC" not in applied


def test_new_nccl_group_nonblocking_with_timeout_and_eager_connect(monkeypatch):
    built = {}

    class Options:
        def __init__(self):
            self.config = types.SimpleNamespace(blocking=True)

    class FakeNCCL:
        def __init__(self, store, rank, size, opts):
            built.update(store=store, rank=rank, size=size, opts=opts)

        def eager_connect_single_device(self, device):
            built["device"] = device

    FakeNCCL.Options = Options
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    for key in list(groups.NCCL_POLICY) + [
        "TORCH_NCCL_NONBLOCKING_TIMEOUT",
        groups.NONBLOCKING_ENV,
    ]:
        monkeypatch.delenv(key, raising=False)
    groups.new_nccl_group("store", 1, 3, timedelta(seconds=45), device="cuda:1")
    assert (built["rank"], built["size"], built["device"]) == (1, 3, "cuda:1")
    assert built["opts"]._timeout == timedelta(seconds=45)
    assert built["opts"].config.blocking is False
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert os.environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "45"
    monkeypatch.setenv(groups.NONBLOCKING_ENV, "0")
    groups.new_nccl_group("store", 0, 2, timedelta(seconds=45), device="cuda:0")
    assert built["opts"].config.blocking is True


def test_sbatch_exports_the_same_nccl_policy():
    text = SBATCH.read_text()
    for key, value in groups.NCCL_POLICY.items():
        pattern = rf'export {key}="\$\{{{key}:-([^}}]*)\}}"'
        found = re.search(pattern, text)
        assert found, f"pretrain.sbatch does not export {key}"
        assert found.group(1) == value, (key, found.group(1), value)
