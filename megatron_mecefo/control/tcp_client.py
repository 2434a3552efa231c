"""A client of torch's `TCPStore` server in plain Python, for the control-plane processes (the
per-node agent, the coordinator, the snapshot process, `mecefo-inject`): they talk to the job's
store but never to torch, and torch's own client costs them a torch import (about 1 s of CPU each,
more on a loaded node, and again on every coordinator restart).

It speaks the wire protocol of torch's libuv store server (the default since torch 2.4): a
`VALIDATE` with torch's magic number and a `PING` on connect, then one request per call, keys
prefixed with "/" as torch's client does, so that both clients see the same keys. Integers are
little-endian; a key or value is a u64 length and its bytes. `tests/unit/control/test_tcp_client.py`
runs every call against torch's real server and beside torch's client, so a protocol change in a
torch upgrade fails there. Ranks keep torch's client: they hand the store to `init_process_group`.

One client per thread, as with torch's (a lock still keeps calls whole if one is shared).
"""

from __future__ import annotations

import datetime
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Iterable, Sequence

from megatron_mecefo.control.store_errors import StoreError, StoreTimeout

MAGIC = 0x3C85F7CE
"""torch's `validationMagicNumber`: the first message of every client."""
KEY_PREFIX = "/"
"""torch's client prefixes every key with it (`TCPStore.keyPrefix_`)."""

# torch/csrc/distributed/c10d/TCPStoreBackend.hpp, `QueryType` (a u8 on the wire)
VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY = range(9)
APPEND, MULTI_GET, MULTI_SET, CANCEL_WAIT, PING = range(9, 14)
READY = 0  # CheckResponseType
STOP_WAITING, WAIT_CANCELED = 0, 1  # WaitResponseType


def _as_bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _seconds(timeout) -> float:
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


