"""`control.proc.forks_die_with_parent`: a trainer's forked children (async checkpoint writers)
die with it when it is SIGKILLed, even one that was forked just as the parent died."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_mecefo.control.proc import FORK_NAME

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux only")

# The parent forks one child and prints its pid. With `late`, a hook registered before
# forks_die_with_parent's runs first in the child and waits (<= 10 s) for the parent to be gone:
# the child binds itself to a parent that has already died.
_PARENT = textwrap.dedent(
    """
    import os, sys, time
    from megatron_mecefo.control.proc import forks_die_with_parent
    late = sys.argv[1] == "late"
    if late:
        origin = os.getpid()  # the parent, known before the fork (not read in the child: a
        # child that first runs after its parent died would wait out the deadline, 10 s)
        def wait_for_orphaning():
            deadline = time.monotonic() + 10
            while os.getppid() == origin and time.monotonic() < deadline:
                time.sleep(0.01)
        os.register_at_fork(after_in_child=wait_for_orphaning)
    forks_die_with_parent()
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    print(pid, flush=True)
    time.sleep(60)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as fh:
        return fh.read().strip()


@pytest.mark.parametrize("when", ["bound", "late"])
def test_a_forked_child_dies_with_its_sigkilled_parent(when):
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, when], stdout=subprocess.PIPE, text=True
    )
    child = 0
    try:
        child = int(parent.stdout.readline())
        if when == "bound":  # the child names itself once bound: wait for that, then kill
            deadline = time.monotonic() + 10
            while _alive(child) and _comm(child) != FORK_NAME:
                assert time.monotonic() < deadline, "the child never bound itself"
                time.sleep(0.01)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(child), f"forked child {child} outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait(timeout=10)
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)
