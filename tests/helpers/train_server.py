"""A process that has imported torch, megatron-core and the trainer once, and forks one
`mecefo-train` run per order (`tests/helpers/cli.run_train`): a single-process training in a test
then costs its steps, not 4-8 s of imports. The product's fork server (`megatron_mecefo.warm_spare
--serve`) does the same for the ranks `mecefo-launch` starts, with the same safety check before
any fork (one thread, no CUDA context, no process group); `tests/unit/failover/test_fork_server.py`
shows a forked trainer equals a fresh one bit for bit. The CLI's own tests (`tests/e2e/test_cli.py`)
still start `python -m megatron_mecefo.train`.

Protocol, one JSON line each way: the server says {"ready"} once; per order {"args", "env",
"cwd", "stdout", "stderr"} (file paths) it forks the run in its own session, answers {"pid"},
waits for it and answers {"code"} (negative: killed by that signal, as `subprocess` says).
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__mp_main__":  # re-imported in a multiprocessing spawn child of a run
    from megatron_mecefo.control.proc import die_with_parent

    die_with_parent()


def _say(record: dict) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _become_the_run(order: dict) -> int:
    """In the forked child: its own session, its files on fds 0-2, its environment, then
    `mecefo-train`'s main; the return value is the exit code (`sys.exit` in `__main__`)."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the orders pipe is the server's
    for fd, path in ((1, order["stdout"]), (2, order["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.chdir(order["cwd"])
    os.environ.clear()
    os.environ.update(order["env"])
    from megatron_mecefo import train

    sys.argv = [train.__file__, *order["args"]]
    return train.main(order["args"])


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
        pid = os.fork()
        if pid == 0:
            return _become_the_run(order)
        _say({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _say({"code": os.waitstatus_to_exitcode(status)})
    return 0


if __name__ == "__main__":
    sys.exit(serve())
