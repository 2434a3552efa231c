"""NCCL failover on real GPUs (issue 18, item 2). Needs 2 GPUs; skipped without them.

1. A collective blocked on a peer that stopped participating (what a dead or hung replica looks
   like to a survivor) is unblocked by retiring the superseded group (`groups.retire_group`:
   ncclCommAbort), within a bound, and the survivor's GPU stream is usable at once: a new
   generation's group runs a collective and the device synchronises.
2. With the explicit watchdog policy (TORCH_NCCL_ASYNC_ERROR_HANDLING=2), a collective that
   outlives the group's timeout fails, but the process is not torn down.
3. The failover job itself: two ranks over NCCL (one per GPU) under mecefo-launch, one SIGKILLed
   mid-run; the survivor trains on, the rank rejoins and the replicas end bitwise identical.

    pytest -m gpu tests/gpu/test_nccl_groups_gpu.py
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import time
import traceback

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]


def _store(port: int, rank: int):
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
    )


def _worker(rank: int, port: int, scenario: str, results) -> None:
    try:
        import torch.distributed as dist

        from megatron_mecefo.failover.trainer import groups

        torch.cuda.set_device(rank)
        store = _store(port, rank)
        timeout = datetime.timedelta(seconds=10 if scenario == "watchdog" else 120)
        g1 = groups.new_nccl_group(dist.PrefixStore("gen1", store), rank, 2, timeout)
        x = torch.ones(1 << 20, device="cuda")
        g1.allreduce([x]).wait()
        torch.cuda.synchronize()
        assert x[0].item() == 2.0
        store.set(f"ready{rank}", "1")
        if rank == 1:  # stops taking part (a hung peer), stays alive until told
            store.wait(["done"], datetime.timedelta(seconds=300))
            results.put((rank, "ok", {}))
            return
        store.wait(["ready1"])
        work = g1.allreduce([x])  # peer never joins: blocks on the GPU
        time.sleep(2.0)
        out = {
            "completed_before": work.is_completed(),
            "env": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
        }
        if scenario == "watchdog":
            time.sleep(25.0)  # beyond the 10 s timeout: the watchdog aborts, we are alive
            out["completed_after_timeout"] = work.is_completed()
            try:
                work.wait()
                out["wait"] = "ok"
            except Exception as exc:  # noqa: BLE001 - expected: the collective timed out
                out["wait"] = type(exc).__name__
        else:
            graveyard: list = []
            t0 = time.monotonic()
            out["retired"] = groups.retire_group(g1, "nccl", graveyard, timeout_s=60)
            out["retire_s"] = time.monotonic() - t0
            g2 = groups.new_nccl_group(dist.PrefixStore("gen2", store), 0, 1, timeout)
            y = torch.full((4,), 3.0, device="cuda")
            g2.allreduce([y]).wait()
            t1 = time.monotonic()
            torch.cuda.synchronize()  # would hang behind the old kernel without the abort
            out["sync_s"] = time.monotonic() - t1
            out["y"] = y[0].item()
        store.set("done", "1")
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, "error", traceback.format_exc()))


def _run(scenario: str, timeout_s: float = 150) -> dict:
    from tests.helpers.dist import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, scenario, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < 2 and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=1.0)
            except Exception:  # noqa: BLE001 - queue.Empty
                continue
            assert status == "ok", f"rank {rank}:\n{payload}"
            got[rank] = payload
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    assert 0 in got, f"rank 0 reported nothing within {timeout_s} s (hung?)"
    return got[0]


@pytest.mark.timeout(240)
def test_retiring_a_blocked_nccl_group_frees_the_stream():
    out = _run("abort")
    assert out["completed_before"] is False  # really blocked on the absent peer
    assert out["retired"] is True and out["retire_s"] < 30, out
    assert out["y"] == 3.0 and out["sync_s"] < 10, out
    assert out["env"] == "2", out


@pytest.mark.timeout(240)
def test_watchdog_timeout_fails_the_collective_not_the_process():
    out = _run("watchdog")
    assert out["completed_before"] is False
    assert out["completed_after_timeout"] is True, out
    assert out["wait"] != "ok", out  # the timed-out collective reports an error


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_failover_job_over_nccl_survives_a_kill(tmp_path, demo_data_dir):
    from tests.helpers.launch import launch

    res = launch(
        tmp_path,
        demo_data_dir,
        nproc=2,
        steps=30,
        inject=("kill:1:8:4",),
        overrides=("parallel.backend=nccl", "mecefo.takeover_policy=spread"),
        timeout_s=540,
    )
    assert res.returncode == 0, res.explain()
    types = res.event_types()
    for kind in ("failure", "detection", "regroup", "rejoin"):
        assert kind in types, (kind, types)
    assert [m["step"] for m in res.metrics()] == list(range(30))
    digests = res.state_digests()
    assert sorted(digests) == [0, 1], digests
    assert len({(d["model"], d.get("optimizer")) for d in digests.values()}) == 1, digests
