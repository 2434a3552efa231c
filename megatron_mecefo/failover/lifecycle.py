"""Process lifetimes: no process of a job outlives the one that started it, and a dying job's
processes say why in one line, not in pages of C++ stack frames.

Linux only (`prctl(PR_SET_PDEATHSIG)`); elsewhere `die_with_parent` is a no-op. No torch import.
"""

from __future__ import annotations

import ctypes
import signal
import sys
from collections.abc import MutableMapping

_PR_SET_PDEATHSIG = 1

CPP_LOG_LEVEL = ("TORCH_CPP_LOG_LEVEL", "FATAL")
"""torch's C++ log level for a launcher and everything it starts (a value already set wins).
Once the store is gone, torch's C++ logging prints a warning with ~20 C++ stack frames on every
store call and every reconnect attempt of every process; the Python error that follows is what
each process reports, in one line. `TORCH_CPP_LOG_LEVEL=WARNING` brings those logs back."""


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies. Use as a Popen
    `preexec_fn` (it runs in the child) or call it in a forked child.

    The kernel ties this to the parent *thread* that forked the child: fork from a thread that
    lives as long as the parent process (the main thread)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def quiet_cpp_logs(environ: MutableMapping[str, str]) -> None:
    """Set `CPP_LOG_LEVEL` in `environ` (os.environ: this process and its children) unless it
    is set. torch reads it when it loads: call it before the first `import torch`."""
    environ.setdefault(*CPP_LOG_LEVEL)
