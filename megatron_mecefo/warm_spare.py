"""A warm spare trainer process: imports torch, megatron-core and the trainer, then waits on
stdin for the agent to assign it a rank (one JSON line: {"env": {...}, "args": [...]}).

Replacing a dead rank with a warm spare saves the interpreter start and imports (about 10 s on a
busy CPU node), so a restarted rank can rejoin within a few steps. EOF on stdin = not needed.
The node agent starts it as `python -m megatron_mecefo.warm_spare` (it lives beside `train.py`,
whose `main` it becomes).
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__mp_main__":  # re-imported in a spawn child of the trainer this spare became
    from megatron_mecefo.control.proc import die_with_parent

    die_with_parent()  # megatron's spawned checkpoint-result queue must not outlive its trainer


def main() -> int:
    from megatron_mecefo.control.proc import quiet_library_warnings

    quiet_library_warnings(os.environ)
    import torch  # noqa: F401 - the point of a spare is to have paid for these imports

    import megatron_mecefo.failover.trainer.manager  # noqa: F401
    import megatron_mecefo.session  # noqa: F401
    import megatron_mecefo.training.engine  # noqa: F401
    from megatron_mecefo.mcore.model import preload_megatron

    preload_megatron()

    line = sys.stdin.readline()
    if not line.strip():
        return 0
    order = json.loads(line)
    os.environ.update(order["env"])
    from megatron_mecefo.train import main as train_main

    return train_main(order["args"])


if __name__ == "__main__":
    sys.exit(main())
