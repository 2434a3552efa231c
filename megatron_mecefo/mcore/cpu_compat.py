"""CPU compatibility layer: lets the real megatron-core 0.16.1 stack run without CUDA.

Megatron hard-codes `device="cuda"` in hundreds of places (schedules, DDP buffers, optimizer, clip
grads, dist_checkpointing). `apply()` installs a TorchFunctionMode that rewrites CUDA device
arguments to CPU, swaps the CUDA RNG tracker for a CPU one and stubs the few `torch.cuda` calls that
have no tensor. `init_parallel` applies it only when CUDA is absent, never on a GPU
machine.

Caveats (see shared/notes/megatron-core-on-cpu.md): the mode is thread-local, so threads the project
starts must enter `CudaToCpuMode()` themselves; `Tensor.type()` reports `torch.cuda.*` under it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_LOCK = threading.Lock()


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # torch.cuda.current_device() is stubbed to return 0, and megatron passes that int as a device.
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpuMode(TorchFunctionMode):
    """Rewrite `device='cuda'`-like arguments to CPU on every torch call made under the mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's clip_grads asserts grads are 'torch.cuda.FloatTensor'
            name = func(*args)
            return (
                name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
            )
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device=_CPU)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        return func(*args, **kwargs)


class _NoopCudaObject:
    """Stand-in for torch.cuda.Stream / Event: every method is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *a, **k: None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_STATE: dict[str, Any] = {}  # process-wide: whether apply() ran and the mode object it entered


def apply() -> None:
    """Install the compatibility layer in this process (idempotent; call before building models)."""
    with _LOCK:
        if _STATE.get("applied"):
            _ensure_mode_in_this_thread()
            return
        _install_rng_tracker()
        _stub_torch_cuda()
        _STATE["applied"] = True
        _ensure_mode_in_this_thread()


def _ensure_mode_in_this_thread() -> None:
    local = _STATE.setdefault("thread_local", threading.local())
    if getattr(local, "mode", None) is None:
        local.mode = CudaToCpuMode()
        local.mode.__enter__()


def _install_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's model-parallel RNG tracker, keeping CPU generator states."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # activation recomputation saves/restores the "CUDA" RNG state
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def _stub_torch_cuda() -> None:
    c = torch.cuda
    c.current_device = lambda: 0
    c.synchronize = lambda *a, **k: None
    c.empty_cache = lambda *a, **k: None
    c.Stream = _NoopCudaObject
    c.Event = _NoopCudaObject
    c.current_stream = lambda *a, **k: _NoopCudaObject()
    c.default_stream = lambda *a, **k: _NoopCudaObject()
    c.stream = lambda *a, **k: contextlib.nullcontext()
    c.get_rng_state = lambda *a, **k: torch.get_rng_state()
    c.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    c.manual_seed = lambda seed: None
    c.manual_seed_all = lambda seed: None
    c.memory_allocated = lambda *a, **k: 0
    c.max_memory_allocated = lambda *a, **k: 0
    c.reset_peak_memory_stats = lambda *a, **k: None
