"""The checkpoint-restart trainer of the peers benchmark (`peers.py`): `mecefo-train` under plain
`torchrun --max-restarts N` (StaticRun: it resumes from the newest checkpoint by itself), plus a
loop hook that SIGKILLs one rank at the start of each scheduled step, once (a marker file in
`PEERS_KILL_DIR`; the product's `--inject` needs failover). A restarted incarnation stays down
until the kill's time plus `PEERS_DOWN_S`, as the other systems' replicas do. At
`PEERS_GROUP_KILL` the same rank writes `PEERS_GROUP_MARKER` and waits: the benchmark then kills
the whole torchrun and launches it again (`peers_group.hold_for_kill`).

The trainer makes its default group on a store prefix per torchrun attempt itself
(`mcore.parallel.restart_safe_store`).

    torchrun ... tools/bench/peers_restart.py MECEFO-TRAIN-ARGS   (env: PEERS_KILLS=3,6,9
    PEERS_KILL_RANK=1 PEERS_KILL_DIR=DIR PEERS_DOWN_S=2 PEERS_GROUP_KILL=11 PEERS_GROUP_MARKER=F)
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from peers_group import hold_for_kill

from megatron_mecefo.training.hooks import TrainHook


class KillHook(TrainHook):
    """`before_step`: SIGKILL this rank at a scheduled step, once per job; at the group-kill
    step (once) wait for the benchmark to kill the whole job."""

    def __init__(self, steps: set[int], kill_dir: Path, group_step: int | None, group: Path):
        self.steps = steps
        self.kill_dir = kill_dir
        self.group_step = group_step
        self.group = group

    def before_step(self, engine, step: int) -> None:
        marker = self.kill_dir / f"s{step}"
        if step in self.steps and not marker.exists():
            marker.write_text(str(time.time()))
            print(f"[peers] checkpoint-restart: kill at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.group_step and not self.group.exists():
            hold_for_kill(self.group, f"checkpoint-restart step {step}")


def main() -> int:
    kill_dir = Path(os.environ["PEERS_KILL_DIR"])
    kill_dir.mkdir(parents=True, exist_ok=True)
    stamps = [float(f.read_text()) for f in kill_dir.glob("s*") if f.read_text()]
    if stamps and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        time.sleep(max(0.0, max(stamps) + float(os.environ["PEERS_DOWN_S"]) - time.time()))
    from megatron_mecefo import session, train

    if os.environ.get("RANK") == os.environ["PEERS_KILL_RANK"]:
        steps = {int(s) for s in os.environ["PEERS_KILLS"].split(",") if s}
        group = os.environ.get("PEERS_GROUP_KILL")
        hook = KillHook(
            steps, kill_dir, int(group) if group else None, Path(os.environ["PEERS_GROUP_MARKER"])
        )
        run_session = session.run_session

        def with_kill(cfg, control, hooks=()):
            return run_session(cfg, control, [*hooks, hook])

        session.run_session = with_kill
    return train.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
