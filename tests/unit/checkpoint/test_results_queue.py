"""megatron's async-save result queue (`mcore/checkpointing.py`, `start_writer_queue_...`):
its items cross the Manager process as bytes, so that process never imports torch (it did at the
first save, 1.1 s of CPU in every rank that saves), and what comes out equals what went in."""

from __future__ import annotations

import subprocess
import sys

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
