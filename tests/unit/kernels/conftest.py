"""Run the kernel tests on the real GPU when there is one, else in Triton's CPU interpreter.

`triton.jit` picks compiled kernel or interpreter when the decorator runs, i.e. when
`megatron_mecefo.kernels.triton_lowrank` is imported. So, without CUDA, this conftest imports (or
re-imports) that module with TRITON_INTERPRET=1 and restores the variable afterwards; an autouse
fixture sets it again only for the tests of this directory, so it does not leak into other tests.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"


def _import_interpreted():
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from megatron_mecefo.kernels import triton_lowrank

        if not _is_interpreted(triton_lowrank):
            # Imported earlier in this session without the interpreter: decorate again.
            triton_lowrank = importlib.reload(triton_lowrank)
        return triton_lowrank
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def _is_interpreted(module) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(module._expand_into_kernel, InterpretedFunction)


if HAS_TRITON and not ON_GPU:
    _import_interpreted()


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    """Keep TRITON_INTERPRET=1 on during each CPU test (tiles/bf16 upcast/dispatch read it)."""
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture
def device() -> torch.device:
    """Device the kernel tests allocate on: cuda when present, else cpu (interpreter)."""
    return torch.device("cuda" if ON_GPU else "cpu")


@pytest.fixture
def tk():
    """The Triton kernel module, checked to be interpreted on CPU / compiled on GPU."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from megatron_mecefo.kernels import triton_lowrank

    assert _is_interpreted(triton_lowrank) != ON_GPU, (
        "triton_lowrank kernels were decorated in the wrong mode for this machine"
    )
    return triton_lowrank
