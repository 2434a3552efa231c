"""Trainer processes that have paid for their imports (torch, megatron-core, the trainer) before
they are needed: a rank starts in a fraction of a second instead of 2-10 s (more on a busy node).

Two modes, both started by the node agent:
- `python -m megatron_mecefo.warm_spare`: a warm spare. It waits on stdin for one order (a JSON
  line {"env": {...}, "args": [...]}) and becomes that trainer. EOF = not needed.
- `python -m megatron_mecefo.warm_spare --serve PAD`: the fork server (`--start-method fork`, the
  default). It imports with one OpenMP thread, checks that forking is safe (one thread, no CUDA
  context, no process group), says
  so on its reply pipe, then forks one trainer per order line {"env", "args", "agent_pid",
  "deadline"}. Each trainer is forked through an intermediate process that exits at once, so it
  is re-parented to the agent (a child subreaper while it orders: `fork_server.py`, which also
  names the reply pipe, `REPLY_FD_ENV`), which then
  waits for it like any child. The trainer takes its own session, binds its life to the agent's,
  shows its own command line (`PAD`, spaces, is the room for it), replies {"pid"} and runs.
It lives beside `train.py`, whose `main` both become.
"""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__mp_main__":  # re-imported in a spawn child of the trainer this spare became
    from megatron_mecefo.control.proc import die_with_parent

    die_with_parent()  # megatron's spawned checkpoint-result queue must not outlive its trainer


def preload() -> None:
    """Import what a trainer imports, so that a spare or a fork pays nothing for it."""
    from megatron_mecefo.control.proc import quiet_library_warnings

    quiet_library_warnings(os.environ)
    import torch  # the point of a spare is to have paid for these imports

    import megatron_mecefo.failover.trainer.manager  # noqa: F401
    import megatron_mecefo.mcore.datasets  # noqa: F401
    import megatron_mecefo.session  # noqa: F401
    import megatron_mecefo.train  # noqa: F401
    import megatron_mecefo.training.engine  # noqa: F401
    import megatron_mecefo.training.loop  # noqa: F401
    from megatron_mecefo.mcore.model import preload_megatron

    preload_megatron()
    # the first optimizer imports torch's dynamo and inductor (`Optimizer.__init__`), no longer
    # imported with megatron (`mcore/eager_jit.py`): pay it here, not in every forked rank
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])


def fork_unsafe() -> str | None:
    """Why forking this process would be unsafe, or None: a thread other than this one (its
    locks would be copied held), a CUDA context, or a process group already set up."""
    import torch

    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        return f"{threads} threads are running"
    if torch.cuda.is_initialized():
        return "a CUDA context exists"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "a process group exists"
    return None


def _reply(fd: int, record: dict) -> None:
    os.write(fd, (json.dumps(record) + "\n").encode())  # one write under PIPE_BUF: atomic


def _run_trainer(order: dict) -> int:
    from megatron_mecefo.train import main as train_main

    os.environ.update(order["env"])
    return train_main(order["args"])


def _become_forked_trainer(order: dict, reply_fd: int, middle: int) -> int:
    """In the trainer forked by `serve`: wait to be re-parented to the agent, bind to it, reply,
    run. Exits without replying when the agent is not its parent or the order is stale (the
    agent stopped waiting for it and started the rank another way)."""
    from megatron_mecefo.control.proc import die_with_parent, set_cmdline

    os.setsid()
    limit = time.monotonic() + 10.0
    while os.getppid() == middle and time.monotonic() < limit:
        time.sleep(0.001)
    die_with_parent()
    if os.getppid() != order["agent_pid"] or time.time() > order["deadline"]:
        os._exit(70)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the orders pipe is the server's
    os.close(null)
    set_cmdline([sys.executable, "-m", "megatron_mecefo.train", *order["args"]])
    _reply(reply_fd, {"pid": os.getpid()})
    os.close(reply_fd)
    threads = order["env"].get("OMP_NUM_THREADS", "1")
    if threads != "1":  # the server imported with one (see `fork_server.ForkServer`)
        import torch

        torch.set_num_threads(int(threads))
    return _run_trainer(order)


def serve(reply_fd: int) -> int:
    """The fork server's loop: one forked trainer per order line on stdin, until EOF."""
    preload()
    why = fork_unsafe()
    if why is not None:
        _reply(reply_fd, {"ready": False, "why": why})
        return 1
    _reply(reply_fd, {"ready": True})
    for line in sys.stdin:
        if not line.strip():
            continue
        order = json.loads(line)
        middle = os.fork()
        if middle == 0:  # fork the trainer and exit, so that it is re-parented to the agent
            me = os.getpid()
            try:
                trainer = os.fork()
            except OSError:
                os._exit(71)
            if trainer != 0:
                os._exit(0)
            return _become_forked_trainer(order, reply_fd, me)
        os.waitpid(middle, 0)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        from megatron_mecefo.failover.node.fork_server import REPLY_FD_ENV

        return serve(int(os.environ[REPLY_FD_ENV]))
    preload()
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    return _run_trainer(json.loads(line))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
