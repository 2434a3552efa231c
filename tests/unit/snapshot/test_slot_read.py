"""Reading a slot through a map: tensors copied once, into the caller's own tensors where they
fit; nothing copied before the header, CRC and identity are verified; a slot rewritten while
it is copied refused; the payload aligned; a slot written before the padding still read."""

from __future__ import annotations

import pickle

import pytest
import torch

from megatron_mecefo.errors import CheckpointError, SnapshotCorruptError
from megatron_mecefo.snapshot import slots
from megatron_mecefo.snapshot.slots import DIRTY, HEADER, SlotPair, plan_layout

from .test_slots import _equal, _state, _write

pytestmark = pytest.mark.timeout(60)


def _into() -> dict:
    """Targets for the model's two tensors: `w` fits, `b` has another dtype (so it must not be
    used), and one path the state does not hold."""
    return {
        ("model", "w"): torch.full((7, 5), 7.0),
        ("model", "b"): torch.full((3,), 7.0),
        ("model", "absent"): torch.full((2,), 7.0),
    }


def test_tensors_land_in_the_callers_tensors_where_they_fit(tmp_path):
    pair = SlotPair(tmp_path, 0)
    _write(pair, _state(4))
    into = _into()
    back = pair.read_at(4, into=into)
    assert _equal(back, _state(4))
    assert back["model"]["w"] is into[("model", "w")]  # filled in place
    assert back["model"]["b"] is not into[("model", "b")]  # bf16 in the slot, fp32 given
    assert torch.equal(into[("model", "b")], torch.full((3,), 7.0))
    assert torch.equal(into[("model", "absent")], torch.full((2,), 7.0))


def test_what_is_read_does_not_alias_the_slot(tmp_path):
    pair = SlotPair(tmp_path, 0)
    slot = _write(pair, _state(4))
    back = pair.read_at(4)
    slot.close()
    data = bytearray(slot.path.read_bytes())
    data[HEADER:] = bytes(len(data) - HEADER)  # the slot's memory reused for something else
    slot.path.write_bytes(data)
    assert _equal(back, _state(4))


@pytest.mark.parametrize("fault", ["crc", "identity"])
def test_nothing_is_copied_before_the_slot_is_verified(tmp_path, fault):
    pair = SlotPair(tmp_path, 0)
    slot = _write(pair, _state(4), meta={"run": "a"})
    slot.close()
    if fault == "crc":
        data = bytearray(slot.path.read_bytes())
        data[-1] ^= 1
        slot.path.write_bytes(data)
    into = _into()
    with pytest.raises(SnapshotCorruptError if fault == "crc" else CheckpointError):
        pair.read_at(4, into=into, check=lambda meta: None if meta == {"run": "b"} else "foreign")
    assert torch.equal(into[("model", "w")], torch.full((7, 5), 7.0))


def test_a_slot_rewritten_while_it_is_copied_is_refused(tmp_path, monkeypatch):
    pair = SlotPair(tmp_path, 0)
    slot = _write(pair, _state(4))
    copy_out = slots._copy_out

    def rewritten_meanwhile(*args):
        out = copy_out(*args)
        slot._mm[8] = DIRTY  # a writer begins: dirty before anything else changes
        return out

    monkeypatch.setattr(slots, "_copy_out", rewritten_meanwhile)
    with pytest.raises(SnapshotCorruptError, match="rewritten while it was read"):
        pair.read_at(4)


def test_the_payload_is_aligned_and_an_unpadded_slot_still_reads(tmp_path):
    skeleton, refs, tensors, payload = plan_layout(_state(4))
    assert (HEADER + len(skeleton)) % 64 == 0
    # a slot of the same format written before the padding: the payload right after the pickle
    raw = pickle.dumps(pickle.loads(skeleton))
    assert (HEADER + len(raw)) % 64 != 0
    pair = SlotPair(tmp_path, 0)
    slot = pair.target()
    slot.begin(4, raw, refs, payload)
    for ref, t in zip(refs, tensors):
        slot.copy_tensor(HEADER + len(raw) + ref.offset, t)
    slot.seal()
    assert _equal(pair.read_at(4, into=_into()), _state(4))
