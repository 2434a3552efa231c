"""megatron-core's fused kernels stay plain functions under a CPU build of torch.

megatron decorates its fused element-wise kernels with `torch.compile` at import time
(`megatron.core.jit.jit_fuser`): the first decoration imports torch's dynamo and inductor and each
one sets up a compile. The first optimizer imports dynamo anyway (`Optimizer.__init__`, about
0.7 s; `warm_spare.preload` pays it), so what is saved is the rest: a fork server's imports and
first optimizer took 4.3-4.7 s of CPU, 3.1-3.5 s without it (4 runs each, idle), paid by every
node's fork server, every exec'd trainer and every test worker.
With a CPU build of torch there is no GPU kernel to fuse, and the model config turns those
fusions off anyway (`mcore/model.py`), so right after `megatron.core.jit` runs, its
`disable_jit_fuser()` makes the decorator a no-op. With a CUDA or ROCm build nothing changes.

`install()` adds an import hook (no torch import); `mcore/__init__.py` calls it, since that
package is the only one that imports megatron-core.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

JIT_MODULE = "megatron.core.jit"


def cpu_build() -> bool:
    """torch was built for neither CUDA nor ROCm (asks nothing of a driver: fork-safe)."""
    import torch

    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        if cpu_build():
            module.disable_jit_fuser()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Hook `megatron.core.jit`'s import (once; nothing if it is imported already: the
    decorations it would spare are done)."""
    if JIT_MODULE in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
