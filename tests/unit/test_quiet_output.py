"""Noise a new user met (issue 32, item 14): torch's ShardedTensor FutureWarning on every resume
(raised through our CPU layer, so it named `cpu_compat.py`) and gloo's banner inside the failover
lines. Both are filtered precisely: other warnings and the error itself still show."""

from __future__ import annotations

import warnings

import pytest

pytestmark = pytest.mark.timeout(60)

GLOO_PEER_GONE = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
    "peer [127.0.0.1]:23938. This is typically caused by a remote worker crashing. Check the logs "
    "of the remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f"
)


def _warnings_through_the_cpu_layer(environ: dict[str, str]) -> list[str]:
    """What a resume on CPU shows: torch's deprecated ShardedTensor call, dispatched by our
    CUDA-to-CPU mode, and another FutureWarning raised the same way."""
    from torch.distributed._shard._utils import DEPRECATE_MSG
    from typing_extensions import deprecated

    from megatron_mecefo.control.proc import quiet_library_warnings
    from megatron_mecefo.mcore.cpu_compat import CudaToCpuMode

    @deprecated(DEPRECATE_MSG, category=FutureWarning)
    def sharded_tensor_call(*args, **kwargs):
        return None

    @deprecated("something else is deprecated", category=FutureWarning)
    def other_call(*args, **kwargs):
        return None

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_library_warnings(environ)
        mode = CudaToCpuMode()
        mode.__torch_function__(sharded_tensor_call, (), ())
        mode.__torch_function__(other_call, (), ())
    return [f"{w.filename.rsplit('/', 1)[-1]}: {w.message}" for w in seen]


def test_the_sharded_tensor_warning_of_a_resume_is_hidden_and_no_other():
    shown = _warnings_through_the_cpu_layer({})
    assert shown == ["cpu_compat.py: something else is deprecated"], shown
    verbose = _warnings_through_the_cpu_layer({"MECEFO_VERBOSE": "1"})
    assert len(verbose) == 2 and "ShardedTensor" in verbose[0], verbose


def test_a_failed_gloo_collective_is_a_short_failover_line():
    from megatron_mecefo.failover.trainer import collectives

    class FailedWork:
        def wait(self, timeout=None):
            raise RuntimeError(GLOO_PEER_GONE + "\nException raised from ... (C++ frames)")

        def is_completed(self):
            return True

    why = collectives._wait_gloo(FailedWork(), "all-reduce", lambda: None)
    assert why == "all-reduce failed: Connection closed by peer [127.0.0.1]:23938.", why
    assert collectives.brief_error(RuntimeError("")) == "RuntimeError"
    assert collectives.brief_error(ValueError("plain text: kept")) == "plain text: kept"
