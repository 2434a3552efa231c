"""What the ranks of `tests/helpers/dist.run_distributed` import before they are forked (the
forkserver's preload): torch, megatron-core and the trainer, with one OpenMP thread. Importing this
module fails where forking its process would be unsafe (a thread, a CUDA context, a process
group: `warm_spare.fork_unsafe`), so the server refuses to start instead of forking a broken
state."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from megatron_mecefo.warm_spare import fork_unsafe, preload  # noqa: E402

preload()
_why = fork_unsafe()
if _why is not None:
    raise RuntimeError(f"the forkserver of the distributed tests cannot fork safely: {_why}")
