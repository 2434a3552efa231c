"""The default group's store under `torchrun --max-restarts` (`mcore.parallel.restart_safe_store`):
each restart attempt rendezvouses under its own prefix of the agent's store, so a restarted
attempt never reads its predecessor's dead addresses; other launchers keep env:// as is."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from megatron_mecefo.mcore.parallel import restart_safe_store


def test_each_torchrun_attempt_gets_its_own_prefix():
    agent = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )
    env = {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(agent.port),
        "TORCHELASTIC_RESTART_COUNT": "2",
    }
    restart_safe_store(env).set("rank0", "addr")
    assert agent.check(["/mecefo/attempt_2/rank0"]) and not agent.check(["rank0"])
    env["TORCHELASTIC_RESTART_COUNT"] = "3"
    assert not restart_safe_store(env).check(["rank0"])  # the next attempt starts clean
    assert restart_safe_store({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}) is None
