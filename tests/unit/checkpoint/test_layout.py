"""The checkpoint folder protocol: commit marker written last with a checksum of its own content
(identity and step included), file checksums, retention of the current line only (pure file
operations, no megatron)."""

from __future__ import annotations

import json

import pytest

from megatron_mecefo.checkpoint import layout
from megatron_mecefo.errors import CheckpointError
from megatron_mecefo.training.identity import StateIdentity

pytestmark = pytest.mark.timeout(60)
RUN = StateIdentity("run-a", "cfg-a", ("line1@0",))


def _ckpt(root, step, commit=True, payload=b"weights", identity=RUN):
    folder = layout.step_dir(root, step)
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(payload * 100)
    (folder / "common.pt").write_bytes(b"common")
    if commit:
        layout.write_marker(folder, step, {"tp": 1}, identity=identity.to_dict())
    return folder


def test_valid_checkpoint_round_trip(tmp_path):
    folder = _ckpt(tmp_path, 6)
    marker = layout.validate(folder)
    assert marker["next_step"] == 6 and marker["tp"] == 1
    assert marker["identity"]["lineage"] == ["line1@0"]
    assert set(marker["files"]) == {"__0_0.distcp", "common.pt"}


def test_uncommitted_and_missing_are_told_apart(tmp_path):
    with pytest.raises(CheckpointError, match="never completed"):
        layout.validate(_ckpt(tmp_path, 6, commit=False))
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        layout.validate(tmp_path / "step_00000099")


def test_one_flipped_byte_is_detected(tmp_path):
    folder = _ckpt(tmp_path, 6)
    data = bytearray((folder / "__0_0.distcp").read_bytes())
    data[123] ^= 0x01
    (folder / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="__0_0.distcp fails its checksum"):
        layout.validate(folder)


def test_missing_file_is_detected(tmp_path):
    folder = _ckpt(tmp_path, 6)
    (folder / "common.pt").unlink()
    with pytest.raises(CheckpointError, match="common.pt is missing"):
        layout.validate(folder)


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.update(next_step=40),  # claims another step
        lambda m: m["identity"].update(run_id="run-b"),  # claims another run
        lambda m: m["identity"]["lineage"].append("x@3"),  # claims another line
    ],
)
def test_the_marker_checksum_covers_its_step_and_identity(tmp_path, edit):
    folder = _ckpt(tmp_path, 6)
    marker = json.loads((folder / layout.MARKER).read_text())
    edit(marker)
    (folder / layout.MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match="fails its own checksum"):
        layout.load_marker(folder)
    assert layout.read_marker(folder) is None


def test_prune_keeps_the_current_line_and_never_deletes_another(tmp_path):
    for step in (2, 4, 6, 8):
        _ckpt(tmp_path, step)
    _ckpt(tmp_path, 5, commit=False)  # abandoned: older than the newest committed
    inflight = _ckpt(tmp_path, 10, commit=False)  # newer: a save still being written
    removed = layout.prune(tmp_path, 2, RUN)
    assert sorted(p.name for p in removed) == ["step_00000002", "step_00000004", "step_00000005"]
    left = sorted(p.name for p in layout.candidates(tmp_path))
    assert left == ["step_00000006", "step_00000008", inflight.name]


def test_prune_after_a_rollback_keeps_the_new_line_and_the_abandoned_one(tmp_path):
    # issue 15: checkpoints 10, 15, 20 of line 1; rolled back to 10 (line 2); 18 committed with
    # keep_latest=1. Pruning by folder name kept 20 and deleted 18.
    for step in (10, 15, 20):
        _ckpt(tmp_path, step)
    rolled = RUN.branch(RUN.lineage, 10)
    _ckpt(tmp_path, 18, identity=rolled)
    removed = layout.prune(tmp_path, 1, rolled, keep=layout.step_dir(tmp_path, 18))
    assert [p.name for p in removed] == ["step_00000010"]  # the ancestor, older than 18
    left = sorted(p.name for p in layout.candidates(tmp_path))
    assert left == ["step_00000015", "step_00000018", "step_00000020"]  # line 1 is never ours
    assert layout.prune(tmp_path, 1, rolled) == []
    other_run = StateIdentity("run-b", "cfg-a", ("line9@0",))
    assert layout.prune(tmp_path, 1, other_run) == []  # another run's: never deleted


def test_set_aside_moves_a_checkpoint_under_abandoned(tmp_path):
    folder = _ckpt(tmp_path, 20)
    dest = layout.set_aside(tmp_path, folder, layout.validate(folder))
    assert dest == tmp_path / "abandoned" / "line1@0" / "step_00000020"
    assert layout.validate(dest)["next_step"] == 20 and not folder.exists()
    assert layout.candidates(tmp_path) == []
