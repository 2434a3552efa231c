"""The etcd store against a real 3-member etcd cluster on this machine.

- Every store call the control plane makes answers as torch's TCPStore answers (the same sequence
  run on both).
- `add` from four clients at once loses no increment (read, then a transaction on the revision).
- A gloo group forms on a `PrefixStore` of it (the per-generation rendezvous).
- The leader SIGKILLed: the next call goes through; two of three SIGKILLed: a call fails within
  its bound with `EtcdUnavailable`, naming the endpoints.
- Election: one leader at a time; a candidate SIGSTOPped past its lease loses it to the other and,
  resumed, stands down; a stale coordinator's generation is refused (`Fenced`).
"""

from __future__ import annotations

import datetime
import gc
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_mecefo.control import keys
from megatron_mecefo.control.etcd_store import EtcdStore, EtcdUnavailable, address
from megatron_mecefo.control.records import Fenced, GenerationRecord, publish_generation
from tests.helpers.dist import free_port
from tests.helpers.etcd import cluster, needs_etcd  # noqa: F401 - a fixture
from tests.helpers.no_torch import client_without_torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]


def _store(cluster, job="t", timeout_s=5.0) -> EtcdStore:
    return EtcdStore(address(cluster.endpoints, job), timeout_s)


def _sequence(store) -> list:
    """Every call the control plane makes, with each answer."""
    out = []
    store.set("a", "1")
    out.append(store.get("a"))
    out.append(store.check(["a"]))
    out.append(store.check(["a", "b"]))
    out.append(store.add("n", 3))
    out.append(store.add("n", -1))
    out.append(store.add("fresh", 0))
    store.append("log", "x,")
    store.append("log", "y,")
    out.append(store.get("log"))
    out.append(store.compare_set("c", "", "v1"))  # absent, expected empty: set
    out.append(store.compare_set("c", "zz", "v2"))  # present, no match: the current value
    out.append(store.compare_set("c", "v1", "v2"))  # match: set
    out.append(store.compare_set("gone", "e", "d"))  # absent, expected not empty: expected back
    out.append(store.check(["gone"]))
    store.set("empty", "")
    out.append(store.check(["empty"]))
    out.append(store.multi_get(["a", "n", "c", "empty"]))
    many = [f"node/{i}" for i in range(300)]  # more than one etcd transaction may hold
    for i, key in enumerate(many):
        store.set(key, str(i))
    out.append(store.multi_get(many))
    out.append(store.delete_key("a"))
    out.append(store.delete_key("a"))
    out.append(store.check(["a"]))
    with pytest.raises(RuntimeError) as timed_out:  # torch's DistStoreError, or our StoreError
        store.wait(["never"], datetime.timedelta(seconds=0.3))
    assert keys.is_store_error(timed_out.value)
    return out


@needs_etcd
def test_answers_as_a_tcpstore_does(cluster):
    tcp = dist.TCPStore(
        "127.0.0.1", free_port(), is_master=True, wait_for_workers=False, use_libuv=True
    )
    expected = _sequence(tcp)
    assert _sequence(_store(cluster)) == expected
    # keys of another job are not seen
    assert not _store(cluster, job="other").check(["n"])


@needs_etcd
def test_an_add_whose_answer_was_lost_counts_once(cluster):
    """The member applies the transaction but its answer never arrives (a connection reset):
    the client resends it to the next member, which must not add again."""
    from etcd3gw import exceptions as ex

    store = _store(cluster, job="lost-answer")
    store.add("votes", 5)
    lost = []
    for client in store.client._clients:
        real = client.post

        def post(url, json=None, _real=real, **kw):
            answer = _real(url, json=json, **kw)
            if url.endswith("/kv/txn") and not lost:
                lost.append(url)
                raise ex.ConnectionFailedError("connection reset (test)")
            return answer

        client.post = post
    assert store.add("votes", 1) == 6
    assert lost and int(store.get("votes")) == 6  # not 7
    store.append("log", "a,")
    assert store.get("log") == b"a,"
    assert store.num_keys() == 2  # the marks live outside the job's keys


@needs_etcd
def test_a_lease_key_goes_when_its_lease_expires(cluster):
    """What the coordinator reads of node leases (`keys_with_prefix`): present while renewed,
    gone after the TTL without renewal, with no one deleting it."""
    store = _store(cluster, job="leases")
    held, dropped = store.grant(10), store.grant(2)  # held: renewed, with room for a slow box
    store.put("agents/alive/4", "t", lease=held)
    store.put("agents/alive/5", "t", lease=dropped)
    store.set("agents/alivex", "not under the prefix")
    assert sorted(store.keys_with_prefix("agents/alive/")) == ["4", "5"]
    deadline = time.monotonic() + 6
    while "5" in store.keys_with_prefix("agents/alive/"):
        assert time.monotonic() < deadline, "the expired lease's key stayed"
        assert store.keepalive(held) > 0
        time.sleep(0.3)
    assert store.keys_with_prefix("agents/alive/") == ["4"]


