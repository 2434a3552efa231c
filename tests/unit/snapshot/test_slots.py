"""Shared-memory slots: exact round trip, alternation that never overwrites the newest clean
snapshot, dirty and corrupt slots never read (the CRC covers the header's step and identity as
well as the body), a stale run's slots overwritten first, and the SMP's node blob round trip."""

from __future__ import annotations

import struct

import pytest
import torch

from megatron_mecefo.errors import CheckpointError, SnapshotCorruptError
from megatron_mecefo.snapshot import smp
from megatron_mecefo.snapshot.slots import CLEAN, DIRTY, HEADER, SlotPair, plan_layout
from megatron_mecefo.training.identity import StateIdentity

pytestmark = pytest.mark.timeout(60)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "next_step": seed,
        "model": {
            "w": torch.randn(7, 5, generator=g),
            "b": torch.randn(3, generator=g).to(torch.bfloat16),
            "extra": None,
        },
        "optimizer": {"state": {0: {"exp_avg": torch.randn(5, generator=g)}}, "lr": 0.1 * seed},
        "rng": [torch.randint(0, 255, (16,), dtype=torch.uint8, generator=g), (seed, "x")],
    }


def _write(pair: SlotPair, state: dict, *, seal: bool = True, meta: dict | None = None):
    skeleton, refs, tensors, payload = plan_layout(state)
    slot = pair.target(meta)
    slot.begin(state["next_step"], skeleton, refs, payload, meta)
    for ref, t in zip(refs, tensors):
        slot.copy_tensor(HEADER + len(skeleton) + ref.offset, t)
    if seal:
        slot.seal()
    return slot


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def test_round_trip_is_exact(tmp_path):
    pair = SlotPair(tmp_path, 3)
    _write(pair, _state(5))
    step, back = pair.newest()
    assert step == 5 and _equal(back, _state(5))


def test_slots_alternate_and_a_crash_mid_copy_keeps_the_last_clean_one(tmp_path):
    pair = SlotPair(tmp_path, 0)
    first = _write(pair, _state(1))
    second = _write(pair, _state(2))
    assert second is not first and sorted(pair.clean_steps()) == [1, 2]
    # the writer dies while copying step 3: it wrote into the older slot (step 1), not step 2's
    crashed = _write(pair, _state(3), seal=False)
    assert crashed is first and crashed.header().state == DIRTY
    assert sorted(pair.clean_steps()) == [2]
    step, back = SlotPair(tmp_path, 0).newest()
    assert step == 2 and _equal(back, _state(2))


def test_one_flipped_byte_is_detected_and_the_older_slot_used(tmp_path):
    pair = SlotPair(tmp_path, 0)
    _write(pair, _state(1))
    newest = _write(pair, _state(2))
    pair.close()
    raw = bytearray(newest.path.read_bytes())
    raw[HEADER + 200] ^= 0x01
    newest.path.write_bytes(raw)
    assert newest.header().state == CLEAN  # the header alone does not show it
    with pytest.raises(SnapshotCorruptError, match="CRC"):
        SlotPair(tmp_path, 0).read_at(2)
    skipped = []
    step, back = SlotPair(tmp_path, 0).newest(log=skipped.append)
    assert step == 1 and _equal(back, _state(1))
    assert len(skipped) == 1 and "CRC mismatch" in skipped[0]


def _patch(path, offset: int, fmt: str, value) -> None:
    raw = bytearray(path.read_bytes())
    struct.pack_into(fmt, raw, offset, value)
    path.write_bytes(raw)


def test_an_edited_header_step_fails_the_crc_and_the_older_slot_is_used(tmp_path):
    # issue 15: a header that claims step 40 for a step-2 state must not be believed
    pair = SlotPair(tmp_path, 0)
    _write(pair, _state(1))
    newest = _write(pair, _state(2))
    pair.close()
    _patch(newest.path, 20, "<q", 40)  # the step field only
    assert newest.header().state == CLEAN and newest.header().step == 40
    with pytest.raises(SnapshotCorruptError, match="CRC mismatch"):
        SlotPair(tmp_path, 0).read_at(40)
    skipped = []
    step, back = SlotPair(tmp_path, 0).newest(log=skipped.append)
    assert step == 1 and _equal(back, _state(1))
    assert skipped == [
        f"skipping snapshot of step 40: {newest.path.name}: CRC mismatch (corrupt snapshot)"
    ]


