"""Parity exchange between the snapshot processes (SMPs) of a parity group, over TCP.

Owns the wire protocol (JSON header + raw bytes, length-prefixed, bounded timeouts, no pickle), the
parity files under `store_dir` (temp name + rename, CRC32 per unit, newest two complete steps kept)
and the network side of a rebuild. The coding math lives in `codec`; this module must not know
what a blob contains (model state) nor own the shared-memory slots.
"""

from __future__ import annotations

import json
import os
import re
import socket
import socketserver
import struct
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from megatron_mecefo.snapshot import codec
from megatron_mecefo.snapshot.codec import ErasureCode, ParityError, ParityUnit, StripeLayout

_LEN = struct.Struct("!I")
_MAX_HEADER_BYTES = 1 << 20
_FILE_MAGIC = b"MECEFO-PARITY-1\n"
_FILE_RE = re.compile(r"^step(\d{12})_stripe(\d{4})\.parity$")
_KEEP_PENDING_STEPS = 4
"""Incomplete steps kept waiting for data units (a node that stopped publishing must not grow
the holder's memory without bound)."""


# ---------------------------------------------------------------------------------------------
# Wire protocol: [u32 header length][JSON header][header["nbytes"] raw bytes]


def _recv_exact(sock: socket.socket, nbytes: int) -> bytearray:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        n = sock.recv_into(view[got:], min(nbytes - got, 1 << 24))
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {nbytes} bytes")
        got += n
    return buf


def _send_msg(sock: socket.socket, header: dict[str, Any], payload: list[memoryview]) -> None:
    header = dict(header, nbytes=sum(p.nbytes for p in payload))
    raw = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw)
    for part in payload:
        sock.sendall(part)


def _recv_msg(sock: socket.socket, max_payload_bytes: int) -> tuple[dict[str, Any], bytearray]:
    (hlen,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if hlen > _MAX_HEADER_BYTES:
        raise ConnectionError(f"message header of {hlen} bytes exceeds {_MAX_HEADER_BYTES}")
    header = json.loads(bytes(_recv_exact(sock, hlen)))
    nbytes = header.get("nbytes") if isinstance(header, dict) else None
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ConnectionError("malformed message header (no valid 'nbytes')")
    if nbytes > max_payload_bytes:
        raise ConnectionError(f"message payload of {nbytes} bytes exceeds {max_payload_bytes}")
    return header, _recv_exact(sock, nbytes)


def _u8view(data: Any) -> memoryview:
    return memoryview(codec.as_u8(data))


# ---------------------------------------------------------------------------------------------
# Parity files


def parity_file_name(step: int, stripe: int) -> str:
    """File name of the parity units of `(step, stripe)` inside a store_dir."""
    return f"step{step:012d}_stripe{stripe:04d}.parity"


def write_parity_file(path: Path, step: int, units: list[ParityUnit]) -> None:
    """Write `units` (one stripe) atomically: temp name, fsync, rename; CRC32 per unit."""
    header = {
        "step": step,
        "stripe": units[0].stripe,
        "unit_length": units[0].unit_length,
        "data_lengths": list(units[0].data_lengths),
        "units": [
            {"index": u.index, "nbytes": int(u.payload.size), "crc32": zlib.crc32(u.payload)}
            for u in units
        ],
    }
    raw = json.dumps(header).encode()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(_FILE_MAGIC + _LEN.pack(len(raw)) + raw)
        for u in units:
            f.write(memoryview(u.payload))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_parity_file(path: Path) -> tuple[int, list[ParityUnit]]:
    """`(step, units)` of a parity file; ParityError if it is truncated or a CRC32 mismatches."""
    data = path.read_bytes()
    try:
        if not data.startswith(_FILE_MAGIC):
            raise ValueError("bad magic")
        off = len(_FILE_MAGIC)
        (hlen,) = _LEN.unpack_from(data, off)
        off += _LEN.size
        header = json.loads(data[off : off + hlen])
        off += hlen
        units = []
        for meta in header["units"]:
            payload = np.frombuffer(data, dtype=np.uint8, count=meta["nbytes"], offset=off)
            off += meta["nbytes"]
            if zlib.crc32(payload) != meta["crc32"]:
                raise ValueError(f"CRC32 mismatch in parity unit {meta['index']}")
            units.append(
                ParityUnit(
                    header["stripe"],
                    meta["index"],
                    header["unit_length"],
                    tuple(header["data_lengths"]),
                    payload,
                )
            )
        if off != len(data):
            raise ValueError(f"{len(data) - off} trailing bytes")
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise ParityError(f"parity file {path} is corrupt ({exc}): not used") from exc
    return header["step"], units


# ---------------------------------------------------------------------------------------------
# Service


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        svc = self.server.service
        self.request.settimeout(svc.timeout_s)
        try:
            header, payload = _recv_msg(self.request, svc.max_payload_bytes)
        except (OSError, ValueError) as exc:  # framing / timeout: drop the connection
            svc.log(f"parity[{svc.node}]: bad request from {self.client_address}: {exc}")
            return
        try:
            reply, parts = svc._serve(header, payload)
        except (ParityError, KeyError, TypeError, ValueError) as exc:
            reply, parts = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, []
        try:
            _send_msg(self.request, reply, parts)
        except OSError as exc:
            svc.log(f"parity[{svc.node}]: reply to {self.client_address} failed: {exc}")


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], service: ParityService) -> None:
        self.service = service
        super().__init__(addr, _Handler)


