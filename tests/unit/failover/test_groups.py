"""Superseded process groups (failover/trainer/groups.py) on CPU with stand-in groups: an NCCL
group is aborted and released when a generation replaces it (`Regroup._install` does this), a gloo
group is kept, an abort that hangs is bounded; the NCCL watchdog policy is set explicitly without
overriding a site's values, and matches the block pretrain.sbatch exports. The real NCCL path is
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
import torch.distributed as dist

from megatron_mecefo.failover.trainer import groups
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


def test_superseded_gloo_group_is_kept_never_aborted():
    graveyard, group = [], FakeGroup()
    assert groups.retire_group(group, "gloo", graveyard) is False
    assert graveyard == [group] and not group.aborted.is_set()


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
    assert fake._graveyard == [old]


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
