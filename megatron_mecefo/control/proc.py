"""Process lifetimes: no process of a job outlives the one that started it, and a dying job's
processes say why in one line, not in pages of C++ stack frames.

Linux only (`prctl(PR_SET_PDEATHSIG)`); elsewhere `die_with_parent` is a no-op. No torch import.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import MutableMapping

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36

FORK_NAME = "mecefo-fork"
"""`/proc/PID/comm` of a process forked by one that called `forks_die_with_parent` (a trainer's
async checkpoint writers), set once it is bound to die with its parent: `ps -o pid,comm` tells
them apart from their parent, whose command line they share."""

CPP_LOG_LEVEL = ("TORCH_CPP_LOG_LEVEL", "FATAL")
"""torch's C++ log level for a launcher and everything it starts (a value already set wins).
Once the store is gone, torch's C++ logging prints a warning with ~20 C++ stack frames on every
store call and every reconnect attempt of every process; the Python error that follows is what
each process reports, in one line. `TORCH_CPP_LOG_LEVEL=WARNING` brings those logs back."""


VERBOSE_ENV = "MECEFO_VERBOSE"
"""`1`: keep the libraries' import-time warnings (megatron-core's "Transformer Engine and Apex are
not installed ..." lines, printed by every rank); by default they are silenced."""

SHARDED_TENSOR_DEPRECATION = r"Please use DTensor instead and we are deprecating ShardedTensor"
"""torch's FutureWarning (`torch/distributed/_shard/_utils.py`) on each ShardedTensor call that
megatron's `dist_checkpointing` makes while loading a checkpoint (a regex of its start)."""


def quiet_library_warnings(environ: MutableMapping[str, str]) -> None:
    """Silence megatron-core's warnings in this process unless `MECEFO_VERBOSE=1`: they say
    which optional GPU libraries are missing (known on a CPU machine), once per rank."""
    if environ.get(VERBOSE_ENV) == "1":
        return
    import warnings

    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"megatron(\.|$)")
    # megatron's checkpoint loading calls torch's deprecated ShardedTensor (every resume); on CPU
    # that call passes through our CUDA-to-CPU mode, so torch's FutureWarning names that module
    warnings.filterwarnings(
        "ignore",
        message=SHARDED_TENSOR_DEPRECATION,
        category=FutureWarning,
        module=r"megatron_mecefo\.mcore\.cpu_compat$",
    )


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies. Use as a Popen
    `preexec_fn` (it runs in the child) or call it in a forked child.

    The kernel ties this to the parent *thread* that forked the child: fork from a thread that
    lives as long as the parent process (the main thread)."""
    _prctl(_PR_SET_PDEATHSIG, int(sig))


def die_with(parent: int) -> None:
    """`die_with_parent` in a process started by `parent` (a pid): if `parent` died before the
    `prctl`, the kernel will never say so, so the process kills itself now. Called in a forked
    child (`forks_die_with_parent`) or where no at-fork hook runs (multiprocessing's spawn:
    fork and exec)."""
    die_with_parent()
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def forks_die_with_parent() -> None:
    """Whatever this process forks from now on (megatron's async checkpoint writers) dies with
    it, even when it is SIGKILLed: no writer outlives its trainer holding files and pipes open.

    A parent that dies between the fork and the child's `prctl` would never be reported to the
    child, so the child checks its parent pid after the `prctl` and kills itself if it changed.
    Forks must come from the main thread (see `die_with_parent`)."""
    parent = [os.getpid()]

    def note_parent() -> None:
        parent[0] = os.getpid()

    def bind_child() -> None:
        die_with(parent[0])
        _prctl(_PR_SET_NAME, ctypes.c_char_p(FORK_NAME.encode()))  # a name of <= 15 bytes

    os.register_at_fork(before=note_parent, after_in_child=bind_child)


def set_child_subreaper(on: bool) -> None:
    """While on, orphans among this process's descendants become its children (Linux): a
    trainer forked by the fork server through a parent that exits at once is re-parented here,
    so this process waits for it and reads its exit code like any child's."""
    _prctl(_PR_SET_CHILD_SUBREAPER, int(on))


def set_cmdline(argv: list[str]) -> None:
    """Show `argv` as this process's command line (`/proc/PID/cmdline`, `ps`, psutil) by
    rewriting the argument area the kernel gave it at exec, truncated to that area's length.
    A trainer forked from the fork server shows its own command, not the server's."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().decode(errors="replace").rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (stat fields 48, 49)
    except (OSError, IndexError, ValueError):
        return
    room = end - start - 1  # the last byte stays NUL
    data = "\0".join(argv).encode(errors="replace")[:room]
    ctypes.memmove(start, data.ljust(room + 1, b"\0"), room + 1)


def _prctl(option: int, arg) -> None:
    """`prctl(option, arg)` on Linux; elsewhere nothing."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)


def quiet_cpp_logs(environ: MutableMapping[str, str]) -> None:
    """Set `CPP_LOG_LEVEL` in `environ` (os.environ: this process and its children) unless it
    is set. torch reads it when it loads: call it before the first `import torch`."""
    environ.setdefault(*CPP_LOG_LEVEL)


def proc_state(pid: int) -> tuple[str, int] | None:
    """(scheduler state letter, utime + stime in clock ticks) of `pid`, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()  # the command name may hold spaces or parens
    if len(fields) < 13:
        return None
    return fields[0], int(fields[11]) + int(fields[12])


def signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    """Signal the process group a rank leads (it and whatever it forked: a SIGKILLed trainer's
    checkpoint-writer children would otherwise live on, holding its pipes)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def ignore_stop_signal() -> None:
    """Children start with SIGUSR1 ignored (a stop request to the whole Slurm step must not kill
    a process before it installs its own handler; trainers install one, the rest ignore it), and
    die with the agent: a SIGKILLed agent leaves no trainer, spare or snapshot process behind
    (each in its own session, so no signal to the agent's group reaches them)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    die_with_parent()


def exit_now(code: int):
    """Exit with `code` after the atexit handlers (multiprocessing stops its helper processes
    there, loggers flush) and stdio, without the interpreter's teardown: with torch and megatron
    imported it takes 1.1 s of CPU (module and object clean-up; 0.4 s with torch alone), which
    a process that has closed its files does not need. `mecefo-train` and `mecefo-coordinator`
    end so; a rank under failover has always ended with a bare `os._exit`."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