class ParityService:
    """One node's parity endpoint: holds parity for its stripes, serves segments, rebuilds blobs.

    Args:
        node: this node's index in the parity group.
        layout: the group's stripe layout.
        code: the erasure code (`XorCode` for m = 1, `ReedSolomonCode`).
        store_dir: where this node's parity files live (survives a restart of the service).
        peers: node -> "host:port" of live peer services (called on every use; may omit self).
        blob_at: this node's blob at a step, or None if it no longer holds that step. A published
            blob must stay unchanged until `flush()` returns.
        log: one-line event sink.
        host: interface to listen on; port 0 picks a free port.
        timeout_s: bound on every socket operation.
        max_payload_bytes: largest message accepted from a peer.
    """

    def __init__(
        self,
        node: int,
        layout: StripeLayout,
        code: ErasureCode,
        store_dir: Path,
        peers: Callable[[], dict[int, str]],
        blob_at: Callable[[int], memoryview | None],
        log: Callable[[str], Any] = print,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 5.0,
        max_payload_bytes: int = 1 << 36,
    ) -> None:
        if code.num_parity != layout.num_parity:
            raise ValueError(f"code has m={code.num_parity} but layout has m={layout.num_parity}")
        self.node = node
        self.layout = layout
        self.code = code
        self.store_dir = Path(store_dir)
        self.peers = peers
        self.blob_at = blob_at
        self.log = log
        self.timeout_s = timeout_s
        self.max_payload_bytes = max_payload_bytes
        self._my_stripes = {s for s, _ in layout.parity_stripes(node)}
        self._lock = threading.Lock()
        self._pending: dict[tuple[int, int], dict[int, np.ndarray]] = {}
        self._stored: dict[int, set[int]] = {}  # step -> stripes whose parity file is written
        self._outbox: tuple[int, memoryview] | None = None
        self._outbox_cv = threading.Condition()
        self._sending = False
        self._closed = False
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._scan_store()
        self._server = _Server((host, port), self)
        self.address = f"{host}:{self._server.server_address[1]}"
        self._threads: list[threading.Thread] = []

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Serve peers and start the sender thread."""
        serve = lambda: self._server.serve_forever(poll_interval=0.05)  # close() waits one poll
        for target, name in ((serve, "serve"), (self._send_loop, "send")):
            t = threading.Thread(target=target, name=f"parity{self.node}-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def close(self) -> None:
        """Stop serving and sending (pending publishes are dropped)."""
        with self._outbox_cv:
            self._closed = True
            self._outbox_cv.notify_all()
        if self._threads:
            self._server.shutdown()
        self._server.server_close()
        for t in self._threads:
            t.join(timeout=self.timeout_s)

    def __enter__(self) -> ParityService:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- publishing --------------------------------------------------------------------------

    def publish(self, step: int, blob: memoryview) -> None:
        """Send this node's blob at `step`, segment by segment, to its stripes' parity holders.

        Returns at once; a sender thread does the work. A newer publish replaces one not yet
        started. `blob` must stay unchanged until `flush()` returns.
        """
        with self._outbox_cv:
            self._outbox = (step, blob)
            self._outbox_cv.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every published blob has been sent; False on timeout."""
        with self._outbox_cv:
            return self._outbox_cv.wait_for(
                lambda: self._closed or (self._outbox is None and not self._sending), timeout_s
            )

    def _send_loop(self) -> None:
        while True:
            with self._outbox_cv:
                self._outbox_cv.wait_for(lambda: self._closed or self._outbox is not None)
                if self._closed:
                    return
                step, blob = self._outbox  # type: ignore[misc]
                self._outbox, self._sending = None, True
            try:
                self._send_segments(step, blob)
            finally:
                with self._outbox_cv:
                    self._sending = False
                    self._outbox_cv.notify_all()

    def _send_segments(self, step: int, blob: memoryview) -> None:
        segments = self.layout.split(blob)
        for q, (stripe, position) in enumerate(self.layout.node_segments(self.node)):
            for holder in self.layout.parity_nodes(stripe):
                header = {"op": "put", "step": step, "stripe": stripe, "position": position}
                try:
                    self._call(holder, header, [_u8view(segments[q])])
                except ParityError as exc:
                    self.log(f"parity[{self.node}]: step {step} stripe {stripe} not sent: {exc}")

    # -- holder side -------------------------------------------------------------------------

    def _scan_store(self) -> None:
        for path in self.store_dir.iterdir():
            match = _FILE_RE.match(path.name)
            if match is None:
                if path.name.startswith(".") and ".tmp" in path.name:
                    path.unlink(missing_ok=True)  # a crash mid-write: never complete
                continue
            step, stripe = int(match[1]), int(match[2])
            if stripe in self._my_stripes:
                self._stored.setdefault(step, set()).add(stripe)
        self._prune()

    def _complete_steps(self) -> list[int]:
        return sorted(s for s, stripes in self._stored.items() if stripes >= self._my_stripes)

    def parity_step(self) -> int | None:
        """Newest step for which this node holds complete parity units (every stripe it holds)."""
        with self._lock:
            steps = self._complete_steps()
        return steps[-1] if steps else None

    def parity_steps(self) -> list[int]:
        """Steps (ascending) for which this node holds complete parity units."""
        with self._lock:
            return self._complete_steps()

    def _prune(self) -> None:
        """Keep the newest two complete steps (and newer partial ones); caller holds the lock."""
        complete = self._complete_steps()
        if not complete:
            return
        keep_from = complete[-2] if len(complete) >= 2 else complete[-1]
        for step in [s for s in self._stored if s < keep_from]:
            for stripe in self._stored.pop(step):
                (self.store_dir / parity_file_name(step, stripe)).unlink(missing_ok=True)
        for key in [k for k in self._pending if k[0] <= complete[-1]]:
            del self._pending[key]

    def _put(self, step: int, stripe: int, position: int, data: np.ndarray) -> None:
        if stripe not in self._my_stripes:
            raise ParityError(f"node {self.node} holds no parity of stripe {stripe}")
        if not 0 <= position < self.layout.num_data:
            raise ParityError(f"data position {position} out of range for stripe {stripe}")
        with self._lock:
            complete = self._complete_steps()
            if complete and step <= complete[-1] and step not in self._stored:
                raise ParityError(f"step {step} is older than held parity step {complete[-1]}")
            units = self._pending.setdefault((step, stripe), {})
            units[position] = data
            if len(units) < self.layout.num_data:
                steps = sorted({k[0] for k in self._pending})
                for old in steps[:-_KEEP_PENDING_STEPS]:
                    for key in [k for k in self._pending if k[0] == old]:
                        del self._pending[key]
                return
            del self._pending[(step, stripe)]
        parity = codec.encode_stripe(
            self.layout, self.code, stripe, [units[p] for p in range(self.layout.num_data)]
        )
        write_parity_file(self.store_dir / parity_file_name(step, stripe), step, parity)
        with self._lock:
            self._stored.setdefault(step, set()).add(stripe)
            self._prune()

    def _read_parity(self, step: int, stripe: int) -> list[ParityUnit] | None:
        with self._lock:
            if stripe not in self._stored.get(step, ()):
                return None
        path = self.store_dir / parity_file_name(step, stripe)
        try:
            file_step, units = read_parity_file(path)
        except FileNotFoundError:
            return None
        except ParityError as exc:
            self.log(f"parity[{self.node}]: {exc}")
            raise
        if file_step != step or any(u.stripe != stripe for u in units):
            raise ParityError(f"parity file {path} holds step {file_step}, not {step}: not used")
        return units

    def _segment(self, step: int, stripe: int) -> memoryview | None:
        blob = self.blob_at(step)
        if blob is None:
            return None
        q, _ = self.layout.segment_stripe(self.node, stripe)
        return _u8view(self.layout.split(blob)[q])

    def _serve(self, header: dict[str, Any], payload: bytearray) -> tuple[dict, list[memoryview]]:
        op, step, stripe = header.get("op"), int(header["step"]), int(header.get("stripe", -1))
        if op == "put":
            data = np.frombuffer(payload, dtype=np.uint8)
            self._put(step, stripe, int(header["position"]), data)
            return {"ok": True}, []
        if op == "get_data":
            segment = self._segment(step, stripe)
            if segment is None:
                return {"ok": False, "error": f"node {self.node} no longer holds step {step}"}, []
            return {"ok": True}, [segment]
        if op == "get_parity":
            units = self._read_parity(step, stripe)
            if units is None:
                return {
                    "ok": False,
                    "error": f"node {self.node} holds no parity of {step}/{stripe}",
                }, []
            return _parity_reply(units), [_u8view(u.payload) for u in units]
        if op == "steps":
            return {"ok": True, "steps": self.parity_steps()}, []
        raise ParityError(f"unknown op {op!r}")

    # -- client side -------------------------------------------------------------------------

    def _call(
        self, peer: int, header: dict[str, Any], payload: list[memoryview] | None = None
    ) -> tuple[dict[str, Any], bytearray]:
        """One request to `peer` (answered locally for this node); ParityError on any failure."""
        if peer == self.node:
            reply, parts = self._serve(header, bytearray(b"".join(payload or [])))
            data = bytearray(b"".join(parts))
        else:
            reply, data = self._remote_call(peer, header, payload or [])
        if not reply.get("ok"):
            raise ParityError(f"node {peer}: {reply.get('error', 'request failed')}")
        return reply, data

    def _remote_call(
        self, peer: int, header: dict[str, Any], payload: list[memoryview]
    ) -> tuple[dict[str, Any], bytearray]:
        address = self.peers().get(peer)
        if address is None:
            raise ParityError(f"node {peer} is not live")
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=self.timeout_s) as sock:
                sock.settimeout(self.timeout_s)
                _send_msg(sock, header, payload)
                return _recv_msg(sock, self.max_payload_bytes)
        except (OSError, ValueError) as exc:
            raise ParityError(f"node {peer} at {address} unreachable ({exc})") from exc

    def _fetch_parity(self, holder: int, step: int, stripe: int) -> list[ParityUnit]:
        if holder == self.node:
            units = self._read_parity(step, stripe)
            if units is None:
                raise ParityError(f"node {self.node} holds no parity of {step}/{stripe}")
            return units
        reply, data = self._call(holder, {"op": "get_parity", "step": step, "stripe": stripe})
        return _parity_from_reply(reply, data, stripe)

    def _candidate_steps(self, lost: int) -> list[int]:
        steps: set[int] = set()
        for node in range(self.layout.num_nodes):
            if node == lost and lost != self.node:
                continue
            try:
                steps.update(self._call(node, {"op": "steps", "step": -1})[0]["steps"])
            except ParityError:
                continue
        return sorted(steps, reverse=True)

    def rebuild(self, lost_node: int | None = None, step: int | None = None) -> tuple[int, bytes]:
        """`(step, blob)` of `lost_node` (default: this node), at the newest recoverable step.

        Tries each step that some live holder has complete parity for, newest first, fetching
        segments and parity units over TCP; corrupt or missing units make that step fail.

        Raises:
            ParityError: no step is recoverable (names what was tried and why each failed).
        """
        lost = self.node if lost_node is None else lost_node
        steps = [step] if step is not None else self._candidate_steps(lost)
        reasons = []
        for candidate in steps:
            try:
                return candidate, self._rebuild_at(lost, candidate)
            except ParityError as exc:
                self.log(f"parity[{self.node}]: rebuild of node {lost} at step {candidate}: {exc}")
                reasons.append(f"step {candidate}: {exc}")
        tried = "; ".join(reasons) if reasons else "no live node holds complete parity"
        raise ParityError(f"cannot rebuild node {lost} from parity ({tried})")

    def _rebuild_at(self, lost: int, step: int) -> bytes:
        parts = []
        for stripe, position in self.layout.node_segments(lost):
            parity: dict[int, ParityUnit] = {}
            errors = []
            for holder in self.layout.parity_nodes(stripe):
                try:
                    parity.update({u.index: u for u in self._fetch_parity(holder, step, stripe)})
                except ParityError as exc:
                    errors.append(str(exc))
            data: dict[int, np.ndarray] = {}
            for pos, node in enumerate(self.layout.data_nodes(stripe)):
                if node == lost or len(data) + len(parity) >= self.layout.num_data:
                    continue
                try:
                    _, raw = self._call(node, {"op": "get_data", "step": step, "stripe": stripe})
                    data[pos] = np.frombuffer(raw, dtype=np.uint8)
                except ParityError as exc:
                    errors.append(str(exc))
            try:
                parts.append(
                    codec.recover_segment(self.layout, self.code, stripe, position, data, parity)
                )
            except ParityError as exc:
                raise ParityError(f"{exc} [{'; '.join(errors)}]") from exc
        return b"".join(memoryview(p) for p in parts)


def _parity_reply(units: list[ParityUnit]) -> dict[str, Any]:
    return {
        "ok": True,
        "unit_length": units[0].unit_length,
        "data_lengths": list(units[0].data_lengths),
        "units": [
            {"index": u.index, "nbytes": int(u.payload.size), "crc32": zlib.crc32(u.payload)}
            for u in units
        ],
    }


def _parity_from_reply(reply: dict[str, Any], data: bytearray, stripe: int) -> list[ParityUnit]:
    units, off = [], 0
    try:
        for meta in reply["units"]:
            payload = np.frombuffer(data, dtype=np.uint8, count=meta["nbytes"], offset=off)
            off += meta["nbytes"]
            if zlib.crc32(payload) != meta["crc32"]:
                raise ValueError(f"CRC32 mismatch in unit {meta['index']}")
            lengths = tuple(reply["data_lengths"])
            units.append(ParityUnit(stripe, meta["index"], reply["unit_length"], lengths, payload))
    except (KeyError, TypeError, ValueError) as exc:
        raise ParityError(f"bad parity reply for stripe {stripe}: {exc}") from exc
    return units
