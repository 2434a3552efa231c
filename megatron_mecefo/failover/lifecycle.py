"""Process lifetimes: no process of a job outlives the one that started it.

Linux only (`prctl(PR_SET_PDEATHSIG)`); elsewhere these are no-ops. No torch import.
"""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies. Use as a Popen
    `preexec_fn` (it runs in the child) or call it in a forked child."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
