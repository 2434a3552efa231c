"""Snapshot slots: one trainer's state in a file on shared memory (tmpfs), two slots alternating.

Layout of a slot file (little endian):

    [0:8)   magic b"MECEFOS1"       [8]      state: 0 empty, 1 dirty, 2 clean
    [16:24) step (next step, int64)  [24:32)  skeleton length    [32:40) payload length
    [40:44) CRC32 of skeleton + payload
    [4096:) pickled skeleton (the state dict with each tensor replaced by (offset, dtype, shape)),
            then the tensors' bytes, 64-byte aligned

A write marks the slot dirty first and clean last, after the CRC; the slot written is never the
newest clean one, so a crash mid-copy leaves the previous snapshot intact. Readers accept only a
clean slot whose CRC matches. This module knows nothing about training or processes.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_mecefo.errors import SnapshotCorruptError

MAGIC = b"MECEFOS1"
HEADER = 4096
EMPTY, DIRTY, CLEAN = 0, 1, 2
_FIELDS = struct.Struct("<qqqI")  # step, skeleton length, payload length, crc  (at offset 16)
_ALIGN = 64


@dataclass(frozen=True)
class _TensorRef:
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def _map_leaves(obj: Any, is_leaf: Callable[[Any], bool], fn: Callable[[Any], Any]) -> Any:
    """A copy of the nested dict/list/tuple `obj` with every leaf for which `is_leaf` holds
    replaced by `fn(leaf)` (containers rebuilt, other values shared)."""
    if is_leaf(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_leaves(v, is_leaf, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_leaves(v, is_leaf, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map_leaves(v, is_leaf, fn) for v in obj)
    return obj


def _is_placeholder(obj: Any) -> bool:
    return isinstance(obj, tuple) and len(obj) == 2 and obj[0] == "__tensor__"


def flatten(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """Replace every tensor in a nested dict/list/tuple by its index in the returned list."""
    tensors: list[torch.Tensor] = []

    def take(t: torch.Tensor) -> tuple[str, int]:
        tensors.append(t)  # state dicts hold detached tensors already
        return ("__tensor__", len(tensors) - 1)

    return _map_leaves(state, lambda o: isinstance(o, torch.Tensor), take), tensors


def _unflatten(skeleton: Any, refs: list[_TensorRef], base: torch.Tensor) -> Any:
    def load(placeholder: tuple[str, int]) -> torch.Tensor:
        ref = refs[placeholder[1]]
        raw = base[ref.offset : ref.offset + ref.nbytes].clone()
        return raw.view(ref.dtype).reshape(ref.shape)

    return _map_leaves(skeleton, _is_placeholder, load)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t if t.is_contiguous() else t.contiguous()
    return t.reshape(-1).view(torch.uint8)


class SlotFile:
    """One slot: a file on tmpfs, mapped once (remapped when it must grow)."""

    def __init__(self, path: Path):
        self.path = path
        self._mm: mmap.mmap | None = None
        self._view: torch.Tensor | None = None  # uint8 tensor over the whole map

    # ------------------------------------------------------------------ header
    def header(self) -> tuple[int, int, int, int, int]:
        """(state, step, skeleton length, payload length, crc); EMPTY if absent or not ours."""
        try:
            with open(self.path, "rb") as fh:
                head = fh.read(44)
        except FileNotFoundError:
            return EMPTY, -1, 0, 0, 0
        if len(head) < 44 or head[:8] != MAGIC:
            return EMPTY, -1, 0, 0, 0
        step, skel, payload, crc = _FIELDS.unpack_from(head, 16)
        return head[8], step, skel, payload, crc

    # ------------------------------------------------------------------ write
    def begin(self, step: int, skeleton: bytes, refs: list[_TensorRef], payload: int) -> None:
        """Size and map the file, mark it dirty, write the skeleton (the copy follows)."""
        size = HEADER + len(skeleton) + payload
        size = max(size, HEADER + _ALIGN)
        self._map(size)
        mm = self._mm
        mm[8] = DIRTY  # before anything else changes
        mm[0:8] = MAGIC
        _FIELDS.pack_into(mm, 16, step, len(skeleton), payload, 0)
        mm[HEADER : HEADER + len(skeleton)] = skeleton

    def copy_tensor(self, offset: int, tensor: torch.Tensor) -> None:
        src = _as_bytes(tensor)
        self._view[offset : offset + src.numel()].copy_(src)

    def seal(self) -> None:
        """CRC over skeleton + payload, then mark clean (the last write)."""
        mm = self._mm
        step, skel, payload, _ = _FIELDS.unpack_from(mm, 16)
        crc = zlib.crc32(memoryview(mm)[HEADER : HEADER + skel + payload])
        _FIELDS.pack_into(mm, 16, step, skel, payload, crc)
        mm[8] = CLEAN
        mm.flush()

    def _map(self, size: int) -> None:
        if self._mm is not None and len(self._mm) >= size:
            return
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                # reserve the pages now: a full tmpfs raises ENOSPC here, not SIGBUS mid-copy
                os.posix_fallocate(fd, 0, size)
            self._mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self._view = torch.frombuffer(self._mm, dtype=torch.uint8)

    def close(self) -> None:
        self._view = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    # ------------------------------------------------------------------ read
    def read(self, *, verify: bool = True) -> tuple[int, Any]:
        """(step, state dict) of a clean slot.

        Raises:
            SnapshotCorruptError: not clean, truncated, or the CRC does not match.
        """
        state, step, skel, payload, crc = self.header()
        if state != CLEAN:
            raise SnapshotCorruptError(f"{self.path.name}: not a clean snapshot (state {state})")
        data = bytearray(self.path.read_bytes())
        if len(data) < HEADER + skel + payload:
            raise SnapshotCorruptError(f"{self.path.name}: truncated ({len(data)} bytes)")
        body = memoryview(data)[HEADER : HEADER + skel + payload]
        if verify and zlib.crc32(body) != crc:
            raise SnapshotCorruptError(f"{self.path.name}: CRC mismatch (corrupt snapshot)")
        skeleton, refs = pickle.loads(body[:skel])
        base = torch.frombuffer(data, dtype=torch.uint8)[HEADER + skel :]
        return step, _unflatten(skeleton, refs, base)


def plan_layout(state: Any) -> tuple[bytes, list[_TensorRef], list[torch.Tensor], int]:
    """Skeleton bytes, tensor refs (offsets relative to the payload start), tensors, payload size.

    Offsets are relative to the payload, which starts after the header and the skeleton."""
    skeleton, tensors = flatten(state)
    refs, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        refs.append(_TensorRef(offset, t.dtype, tuple(t.shape), nbytes))
        offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return pickle.dumps((skeleton, refs)), refs, tensors, offset


class SlotPair:
    """A trainer's two alternating slots `<dir>/rank<R>.slot{0,1}`."""

    def __init__(self, directory: Path, rank: int):
        self.slots = [SlotFile(Path(directory) / f"rank{rank:05d}.slot{i}") for i in (0, 1)]

    def clean_steps(self) -> dict[int, SlotFile]:
        """step -> slot, for the slots whose header says clean (CRC not checked here)."""
        out = {}
        for slot in self.slots:
            state, step, *_ = slot.header()
            if state == CLEAN:
                out[step] = slot
        return out

    def target(self) -> SlotFile:
        """The slot to write next: never the newest clean one."""
        clean = self.clean_steps()
        if not clean:
            return self.slots[0]
        newest = clean[max(clean)]
        return self.slots[1] if newest is self.slots[0] else self.slots[0]

    def read_at(self, step: int, *, verify: bool = True) -> Any:
        """The state of `step` (raises SnapshotCorruptError if it is not held or fails its CRC)."""
        slot = self.clean_steps().get(step)
        if slot is None:
            where = self.slots[0].path.parent
            raise SnapshotCorruptError(f"no clean snapshot of step {step} in {where}")
        got, state = slot.read(verify=verify)
        if got != step:  # rewritten between the header check and the read
            raise SnapshotCorruptError(f"snapshot of step {step} was overwritten while reading")
        return state

    def newest(self, *, verify: bool = True, log=None) -> tuple[int, Any] | None:
        """The newest clean slot that verifies; a corrupt one is reported and skipped."""
        for step, slot in sorted(self.clean_steps().items(), reverse=True):
            try:
                return slot.read(verify=verify)
            except SnapshotCorruptError as exc:
                if log is not None:
                    log(f"skipping snapshot of step {step}: {exc}")
        return None

    def close(self) -> None:
        for slot in self.slots:
            slot.close()
