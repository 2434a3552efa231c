"""The checkpoint folder protocol: commit marker written last, checksums, newest-valid choice and
retention (pure file operations, no megatron)."""

from __future__ import annotations

import pytest

from megatron_mecefo.checkpoint import layout
from megatron_mecefo.errors import CheckpointError


def _ckpt(root, step, commit=True, payload=b"weights"):
    folder = layout.step_dir(root, step)
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(payload * 100)
    (folder / "common.pt").write_bytes(b"common")
    if commit:
        layout.write_marker(folder, step, {"tp": 1})
    return folder


def test_valid_checkpoint_round_trip(tmp_path):
    folder = _ckpt(tmp_path, 6)
    marker = layout.validate(folder)
    assert marker["next_step"] == 6 and marker["tp"] == 1
    assert set(marker["files"]) == {"__0_0.distcp", "common.pt"}


def test_uncommitted_is_never_valid(tmp_path):
    with pytest.raises(CheckpointError, match="never completed"):
        layout.validate(_ckpt(tmp_path, 6, commit=False))


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


def test_newest_valid_skips_broken_ones_and_says_why(tmp_path):
    _ckpt(tmp_path, 4)
    good = _ckpt(tmp_path, 8)
    bad = _ckpt(tmp_path, 12)
    (bad / "common.pt").write_bytes(b"COMMON")  # same size, other bytes
    _ckpt(tmp_path, 16, commit=False)  # a crash during the save
    said = []
    folder, marker = layout.newest_valid(tmp_path, said.append)
    assert folder == good and marker["next_step"] == 8
    assert len(said) == 2 and "never completed" in said[0] and "checksum" in said[1]


def test_no_checkpoint(tmp_path):
    assert layout.newest_valid(tmp_path / "nope") is None


def test_prune_keeps_latest_and_drops_abandoned_partials(tmp_path):
    for step in (2, 4, 6, 8):
        _ckpt(tmp_path, step)
    _ckpt(tmp_path, 5, commit=False)  # abandoned: older than the newest committed
    inflight = _ckpt(tmp_path, 10, commit=False)  # newer: a save still being written
    removed = layout.prune(tmp_path, keep_latest=2)
    assert sorted(p.name for p in removed) == ["step_00000002", "step_00000004", "step_00000005"]
    left = sorted(p.name for p in layout.candidates(tmp_path))
    assert left == ["step_00000006", "step_00000008", inflight.name]
