"""Parity services of a simulated group (one thread-served TCP service per node on localhost,
free ports): publish, exact rebuild at the newest recoverable step, fallback on missing or corrupt
parity, a clear error past m losses, retention and restart of the parity store."""

from __future__ import annotations

import socket
import struct
import time

import numpy as np
import pytest

from megatron_mecefo.snapshot import parity
from megatron_mecefo.snapshot.codec import ParityError, ReedSolomonCode, StripeLayout, XorCode
from megatron_mecefo.snapshot.parity import ParityService

pytestmark = pytest.mark.timeout(60)


class Group:
    """n services, per-node blobs by step, and a mutable live-peer table."""

    def __init__(self, tmp_path, n, code, timeout_s=2.0):
        self.layout = StripeLayout(n, code.num_parity)
        self.code = code
        self.tmp_path = tmp_path
        self.timeout_s = timeout_s
        self.blobs: dict[int, dict[int, bytes]] = {j: {} for j in range(n)}
        self.live: dict[int, str] = {}
        self.logs: list[str] = []
        self.services = {j: self.spawn(j) for j in range(n)}

    def spawn(self, node, store="store", blob_at=None):
        svc = ParityService(
            node,
            self.layout,
            self.code,
            self.tmp_path / f"{store}{node}",
            peers=lambda: dict(self.live),
            blob_at=blob_at or (lambda step, j=node: self._blob(j, step)),
            log=self.logs.append,
            timeout_s=self.timeout_s,
        )
        svc.start()
        self.live[node] = svc.address
        return svc

    def _blob(self, node, step):
        data = self.blobs[node].get(step)
        return None if data is None else memoryview(data)

    def publish(self, step, nodes=None):
        nodes = self.services if nodes is None else nodes
        for j in nodes:
            rng = np.random.default_rng(1000 * step + j)
            self.blobs[j][step] = rng.integers(0, 256, 5000 + 333 * j, dtype=np.uint8).tobytes()
            self.services[j].publish(step, memoryview(self.blobs[j][step]))
        for j in nodes:
            assert self.services[j].flush(timeout_s=10)

    def lose(self, node):
        """The node disappears: its service stops and its blobs are gone."""
        self.services.pop(node).close()
        self.live.pop(node, None)
        self.blobs[node] = {}

    def close(self):
        for svc in self.services.values():
            svc.close()


@pytest.fixture
def xor3(tmp_path):
    group = Group(tmp_path, 3, XorCode())
    yield group
    group.close()


def _parity_file(group, holder, step, stripe):
    return group.tmp_path / f"store{holder}" / parity.parity_file_name(step, stripe)


def test_rebuild_lost_node_at_newest_step_from_peer_and_replacement(xor3):
    xor3.publish(1)
    xor3.publish(2)
    assert [xor3.services[j].parity_step() for j in range(3)] == [2, 2, 2]
    expected = xor3.blobs[1][2]
    xor3.lose(1)
    assert xor3.services[0].rebuild(lost_node=1) == (2, expected)
    # a replacement node 1 with an empty store rebuilds its own blob
    replacement = xor3.spawn(1, store="fresh", blob_at=lambda step: None)
    try:
        assert replacement.rebuild() == (2, expected)
        assert replacement.rebuild(step=1)[0] == 1
    finally:
        replacement.close()


def test_rebuild_falls_back_to_previous_step_when_node_never_published_newest(xor3):
    xor3.publish(1)
    xor3.publish(2, nodes=[0, 2])
    # node 1 is data in stripes 0 and 2, held by nodes 0 and 2: their step 2 stays incomplete
    assert xor3.services[0].parity_step() == 1
    assert xor3.services[1].parity_step() == 2
    expected = xor3.blobs[1][1]
    xor3.lose(1)
    assert xor3.services[2].rebuild(lost_node=1) == (1, expected)


def test_corrupt_parity_byte_is_detected_and_older_step_used(xor3):
    xor3.publish(1)
    xor3.publish(2)
    expected_step1 = xor3.blobs[1][1]
    path = _parity_file(xor3, holder=0, step=2, stripe=0)  # node 1 is data in stripe 0
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(ParityError, match="CRC32 mismatch"):
        parity.read_parity_file(path)
    xor3.lose(1)
    assert xor3.services[2].rebuild(lost_node=1) == (1, expected_step1)
    assert any("corrupt" in line and "step000000000002" in line for line in xor3.logs)
    # with the older step corrupt too there is no valid source: a clear error, never bad bytes
    old = _parity_file(xor3, holder=0, step=1, stripe=0)
    old.write_bytes(old.read_bytes()[:-1])
    with pytest.raises(ParityError, match="cannot rebuild node 1 from parity.*step 2.*step 1"):
        xor3.services[2].rebuild(lost_node=1)


def test_too_many_nodes_lost_is_a_clear_error_within_the_timeout(tmp_path):
    group = Group(tmp_path, 3, XorCode(), timeout_s=0.5)
    try:
        group.publish(1)
        dead_address = group.live[2]
        group.lose(1)
        group.lose(2)
        group.live[2] = dead_address  # still listed, but nobody answers
        start = time.monotonic()
        with pytest.raises(ParityError, match="cannot rebuild node 1 from parity"):
            group.services[0].rebuild(lost_node=1, step=1)
        assert time.monotonic() - start < 5
        assert any("unreachable" in line for line in group.logs)
    finally:
        group.close()


def test_rs_group_rebuilds_two_lost_nodes(tmp_path):
    group = Group(tmp_path, 4, ReedSolomonCode(2))
    try:
        group.publish(3)
        expected = {j: group.blobs[j][3] for j in (1, 3)}
        group.lose(1)
        group.lose(3)
        assert group.services[0].rebuild(lost_node=1) == (3, expected[1])
        assert group.services[2].rebuild(lost_node=3) == (3, expected[3])
        group.lose(2)
        with pytest.raises(ParityError, match="more than m=2"):
            group.services[0].rebuild(lost_node=1)
    finally:
        group.close()


def test_store_keeps_two_newest_steps_and_survives_restart(xor3):
    for step in (1, 2, 3):
        xor3.publish(step)
    store = xor3.tmp_path / "store0"
    assert sorted(p.name for p in store.iterdir()) == [
        parity.parity_file_name(2, 0),
        parity.parity_file_name(3, 0),
    ]
    (store / ".leftover.parity.tmp1.2").write_bytes(b"half")
    xor3.services.pop(0).close()
    restarted = xor3.spawn(0)
    xor3.services[0] = restarted
    assert restarted.parity_steps() == [2, 3]
    assert not (store / ".leftover.parity.tmp1.2").exists()
    expected = xor3.blobs[1][3]
    xor3.lose(1)
    assert restarted.rebuild(lost_node=1) == (3, expected)


def test_garbage_request_is_dropped_and_service_keeps_answering(xor3):
    xor3.publish(1)
    host, _, port = xor3.services[0].address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=2) as sock:
        sock.sendall(struct.pack("!I", 1 << 30))  # header longer than allowed
        assert sock.recv(1) == b""
    expected = xor3.blobs[2][1]
    xor3.lose(2)
    assert xor3.services[1].rebuild(lost_node=2) == (1, expected)
