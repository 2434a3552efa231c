"""The plain-Python store client (`control/tcp_client.py`) against torch's real TCPStore server,
beside torch's own client on the same keys: every call the control plane makes, its errors, and
that the processes using it never import torch."""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from megatron_mecefo.control import keys
from megatron_mecefo.control.tcp_client import StoreError, StoreTimeout, TcpStoreClient
from tests.helpers.dist import free_port
from tests.helpers.no_torch import client_without_torch

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True,
        timeout=datetime.timedelta(seconds=5),
    )  # fmt: skip
    yield store


def _torch_client(port: int) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", port, is_master=False, wait_for_workers=False, use_libuv=True,
        timeout=datetime.timedelta(seconds=5),
    )  # fmt: skip


def test_every_call_agrees_with_torch_s_client(server):
    ours = TcpStoreClient("127.0.0.1", server.port, 5.0)
    theirs = _torch_client(server.port)
    ours.set("a", "1")
    theirs.set("b", b"\x00\xff")
    assert theirs.get("a") == b"1" and ours.get("b") == b"\x00\xff"
    assert ours.add("n", 5) == 5 and theirs.add("n", 2) == 7 and ours.add("n", -10) == -3
    assert ours.get("n") == b"-3"
    # compare_set: swap on a match, the current value on a mismatch, create when absent
    assert ours.compare_set("a", "1", "2") == b"2"
    assert ours.compare_set("a", "1", "3") == b"2"
    assert ours.compare_set("fresh", "", "x") == b"x" and theirs.get("fresh") == b"x"
    ours.append("a", ";z")  # no reply: a round trip on the same connection orders it
    assert ours.get("a") == b"2;z"
    theirs.append("a", ";y")
    assert ours.get("a") == b"2;z;y"
    ours.multi_set(["m1", "m2"], ["v1", b"v2"])
    assert theirs.multi_get(["m1", "m2"]) == ours.multi_get(["m2", "m1"])[::-1] == [b"v1", b"v2"]
    assert ours.check(["a", "m1"]) and not ours.check(["a", "never"])
    assert ours.num_keys() == theirs.num_keys()
    before = ours.num_keys()
    assert ours.delete_key("m1") and not ours.delete_key("m1")
    assert ours.num_keys() == before - 1 and not theirs.check(["m1"])


def test_a_multi_get_of_thousands_of_keys_reads_as_torch_s(server):
    """Replies read in large chunks (the coordinator reads every rank's heartbeat at once)."""
    ours = TcpStoreClient("127.0.0.1", server.port, 5.0)
    theirs = _torch_client(server.port)
    names = [f"hb/{i}" for i in range(5000)]
    theirs.multi_set(names, [b"x" * (i % 97) + str(i).encode() for i in range(5000)])
    assert ours.multi_get(names) == theirs.multi_get(names)
    assert ours.add("after", 3) == 3  # nothing left over in the stream


def test_wait_times_out_then_the_client_still_works(server):
    ours = TcpStoreClient("127.0.0.1", server.port, 5.0)
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout):
        ours.wait(["absent"], datetime.timedelta(seconds=0.3))
    assert 0.25 < time.monotonic() - t0 < 2.0
    with pytest.raises(StoreTimeout):  # a get waits for its key, up to the client's timeout
        ours.set_timeout(datetime.timedelta(seconds=0.2))
        ours.get("absent")
    ours.set("k", "v")  # the cancelled waits left nothing behind on the connection
    assert ours.get("k") == b"v" and ours.add("c", 1) == 1


def test_wait_and_get_wake_when_another_client_sets_the_key(server):
    ours = TcpStoreClient("127.0.0.1", server.port, 5.0)
    theirs = _torch_client(server.port)
    threading.Timer(0.3, lambda: theirs.set("late", "here")).start()
    t0 = time.monotonic()
    assert ours.get("late") == b"here"
    assert 0.2 < time.monotonic() - t0 < 3.0
    threading.Timer(0.2, lambda: theirs.add("late2", 1)).start()
    ours.wait(["late", "late2"], datetime.timedelta(seconds=5))


def test_connect_waits_for_a_server_that_comes_up_late():
    port = free_port()
    holder = {}
    threading.Timer(
        0.5,
        lambda: holder.setdefault(
            "s",
            dist.TCPStore(
                "127.0.0.1", port, is_master=True, wait_for_workers=False, use_libuv=True
            ),
        ),
    ).start()
    ours = TcpStoreClient("127.0.0.1", port, 10.0)
    ours.set("x", "1")
    assert holder["s"].get("x") == b"1"


def test_errors_are_store_errors_not_socket_errors():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="cannot reach the store"):
        TcpStoreClient("127.0.0.1", port, 0.5)
    assert time.monotonic() - t0 < 3.0
    # a server that is not a TCPStore: the ping is not echoed
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()

    def answer_garbage():
        conn, _ = lsock.accept()
        conn.recv(64)
        conn.sendall(b"HTTP")
        time.sleep(0.5)
        conn.close()

    threading.Thread(target=answer_garbage, daemon=True).start()
    with pytest.raises(StoreError, match="not a torch TCPStore"):
        TcpStoreClient("127.0.0.1", lsock.getsockname()[1], 2.0)
    assert keys.is_store_error(StoreTimeout("x")) and keys.is_store_error(dist.DistStoreError("x"))
    assert not keys.is_store_error(ValueError("x"))


def test_a_store_that_dies_is_a_store_error():
    proc = subprocess.Popen(
        [sys.executable, "-c", (
            "import torch.distributed as d, sys, time;"
            "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False);"
            "print(s.port, flush=True); time.sleep(60)"
        )],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        port = int(proc.stdout.readline())
        ours = TcpStoreClient("127.0.0.1", port, 5.0)
        ours.set("a", "1")
        proc.kill()
        proc.wait()
        with pytest.raises(StoreError):
            for _ in range(3):  # a send may still land in the socket buffer once
                ours.add("a", 1)
    finally:
        proc.kill()


def test_the_agent_coordinator_and_snapshot_process_connect_without_torch(server):
    imports = (
        "megatron_mecefo.failover.node.agent_cli",
        "megatron_mecefo.failover.authority.coordinator_cli",
        "megatron_mecefo.snapshot.smp",
        "megatron_mecefo.snapshot.parity",
        "megatron_mecefo.snapshot.paths",
    )
    kind = client_without_torch(
        f"127.0.0.1:{server.port}", "s.set('from_child', 'ok')", imports, timeout_s=30
    )
    assert kind == "TcpStoreClient"
    assert server.get("from_child") == b"ok"
    # in a process that has torch (a rank), torch's client: it is handed to init_process_group
    assert isinstance(keys.connect(f"127.0.0.1:{server.port}", 5.0), dist.TCPStore)
    plain = keys.connect(f"127.0.0.1:{server.port}", 5.0, torch_client=False)
    assert isinstance(plain, TcpStoreClient)