def test_an_edited_identity_fails_the_crc_and_a_foreign_one_fails_the_check(tmp_path):
    mine = StateIdentity("run-a", "cfg-a", ("line-a@0",))
    other = StateIdentity("run-b", "cfg-b", ("line-b@0",))
    slot = _write(SlotPair(tmp_path, 0), _state(3), meta=other.slot_meta())
    with pytest.raises(CheckpointError, match="snapshot of run run-b / config cfg-b") as err:
        SlotPair(tmp_path, 0).read_at(3, check=mine.snapshot_mismatch)
    assert not isinstance(err.value, SnapshotCorruptError)  # foreign, not corrupt
    assert "this run is run run-a / config cfg-a / lineage line-a@0: ignored" in str(err.value)
    assert SlotPair(tmp_path, 0).newest(check=mine.snapshot_mismatch) is None
    # rewrite "run-b" as "run-a" in the header: the CRC covers the meta, so it is refused
    raw = bytearray(slot.path.read_bytes())
    at = raw.index(b"run-b", 0, HEADER)
    raw[at : at + 5] = b"run-a"
    slot.path.write_bytes(raw)
    with pytest.raises(SnapshotCorruptError, match="CRC mismatch"):
        SlotPair(tmp_path, 0).read_at(3)


def test_a_stale_runs_slots_are_overwritten_first_and_never_read_as_ours(tmp_path):
    old, new = ({"run_id": r} for r in ("old", "new"))
    pair = SlotPair(tmp_path, 0)
    _write(pair, _state(22), meta=old)
    _write(pair, _state(23), meta=old)
    first = _write(pair, _state(1), meta=new)  # both slots stale: either may go
    second = _write(pair, _state(2), meta=new)
    assert second is not first  # the stale step-23 slot went before our own step 1
    third = _write(pair, _state(3), meta=new)
    assert third is first  # never our newest clean one
    assert {h.step: h.meta for h, _ in pair.clean()} == {3: new, 2: new}


def test_a_truncated_slot_is_never_read(tmp_path):
    pair = SlotPair(tmp_path, 0)
    slot = _write(pair, _state(4))
    pair.close()
    slot.path.write_bytes(slot.path.read_bytes()[: HEADER + 10])
    with pytest.raises(SnapshotCorruptError, match="truncated"):
        SlotPair(tmp_path, 0).read_at(4)


def test_node_blob_round_trip_restores_every_rank_bit_for_bit(tmp_path):
    src, dst = tmp_path / "node", tmp_path / "rebuilt"
    for rank, seed in ((4, 7), (5, 8)):
        _write(SlotPair(src, rank), _state(seed - 1))
        _write(SlotPair(src, rank), _state(seed))
    assert smp.newest_common_step(src, [4, 5]) == 7  # rank 4 holds {6, 7}, rank 5 {7, 8}
    _write(SlotPair(src, 4), _state(8))
    assert smp.newest_common_step(src, [4, 5]) == 8
    blob = smp.node_blob(src, [4, 5], 8)
    assert smp.node_blob(src, [4, 5], 6) is None  # no rank holds step 6 any more
    assert smp.restore_blob(dst, blob) == 8
    for rank in (4, 5):
        step, back = SlotPair(dst, rank).newest()
        assert step == 8 and _equal(back, _state(8))


def test_node_blob_refuses_a_corrupt_slot(tmp_path):
    slot = _write(SlotPair(tmp_path, 0), _state(3))
    raw = bytearray(slot.path.read_bytes())
    raw[-1] ^= 0xFF
    slot.path.write_bytes(raw)
    assert smp.node_blob(tmp_path, [0], 3) is None


@pytest.mark.parametrize(
    "nnodes,group,expected",
    [
        (4, 0, [[0, 1, 2, 3]]),
        (4, 2, [[0, 1], [2, 3]]),
        (5, 2, [[0, 1], [2, 3, 4]]),
        (3, 4, [[0, 1, 2]]),
    ],
)
def test_parity_groups(nnodes, group, expected):
    assert smp.parity_groups(nnodes, group) == expected
