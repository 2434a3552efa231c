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


def test_a_long_tmpdir_does_not_break_the_async_checkpoint_queue(tmp_path, monkeypatch):
    """megatron's async-save result queue is a multiprocessing Manager whose socket lives in
    the temporary directory: under a long $TMPDIR every async save failed ("AF_UNIX path too
    long"). The queue now starts under /tmp then, and works."""
    import tempfile

    from megatron_mecefo.mcore import checkpointing

    long_dir = tmp_path / ("x" * 80)
    long_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_dir))
    monkeypatch.setenv("TMPDIR", str(long_dir))  # what the spawned Manager reads
    assert checkpointing.use_short_socket_dir() == "/tmp"
    from multiprocessing import get_context

    manager = get_context("spawn").Manager()  # what megatron starts; fails on the long path
    try:
        manager.Queue().put(1)
    finally:
        manager.shutdown()
