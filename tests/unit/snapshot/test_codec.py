"""Erasure coding of node blobs: layout properties, exact rebuild after every loss pattern the code
tolerates, a clear error past it, and pinned small values (pure numpy + pyeclib, no network)."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from megatron_mecefo.errors import CheckpointError
from megatron_mecefo.snapshot import codec
from megatron_mecefo.snapshot.codec import (
    ParityError,
    ReedSolomonCode,
    StripeLayout,
    XorCode,
)

pytestmark = pytest.mark.timeout(120)

# Lengths chosen to hit: empty, 1 byte, fewer bytes than segments, unaligned tails, 8-aligned.
LENGTHS = [0, 1, 2, 7, 64, 1001, 4099]


def _blobs(n: int, seed: int) -> dict[int, bytes]:
    rng = np.random.default_rng(seed)
    lengths = rng.choice(LENGTHS, size=n)
    return {j: rng.integers(0, 256, int(lengths[j]), dtype=np.uint8).tobytes() for j in range(n)}


def _check_all_losses(layout: StripeLayout, code, blobs: dict[int, bytes]) -> None:
    n, m = layout.num_nodes, layout.num_parity
    held = codec.protect(layout, code, blobs)
    for num_lost in range(1, n + 1):
        for lost in itertools.combinations(range(n), num_lost):
            live = [j for j in range(n) if j not in lost]
            segments = {j: layout.split(blobs[j]) for j in live}
            parity = {j: held[j] for j in live}
            for node in lost:
                if num_lost <= m:
                    got = codec.rebuild(
                        layout, code, node, segments, parity, blob_length=len(blobs[node])
                    )
                    assert got == blobs[node], f"lost={lost} node={node}"
                elif len(blobs[node]) > 0 or num_lost == n:
                    # a non-empty blob (or a group with no survivor) cannot come back past m losses
                    with pytest.raises(
                        ParityError, match="more than m=.* nodes of the parity group are lost"
                    ):
                        codec.rebuild(layout, code, node, segments, parity)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_xor_rebuilds_every_single_loss_and_refuses_two(n):
    for seed in range(3):
        _check_all_losses(StripeLayout(n, 1), XorCode(), _blobs(n, seed + 10 * n))


@pytest.mark.parametrize("n", [3, 4, 5, 6])
def test_rs_m2_rebuilds_every_double_loss_and_refuses_three(n):
    for seed in range(2):
        _check_all_losses(StripeLayout(n, 2), ReedSolomonCode(2), _blobs(n, seed + 100 * n))


def test_rs_m1_matches_xor_semantics():
    layout = StripeLayout(3, 1)
    _check_all_losses(layout, ReedSolomonCode(1), _blobs(3, 7))


def test_more_losses_than_m_is_a_checkpoint_error_naming_the_cause():
    layout = StripeLayout(4, 1)
    blobs = {j: bytes([j + 1]) * 100 for j in range(4)}
    held = codec.protect(layout, XorCode(), blobs)
    live = [0, 3]
    with pytest.raises(CheckpointError, match="cannot rebuild node 1"):
        codec.rebuild(
            layout,
            XorCode(),
            1,
            {j: layout.split(blobs[j]) for j in live},
            {j: held[j] for j in live},
        )


@pytest.mark.parametrize("n,m", [(2, 1), (3, 1), (4, 1), (5, 2), (6, 3), (7, 2)])
def test_layout_every_node_data_in_n_minus_m_stripes_and_parity_spread_evenly(n, m):
    layout = StripeLayout(n, m)
    data_count = Counter(j for s in range(n) for j in layout.data_nodes(s))
    parity_count = Counter(j for s in range(n) for j in layout.parity_nodes(s))
    assert data_count == {j: n - m for j in range(n)}
    assert parity_count == {j: m for j in range(n)}
    for s in range(n):
        assert set(layout.data_nodes(s)) | set(layout.parity_nodes(s)) == set(range(n))
        assert not set(layout.data_nodes(s)) & set(layout.parity_nodes(s))
        assert list(layout.data_nodes(s)) == sorted(layout.data_nodes(s))
    for j in range(n):
        segs = layout.node_segments(j)
        assert len(segs) == n - m
        assert [s for s, _ in segs] == sorted(s for s, _ in segs)
        assert all(layout.data_nodes(s)[pos] == j for s, pos in segs)
        assert len(layout.parity_stripes(j)) == m


def test_layout_pinned_rotation_and_segments():
    layout = StripeLayout(4, 2)
    assert [layout.parity_nodes(s) for s in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert [layout.data_nodes(s) for s in range(4)] == [(2, 3), (0, 3), (0, 1), (1, 2)]
    assert layout.node_segments(0) == [(1, 0), (2, 0)]
    assert layout.node_segments(3) == [(0, 1), (1, 1)]
    assert layout.parity_stripes(0) == [(0, 0), (3, 1)]
    segs = layout.split(b"abcde")
    assert [bytes(s) for s in segs] == [b"abc", b"de"]
    assert [bytes(s) for s in StripeLayout(4, 1).split(b"a")] == [b"a", b"", b""]


@pytest.mark.parametrize("n,m", [(1, 1), (3, 0), (3, 3), (2, 5)])
def test_layout_rejects_bad_group(n, m):
    with pytest.raises(ValueError, match="num_parity < num_nodes"):
        StripeLayout(n, m)


def test_xor_parity_pinned_value_and_padding():
    (parity,) = XorCode().encode([b"\x0f\xf0\xaa", b"\xff\x00", b""])
    assert parity.tobytes() == b"\xf0\xf0\xaa"
    # unaligned views go through the byte path and agree with the 8-byte path
    raw = np.arange(1, 40, dtype=np.uint8)
    (aligned,) = XorCode().encode([raw[:16].copy(), raw[16:32].copy()])
    (unaligned,) = XorCode().encode([raw[:16], raw[1:17][:0], raw[16:32]])
    assert aligned.tobytes() == unaligned.tobytes() == (raw[:16] ^ raw[16:32]).tobytes()
    decoded = XorCode().decode({0: b"\x0f\xf0\xaa", 2: b"", 3: parity}, k=3, m=1, length=3)
    assert decoded[1].tobytes() == b"\xff\x00\x00"


def test_rs_parity_is_deterministic_and_differs_from_data():
    code = ReedSolomonCode(2)
    units = [b"hello world", b"parity!"]
    first = code.encode(units)
    assert len(first) == 2
    assert [p.tobytes() for p in first] == [p.tobytes() for p in code.encode(units)]
    decoded = code.decode({2: first[0], 3: first[1]}, k=2, m=2, length=11)
    assert [d.tobytes() for d in decoded] == [b"hello world", b"parity!\0\0\0\0"]


def test_rs_decode_rejects_too_few_units():
    code = ReedSolomonCode(2)
    parity = code.encode([b"a" * 10, b"b" * 10, b"c" * 10])
    with pytest.raises(ParityError, match="more than m=2"):
        code.decode({0: b"a" * 10, 3: parity[0]}, k=3, m=2, length=10)


def test_changed_blob_is_detected_not_mixed_into_parity():
    layout = StripeLayout(3, 1)
    blobs = {0: b"x" * 30, 1: b"y" * 30, 2: b"z" * 30}
    held = codec.protect(layout, XorCode(), blobs)
    segments = {0: layout.split(b"x" * 40), 2: layout.split(blobs[2])}
    with pytest.raises(ParityError, match="blob changed"):
        codec.rebuild(layout, XorCode(), 1, segments, {0: held[0], 2: held[2]})


def test_overheads_and_make_code():
    assert codec.memory_overhead(4, 1) == pytest.approx(1 / 3)
    assert codec.memory_overhead(6, 2) == pytest.approx(0.5)
    assert codec.replication_overhead(2) == 2.0
    rows = codec.overhead_table([4, 8], 1)
    assert rows[1]["parity_overhead"] == pytest.approx(1 / 7)
    assert rows[1]["saving"] == pytest.approx(7.0)
    assert isinstance(codec.make_code("xor", 1), XorCode)
    assert codec.make_code("rs", 3).num_parity == 3
    with pytest.raises(ValueError, match="num_parity=1"):
        codec.make_code("xor", 2)
    with pytest.raises(ValueError, match="unknown erasure code"):
        codec.make_code("raid", 1)


def test_encode_gbps_is_positive_on_a_small_buffer():
    assert codec.encode_gbps(XorCode(), 1 << 16, repeats=1) > 0
    assert codec.encode_gbps(ReedSolomonCode(2), 1 << 16, repeats=1) > 0