class TcpStoreClient:
    """The subset of `torch.distributed.TCPStore`'s client API the control plane uses, with the
    same return types (bytes, int, bool) and errors that are `RuntimeError`s."""

    def __init__(self, host: str, port: int, timeout_s: float):
        self.host, self.port = host, port
        self.timeout_s = float(timeout_s)
        self._lock = threading.Lock()
        self._buf = bytearray()  # received, not yet consumed
        self._sock = self._connect()
        try:
            self._handshake()
        except BaseException:
            self._sock.close()
            raise

    # -- connection -------------------------------------------------------------------------

    def _connect(self) -> socket.socket:
        """Connect, retrying while the server is not up yet, until the timeout (torch's client
        does the same)."""
        deadline = time.monotonic() + self.timeout_s
        delay = 0.01
        while True:
            left = deadline - time.monotonic()
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(0.05, left))
            except OSError as exc:
                if time.monotonic() + delay >= deadline:
                    raise StoreError(
                        f"cannot reach the store at {self.host}:{self.port} within "
                        f"{self.timeout_s:g} s: {exc}"
                    ) from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.timeout_s)
            return sock

    def _handshake(self) -> None:
        nonce = int.from_bytes(os.urandom(4), "little")
        self._send(struct.pack("<BI", VALIDATE, MAGIC) + struct.pack("<BI", PING, nonce))
        if self._recv_u32() != nonce:
            raise StoreError(f"{self.host}:{self.port} is not a torch TCPStore (bad ping reply)")

    def close(self) -> None:
        self._sock.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown, or no socket was made
            pass

    # -- framing ----------------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise StoreError(f"store {self.host}:{self.port}: send failed: {exc}") from exc

    def _recv_exact(self, n: int) -> bytes:
        """`n` bytes of the reply stream, read in large chunks (a `multi_get` of thousands of
        keys is thousands of small fields: one `recv` each made it 1.5x slower than torch's)."""
        buf = self._buf
        while len(buf) < n:
            try:
                chunk = self._sock.recv(max(65536, n - len(buf)))
            except TimeoutError as exc:
                raise StoreTimeout(
                    f"store {self.host}:{self.port}: no reply within {self.timeout_s:g} s"
                ) from exc
            except OSError as exc:
                raise StoreError(f"store {self.host}:{self.port}: receive failed: {exc}") from exc
            if not chunk:
                raise StoreError(f"store {self.host}:{self.port}: connection closed by the server")
            buf += chunk
        out = bytes(buf[:n])
        del buf[:n]
        return out

    def _recv_u8(self) -> int:
        return self._recv_exact(1)[0]

    def _recv_u32(self) -> int:
        return struct.unpack("<I", self._recv_exact(4))[0]

    def _recv_i64(self) -> int:
        return struct.unpack("<q", self._recv_exact(8))[0]

    def _recv_bytes(self) -> bytes:
        (n,) = struct.unpack("<Q", self._recv_exact(8))
        return self._recv_exact(n)

    @staticmethod
    def _blob(data: bytes) -> bytes:
        return struct.pack("<Q", len(data)) + data

    @classmethod
    def _key(cls, key: str) -> bytes:
        return cls._blob((KEY_PREFIX + key).encode())

    @classmethod
    def _keys(cls, keys: Sequence[str]) -> bytes:
        return struct.pack("<Q", len(keys)) + b"".join(cls._key(k) for k in keys)

    def _wait(self, keys: Sequence[str], timeout_s: float) -> None:
        """WAIT, then (past the timeout) CANCEL_WAIT as torch's client does: the server answers
        WAIT_CANCELED, after a STOP_WAITING if the keys arrived meanwhile."""
        self._send(struct.pack("<B", WAIT) + self._keys(keys))
        ready = bool(self._buf)  # a reply may be here already
        if not ready:
            try:
                ready = bool(select.select([self._sock], [], [], max(0.0, timeout_s))[0])
            except (OSError, ValueError) as exc:
                raise StoreError(f"store {self.host}:{self.port}: {exc}") from exc
        if ready:
            reply = self._recv_u8()
            if reply != STOP_WAITING:
                raise StoreError(f"store: unexpected wait reply {reply}")
            return
        self._send(struct.pack("<B", CANCEL_WAIT))
        reply = self._recv_u8()
        if reply == STOP_WAITING:  # the keys came just before the cancel
            reply = self._recv_u8()
        if reply != WAIT_CANCELED:
            raise StoreError(f"store: unexpected cancel reply {reply}")
        raise StoreTimeout(
            f"wait timeout after {timeout_s * 1000:.0f}ms, keys: {[KEY_PREFIX + k for k in keys]}"
        )

    # -- the TCPStore API -------------------------------------------------------------------

    def set(self, key: str, value) -> None:
        with self._lock:
            self._send(struct.pack("<B", SET) + self._key(key) + self._blob(_as_bytes(value)))

    def multi_set(self, keys: Sequence[str], values: Sequence) -> None:
        if len(keys) != len(values):
            raise ValueError("multi_set: as many values as keys")
        body = b"".join(self._key(k) + self._blob(_as_bytes(v)) for k, v in zip(keys, values))
        with self._lock:
            self._send(struct.pack("<BQ", MULTI_SET, len(keys)) + body)

    def get(self, key: str) -> bytes:
        """The value of `key`, waiting for it up to the store's timeout (as torch's client)."""
        with self._lock:
            self._wait([key], self.timeout_s)
            self._send(struct.pack("<B", GET) + self._key(key))
            return self._recv_bytes()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        with self._lock:
            self._wait(keys, self.timeout_s)
            self._send(struct.pack("<B", MULTI_GET) + self._keys(keys))
            return [self._recv_bytes() for _ in keys]

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            self._send(struct.pack("<B", ADD) + self._key(key) + struct.pack("<q", int(amount)))
            return self._recv_i64()

    def compare_set(self, key: str, expected, desired) -> bytes:
        body = self._key(key) + self._blob(_as_bytes(expected)) + self._blob(_as_bytes(desired))
        with self._lock:
            self._send(struct.pack("<B", COMPARE_SET) + body)
            return self._recv_bytes()

    def append(self, key: str, value) -> None:
        with self._lock:
            self._send(struct.pack("<B", APPEND) + self._key(key) + self._blob(_as_bytes(value)))

    def check(self, keys: Iterable[str]) -> bool:
        keys = list(keys)
        with self._lock:
            self._send(struct.pack("<B", CHECK) + self._keys(keys))
            return self._recv_u8() == READY

    def wait(self, keys: Iterable[str], timeout=None) -> None:
        with self._lock:
            self._wait(list(keys), self.timeout_s if timeout is None else _seconds(timeout))

    def delete_key(self, key: str) -> bool:
        with self._lock:
            self._send(struct.pack("<B", DELETE_KEY) + self._key(key))
            return self._recv_i64() == 1

    def num_keys(self) -> int:
        with self._lock:
            self._send(struct.pack("<B", GETNUMKEYS))
            return self._recv_i64()

    def set_timeout(self, timeout) -> None:
        self.timeout_s = _seconds(timeout)
        self._sock.settimeout(self.timeout_s)

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)
