"""`mcore/eager_jit.py`: with a CPU build of torch, importing megatron-core through this package
leaves its `jit_fuser` a no-op, so neither dynamo nor inductor is imported (2.6 s of CPU in every
process that imports megatron-core); with a CUDA build it stays `torch.compile`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

CHILD = """
import json, sys
import torch
if sys.argv[1] == "cuda":
    torch.version.cuda = "12.8"  # what a CUDA build says; no driver is asked
import megatron_mecefo.mcore
from megatron_mecefo.mcore.model import preload_megatron
preload_megatron()
import megatron.core.jit as jit
print(json.dumps({
    "fuser": jit.jit_fuser.__name__,
    "dynamo": "torch._dynamo" in sys.modules,
    "inductor": "torch._inductor" in sys.modules,
}))
"""


def _imports(build: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, build], capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cpu_build_imports_megatron_without_dynamo_or_inductor():
    import torch

    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch: megatron keeps torch.compile")
    got = _imports("cpu")
    assert got == {"fuser": "noop_decorator", "dynamo": False, "inductor": False}, got


def test_a_cuda_build_keeps_torch_compile():
    got = _imports("cuda")
    assert got["fuser"] == "compile" and got["inductor"], got
