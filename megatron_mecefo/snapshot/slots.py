"""Snapshot slots: one trainer's state in a file on shared memory (tmpfs), two slots alternating.

Layout of a slot file (little endian):

    [0:8)   magic b"MECEFOS2"       [8]      state: 0 empty, 1 dirty, 2 clean
    [16:20) CRC32 of bytes [20 : 48 + meta length), then of the skeleton and payload
    [20:28) step (next step, int64)  [28:36)  skeleton length    [36:44) payload length
    [44:48) meta length              [48:...) meta: JSON, what the state is (run id, config
                                              hash, lineage; `training.identity`)
    [4096:) pickled skeleton (the state dict with each tensor replaced by (offset, dtype, shape)),
            then the tensors' bytes, 64-byte aligned

A write marks the slot dirty first and clean last, after the CRC; the slot written is never the
newest clean one of the same meta, so a crash mid-copy leaves the previous snapshot intact.
Readers accept only a clean slot whose CRC matches: the CRC covers the header fields (step,
lengths, meta) as well as the body, so an edited step or identity is a corrupt slot. Whether
the meta is the right one is the reader's check (`check` arguments). This module knows nothing
about training or processes.
"""

from __future__ import annotations

import json
import mmap
import os
import pickle
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_mecefo.errors import CheckpointError, SnapshotCorruptError

MAGIC = b"MECEFOS2"
HEADER = 4096
EMPTY, DIRTY, CLEAN = 0, 1, 2
_CRC = struct.Struct("<I")  # at offset 16
_FIELDS = struct.Struct("<qqqI")  # step, skeleton length, payload length, meta length (at 20)
_COVERED = 20  # the CRC covers the header from here (state byte and magic excluded)
_META = _COVERED + _FIELDS.size  # 48
_ALIGN = 64

if TYPE_CHECKING:  # torch is imported where tensors are handled: the snapshot process, which
    import torch  # moves raw bytes only, never imports it


@dataclass(frozen=True)
class SlotHeader:
    """A slot's header as read (not yet verified: `SlotFile.read` checks it with the body)."""

    state: int
    step: int = -1
    skeleton: int = 0
    payload: int = 0
    crc: int = 0
    meta: dict = field(default_factory=dict)
    covered: bytes = b""  # header bytes the CRC covers

    def body_crc(self, body) -> int:
        return zlib.crc32(body, zlib.crc32(self.covered))


def _parse_header(head: bytes) -> SlotHeader:
    if len(head) < _META or head[:8] != MAGIC:
        return SlotHeader(EMPTY)
    (crc,) = _CRC.unpack_from(head, 16)
    step, skel, payload, meta_len = _FIELDS.unpack_from(head, _COVERED)
    if meta_len > HEADER - _META or len(head) < _META + meta_len:
        return SlotHeader(head[8], step, skel, payload, crc, {}, b"")
    covered = bytes(head[_COVERED : _META + meta_len])
    try:
        meta = json.loads(head[_META : _META + meta_len] or b"{}")
    except ValueError:
        meta = {"unreadable": True}
    meta = meta if isinstance(meta, dict) else {"unreadable": True}
    return SlotHeader(head[8], step, skel, payload, crc, meta, covered)


@dataclass(frozen=True)
class _TensorRef:
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def _is_placeholder(obj: Any) -> bool:
    return isinstance(obj, tuple) and len(obj) == 2 and obj[0] == "__tensor__"