@needs_etcd
def test_concurrent_adds_lose_nothing(cluster):
    seen: list[int] = []
    lock = threading.Lock()

    def adder():
        store = _store(cluster)
        for _ in range(40):
            value = store.add("ctr", 1)
            with lock:
                seen.append(value)

    threads = [threading.Thread(target=adder) for _ in range(4)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert sorted(seen) == list(range(1, 161))  # every increment, each value handed out once


def _gloo_rank(rank: int, addr: str, queue) -> None:
    client = keys.connect(addr, 20.0, torch_client=True)  # as the trainers build it
    store = dist.PrefixStore("gen/7/tp0", client)
    gc.collect()  # only the C++ half of the client is referenced now
    pg = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=20))
    x = torch.full((3,), float(rank + 1))
    pg.allreduce([x]).wait()
    queue.put(x.tolist())


@needs_etcd
def test_gloo_group_forms_on_a_prefix_of_it(cluster):
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    addr = address(cluster.endpoints, "g")
    procs = [ctx.Process(target=_gloo_rank, args=(r, addr, queue)) for r in range(2)]
    [p.start() for p in procs]
    results = [queue.get(timeout=60) for _ in procs]
    [p.join(30) for p in procs]
    assert results == [[3.0, 3.0, 3.0]] * 2


@needs_etcd
def test_the_control_plane_s_client_does_not_import_torch(cluster):
    addr = address(cluster.endpoints, "plain")
    kind = client_without_torch(addr, "s.set('k', 'v'); s.add('n', 2)")
    assert kind == "EtcdStore"
    ranks = keys.connect(addr, 5.0)  # a process with torch: a c10d store, the same keys
    assert isinstance(ranks, dist.Store) and ranks.multi_get(["k", "n"]) == [b"v", b"2"]


@needs_etcd
def test_leader_loss_is_survived_and_quorum_loss_fails_within_bound(cluster):
    store = _store(cluster, timeout_s=4.0)
    store.set("k", "1")
    cluster.kill(cluster.leader())
    store.set("k", "2")  # a new leader is elected (~1 s); the call waits for it within its bound
    assert store.get("k") == b"2"
    alive = [i for i, p in enumerate(cluster.procs) if p.poll() is None]
    cluster.kill(alive[0])
    t0 = time.monotonic()
    with pytest.raises(EtcdUnavailable, match="quorum lost") as err:
        store.set("k", "3")
    took = time.monotonic() - t0
    assert 4.0 <= took < 4.0 + 2 * 2.5, took  # the bound, plus at most the last request
    assert all(ep in str(err.value) for ep in cluster.endpoints)


@needs_etcd
def test_a_stale_coordinator_publishes_nothing(cluster):
    store = _store(cluster)
    first = store.add(keys.COORD_EPOCH, 1)
    keys.control_keys(store)
    record = GenerationRecord(members=[0, 1], removed=[], added=[0, 1], reason="start")
    publish_generation(store, 1, record, epoch=first)
    assert keys.get_int(store, keys.GEN) == 1
    store.add(keys.COORD_EPOCH, 1)  # a newer coordinator restored (it bumps the epoch)
    with pytest.raises(Fenced):
        publish_generation(store, 2, record, epoch=first)
    assert keys.get_int(store, keys.GEN) == 1 and not store.check([keys.gen_record(2)])
    # and a coordinator that read an old generation cannot overwrite a newer one
    publish_generation(store, 2, record, epoch=first + 1)
    with pytest.raises(Fenced):
        publish_generation(store, 2, record, epoch=first + 1)


def _candidate(addr: str, name: str, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "megatron_mecefo.failover.authority.coordinator_cli",
        "--store",
        addr,
        "--world-size",
        "2",
        "--elect",
        name,
        "--lease-ttl-s",
        "2",
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _wait_for(path: Path, pattern: str, limit_s: float = 30.0) -> float:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if path.exists() and re.search(pattern, path.read_text()):
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"{pattern!r} not in {path.name} after {limit_s} s:\n{path.read_text()}")


@needs_etcd
def test_election_one_leader_and_a_paused_one_stands_down(cluster, tmp_path):
    addr = address(cluster.endpoints, "e")
    store = EtcdStore(addr, 5.0)
    a = _candidate(addr, "A", tmp_path / "a.log")
    b = None
    try:
        _wait_for(tmp_path / "a.log", "candidate A elected")
        b = _candidate(addr, "B", tmp_path / "b.log")
        _wait_for(tmp_path / "b.log", "A leads; standing by")
        assert store.get(keys.COORD_LEADER) == b"A"
        os.kill(a.pid, signal.SIGSTOP)
        paused = time.monotonic()
        elected = _wait_for(tmp_path / "b.log", "candidate B elected")
        assert elected - paused < 2 + 0.5 + 2.5, elected - paused  # TTL + a poll + slack
        assert store.get(keys.COORD_LEADER) == b"B"
        os.kill(a.pid, signal.SIGCONT)
        _wait_for(tmp_path / "a.log", "candidate A lost the leadership")
        assert a.wait(10) == 7  # REJOIN: its agent starts a new candidate
        assert store.get(keys.COORD_LEADER) == b"B"
        assert "generation" not in (tmp_path / "a.log").read_text().split("lost the leadership")[1]
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
