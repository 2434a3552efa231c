"""A process that has imported torch, megatron-core and the trainer once, and forks one
`mecefo-train` run per order (`tests/helpers/cli.run_train`): a single-process training in a test
then costs its steps, not 4-8 s of imports. The product's fork server (`megatron_mecefo.warm_spare
--serve`) does the same for the ranks `mecefo-launch` starts, with the same safety check before
any fork (one thread, no CUDA context, no process group); `tests/unit/failover/test_fork_server.py`
shows a forked trainer equals a fresh one bit for bit. The CLI's own tests (`tests/e2e/test_cli.py`)
still start `python -m megatron_mecefo.train`.

Protocol, one JSON line each way: the server says {"ready"} once; per order {"args", "env",
"cwd", "out", "world"} it forks `world` ranks, each in its own session with torchrun's variables
(RANK, WORLD_SIZE, MASTER_ADDR, a free MASTER_PORT: the env:// rendezvous) and its stdout and
stderr in `<out>.<rank>.stdout|stderr`, answers {"pids"}, waits for them and answers {"code"}: as
torchrun, 0 when every rank exited 0, else the first failure's (negative: killed by that signal,
as `subprocess` says) once the other ranks were SIGKILLed. The launchers themselves (torchrun,
mecefo-launch, run.sh) are tested in `tests/e2e/test_cli.py`, `test_peers.py` and `tests/dist`.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from tests.helpers.dist import free_port

if __name__ == "__mp_main__":  # re-imported in a multiprocessing spawn child of a run
    from megatron_mecefo.control.proc import die_with_parent

    die_with_parent()


def _say(record: dict) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _become_the_rank(order: dict, rank: int, port: int) -> int:
    """In the forked child: its own session, its files on fds 0-2, its environment, then
    `mecefo-train`'s main, and its exit (`proc.exit_now`)."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the orders pipe is the server's
    for fd, kind in ((1, "stdout"), (2, "stderr")):
        out = os.open(f"{order['out']}.{rank}.{kind}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.chdir(order["cwd"])
    os.environ.clear()
    os.environ.update(order["env"])
    world = order["world"]
    if world > 1:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    from megatron_mecefo import train
    from megatron_mecefo.control.proc import exit_now

    sys.argv = [train.__file__, *order["args"]]
    exit_now(train.main(order["args"]))  # as `mecefo-train` ends


def serve() -> int:
    from megatron_mecefo.warm_spare import fork_unsafe, preload

    preload()
    why = fork_unsafe()
    _say({"ready": why is None, "why": why})
    if why is not None:
        return 1
    for line in sys.stdin:
        if not line.strip():
            continue
        order = json.loads(line)
        port = free_port()
        pids = []
        for rank in range(order["world"]):
            pid = os.fork()
            if pid == 0:
                return _become_the_rank(order, rank, port)
            pids.append(pid)
        _say({"pids": pids})
        _say({"code": _wait_all(pids)})
    return 0


def kill_sessions(pids) -> None:
    """SIGKILL the session of each rank in `pids` (a rank and whatever it started), if alive."""
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_all(pids: list[int]) -> int:
    """0 when every rank exits 0; else the first failure's code, the others SIGKILLed."""
    left, first = set(pids), 0
    while left:
        pid, status = os.waitpid(-1, 0)
        if pid not in left:
            continue
        left.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and first == 0:
            first = code
            kill_sessions(left)
    return first


if __name__ == "__main__":
    sys.exit(serve())