def flatten(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """Replace every tensor in a nested dict/list/tuple by its index in the returned list."""
    import torch

    tensors: list[torch.Tensor] = []

    def take(t: torch.Tensor) -> tuple[str, int]:
        tensors.append(t)  # state dicts hold detached tensors already
        return ("__tensor__", len(tensors) - 1)

    return _map_paths(state, lambda o: isinstance(o, torch.Tensor), lambda _, t: take(t)), tensors


def _map_paths(obj: Any, is_leaf: Callable[[Any], bool], fn, path: tuple = ()) -> Any:
    """A copy of the nested dict/list/tuple `obj` with every leaf for which `is_leaf` holds
    replaced by `fn(path, leaf)`, `path` the tuple of keys (and list indices) that reach it
    (containers rebuilt, other values shared)."""
    if is_leaf(obj):
        return fn(path, obj)
    if isinstance(obj, dict):
        return {k: _map_paths(v, is_leaf, fn, (*path, k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_map_paths(v, is_leaf, fn, (*path, i)) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _fits(target: Any, ref: _TensorRef) -> bool:
    import torch

    return (
        isinstance(target, torch.Tensor)
        and target.device.type == "cpu"
        and target.dtype == ref.dtype
        and tuple(target.shape) == tuple(ref.shape)
        and target.is_contiguous()
    )


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    import torch

    t = t if t.is_contiguous() else t.contiguous()
    return t.reshape(-1).view(torch.uint8)


class SlotFile:
    """One slot: a file on tmpfs, mapped once (remapped when it must grow)."""

    def __init__(self, path: Path):
        self.path = path
        self._mm: mmap.mmap | None = None
        self._view: torch.Tensor | None = None  # uint8 tensor over the whole map

    # ------------------------------------------------------------------ header
    def header(self) -> SlotHeader:
        """The header (state EMPTY if the file is absent or not a slot of this format)."""
        try:
            with open(self.path, "rb") as fh:
                head = fh.read(HEADER)
        except FileNotFoundError:
            return SlotHeader(EMPTY)
        return _parse_header(head)

    # ------------------------------------------------------------------ write
    def begin(
        self,
        step: int,
        skeleton: bytes,
        refs: list[_TensorRef],
        payload: int,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Size and map the file, mark it dirty, write the header and the skeleton (the copy
        follows). `meta` says what the state is (JSON, under 4 KB)."""
        raw_meta = json.dumps(meta or {}, sort_keys=True).encode()
        if len(raw_meta) > HEADER - _META:
            raise ValueError(f"snapshot meta of {len(raw_meta)} bytes exceeds {HEADER - _META}")
        size = HEADER + len(skeleton) + payload
        size = max(size, HEADER + _ALIGN)
        self._map(size)
        mm = self._mm
        mm[8] = DIRTY  # before anything else changes
        mm[0:8] = MAGIC
        _CRC.pack_into(mm, 16, 0)
        _FIELDS.pack_into(mm, _COVERED, step, len(skeleton), payload, len(raw_meta))
        mm[_META : _META + len(raw_meta)] = raw_meta
        mm[HEADER : HEADER + len(skeleton)] = skeleton

    def copy_tensor(self, offset: int, tensor: torch.Tensor) -> None:
        src = _as_bytes(tensor)
        if self._view is None:
            import torch

            self._view = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._view[offset : offset + src.numel()].copy_(src)

    def seal(self) -> None:
        """CRC over the header fields, skeleton and payload, then mark clean (the last write)."""
        mm = self._mm
        _, skel, payload, meta_len = _FIELDS.unpack_from(mm, _COVERED)
        crc = zlib.crc32(memoryview(mm)[_COVERED : _META + meta_len])
        crc = zlib.crc32(memoryview(mm)[HEADER : HEADER + skel + payload], crc)
        _CRC.pack_into(mm, 16, crc)
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

    def close(self) -> None:
        self._view = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    # ------------------------------------------------------------------ read
    def read_raw(self, *, verify: bool = True) -> tuple[SlotHeader, bytearray]:
        """(header, the file's bytes up to the end of the payload) of a clean slot, read once.

        Raises:
            SnapshotCorruptError: not clean, truncated, or the CRC (header fields + body) does
                not match.
        """
        try:  # one copy: the file straight into the buffer the tensors are cut from
            with open(self.path, "rb", buffering=0) as fh:
                data = bytearray(os.fstat(fh.fileno()).st_size)
                view, got = memoryview(data), 0
                while got < len(data) and (n := fh.readinto(view[got:])):  # a read stops at 2 GB
                    got += n
                view.release()
        except FileNotFoundError:
            raise SnapshotCorruptError(f"{self.path.name}: no such slot") from None
        del data[got:]  # the file shrank while read: the checks below refuse it
        head = self._verified(data, verify)
        del data[HEADER + head.skeleton + head.payload :]
        return head, data

    def read(
        self,
        *,
        verify: bool = True,
        check: Check | None = None,
        into: dict[tuple, torch.Tensor] | None = None,
    ) -> tuple[SlotHeader, Any]:
        """(verified header, state dict) of a clean slot whose meta passes `check`.

        The file is mapped (not read into a buffer); header, CRC and `check` are verified on the
        map, and only then is each tensor copied once out of it: into `into[key path]` where one
        of the same dtype and shape is given (a key path is the tuple of keys from the top, e.g.
        ("model", "decoder.final_layernorm.weight"); the caller's own tensors, already in
        memory), else into a fresh tensor. The header is checked again after the copy: a slot
        rewritten meanwhile is refused (its `into` tensors are then partly overwritten).

        Raises:
            SnapshotCorruptError: see `read_raw`, or rewritten while it was copied.
            CheckpointError: its (verified) meta fails `check`: another run's state.
        """

        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise SnapshotCorruptError(f"{self.path.name}: no such slot") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER:
                raise SnapshotCorruptError(f"{self.path.name}: truncated ({size} bytes)")
            # shared and read-only: populating it maps tmpfs pages, copies nothing
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        try:
            head = self._verified(mm, verify)
            if check is not None and (reason := check(head.meta)) is not None:
                raise CheckpointError(reason)
            skeleton, refs = pickle.loads(mm[HEADER : HEADER + head.skeleton])
            state = _copy_out(mm, HEADER + head.skeleton, skeleton, refs, into or {})
            if _parse_header(mm[:HEADER]) != head:  # a writer marks the slot dirty first
                raise SnapshotCorruptError(f"{self.path.name}: rewritten while it was read")
            return head, state
        finally:
            try:
                mm.close()
            except BufferError:  # a view still held: the map goes with it
                pass

    def _verified(self, buf: mmap.mmap | bytearray, verify: bool) -> SlotHeader:
        """The header of the slot whose bytes are `buf`, checked: clean, whole, CRC."""
        head = _parse_header(bytes(buf[:HEADER]))
        if head.state != CLEAN:
            raise SnapshotCorruptError(
                f"{self.path.name}: not a clean snapshot (state {head.state})"
            )
        end = HEADER + head.skeleton + head.payload
        if len(buf) < end or not head.covered:
            raise SnapshotCorruptError(f"{self.path.name}: truncated ({len(buf)} bytes)")
        if verify:
            with memoryview(buf) as view:
                if head.body_crc(view[HEADER:end]) != head.crc:
                    raise SnapshotCorruptError(f"{self.path.name}: CRC mismatch (corrupt snapshot)")
        return head


def _copy_out(mm: mmap.mmap, base: int, skeleton: Any, refs: list[_TensorRef], into: dict) -> Any:
    """The skeleton with each placeholder replaced by its tensor, copied out of the map at
    `base` + its offset into `into[path]` where that fits, else into a fresh tensor."""
    import warnings

    import torch

    def load(path: tuple, placeholder: tuple[str, int]) -> torch.Tensor:
        ref = refs[placeholder[1]]
        target = into.get(path)
        dst = target if _fits(target, ref) else torch.empty(ref.shape, dtype=ref.dtype)
        if ref.nbytes:
            with warnings.catch_warnings():  # the map is read-only, and only read here
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(
                    mm, dtype=torch.uint8, count=ref.nbytes, offset=base + ref.offset
                )
            dst.reshape(-1).view(torch.uint8).copy_(src)
            del src
        return dst

    return _map_paths(skeleton, _is_placeholder, load)


def plan_layout(state: Any) -> tuple[bytes, list[_TensorRef], list[torch.Tensor], int]:
    """Skeleton bytes, tensor refs (offsets relative to the payload start), tensors, payload size.

    Offsets are relative to the payload, which starts after the header and the skeleton (padded
    to a multiple of 64 bytes from the file's start)."""
    skeleton, tensors = flatten(state)
    refs, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        refs.append(_TensorRef(offset, t.dtype, tuple(t.shape), nbytes))
        offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    raw = pickle.dumps((skeleton, refs))
    # zero padding (unpickling ignores it) so that the payload, and each tensor, is 64-byte
    # aligned in the file and in a map of it
    raw += bytes(-(HEADER + len(raw)) % _ALIGN)
    return raw, refs, tensors, offset


Check = Callable[[dict], "str | None"]
"""A reader's check of a slot's meta: None if it is the state wanted, else why not."""


class SlotPair:
    """A trainer's two alternating slots `<dir>/rank<R>.slot{0,1}`."""

    def __init__(self, directory: Path, rank: int):
        self.slots = [SlotFile(Path(directory) / f"rank{rank:05d}.slot{i}") for i in (0, 1)]

    def clean(self) -> list[tuple[SlotHeader, SlotFile]]:
        """The slots whose header says clean, newest step first (CRC not checked here)."""
        found = [(slot.header(), slot) for slot in self.slots]
        found = [(head, slot) for head, slot in found if head.state == CLEAN]
        return sorted(found, key=lambda hs: -hs[0].step)

    def clean_steps(self) -> dict[int, SlotFile]:
        """step -> slot, for the slots whose header says clean (CRC not checked here)."""
        return {head.step: slot for head, slot in reversed(self.clean())}

    def target(self, meta: dict | None = None) -> SlotFile:
        """The slot to write next: never the newest clean one with the same `meta` (a slot of
        other meta, such as a stale run's, is taken first)."""
        mine = [slot for head, slot in self.clean() if head.meta == (meta or {})]
        if not mine:
            others = {id(slot) for _, slot in self.clean()}
            free = [slot for slot in self.slots if id(slot) not in others]
            return free[0] if free else self.slots[0]
        return self.slots[1] if mine[0] is self.slots[0] else self.slots[0]

    def read_at(
        self,
        step: int,
        *,
        verify: bool = True,
        check: Check | None = None,
        into: dict[tuple, torch.Tensor] | None = None,
    ) -> Any:
        """The state of `step` whose meta passes `check` (`into`: see `SlotFile.read`).

        Raises:
            SnapshotCorruptError: no clean slot of `step`, or it fails its CRC.
            CheckpointError: its (verified) meta fails `check`: another run's state.
        """
        slots = [slot for head, slot in self.clean() if head.step == step]
        if not slots:
            where = self.slots[0].path.parent
            raise SnapshotCorruptError(f"no clean snapshot of step {step} in {where}")
        why = None
        for slot in slots:
            try:
                head, state = slot.read(verify=verify, check=check, into=into)
            except CheckpointError as exc:
                why = exc
                continue
            if head.step != step:  # rewritten between the header check and the read
                why = SnapshotCorruptError(f"snapshot of step {step} was overwritten while reading")
            else:
                return state
        raise why

    def newest(
        self, *, verify: bool = True, log=None, check: Check | None = None
    ) -> tuple[int, Any] | None:
        """(step, state) of the newest clean slot that verifies (and passes `check`); one that
        does not is reported and skipped."""
        for head, slot in self.clean():
            try:
                got, state = slot.read(verify=verify, check=check)
                return got.step, state
            except CheckpointError as exc:
                if log is not None:
                    log(f"skipping snapshot of step {head.step}: {exc}")
        return None

    def close(self) -> None:
        for slot in self.slots:
            slot.close()
