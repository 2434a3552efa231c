"""megatron's async-save result queue (`mcore/checkpointing.py`, `start_writer_queue_...`):
its items cross the Manager process as bytes, so that process never imports torch (it did at the
first save, 1.1 s of CPU in every rank that saves), and what comes out equals what went in."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(90)

CHILD = """
import queue, signal
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron_mecefo.mcore import checkpointing

checkpointing.start_writer_queue_ignoring_stop_signals()
q = filesystem_async._results_queue
results = {0: [WriteResult(index=MetadataIndex("w", offset=torch.Size([0, 4])), size_in_bytes=64,
                           storage_data="__0_0.distcp")]}
q.put(results)
assert q.get_nowait() == results
try:
    q.get_nowait()
    raise SystemExit("an empty queue answered")
except queue.Empty:
    pass
pid = getattr(q, "inner", q)._manager._process.pid
maps = open(f"/proc/{pid}/maps").read()
print("TORCH_IN_MANAGER", "libtorch" in maps)
"""


def test_results_cross_the_manager_as_bytes_and_it_never_imports_torch():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=80)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TORCH_IN_MANAGER False" in out.stdout, out.stdout + out.stderr[-2000:]


KILLED = """
import os, signal
from multiprocessing import resource_tracker
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron_mecefo.mcore import checkpointing

checkpointing.start_writer_queue_ignoring_stop_signals()
q = filesystem_async._results_queue
print("PIDS", q.inner._manager._process.pid, resource_tracker._resource_tracker._pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_manager_and_its_resource_tracker_die_with_a_rank_killed_alone(tmp_path):
    """A rank SIGKILLed by itself (not its process group: a failover test, the peers benchmark)
    left megatron's result-queue Manager (it ignores SIGTERM by design) and multiprocessing's
    resource tracker running for good: about 30 of them after a benchmark."""
    psutil = pytest.importorskip("psutil")
    log = tmp_path / "out"
    with log.open("w") as fh:  # not a pipe: a survivor holding it open would hang the read
        rc = subprocess.run([sys.executable, "-c", KILLED], stdout=fh, stderr=fh, timeout=80)
    text = log.read_text()
    assert rc.returncode == -9 and "PIDS" in text, text[-3000:]
    pids = [int(p) for p in text.split("PIDS", 1)[1].split()[:2]]

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert left == [], f"still running after their rank was killed: {left}"
