"""Erasure coding of per-node snapshot blobs across a parity group of nodes (RAID-5/6 style).

Owns the stripe layout (rotating parity, so every node stores the same share of parity), the codes
(`XorCode`, `ReedSolomonCode` via pyeclib) and the pure protect/rebuild math. Numpy only: it must
not import torch, open sockets or touch files (`parity.py` moves units between nodes).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from megatron_mecefo.errors import CheckpointError

Buffer = bytes | bytearray | memoryview | np.ndarray


class ParityError(CheckpointError):
    """A lost blob cannot be rebuilt from parity (too many nodes lost, corrupt or missing units)."""


def as_u8(data: Buffer) -> np.ndarray:
    """Zero-copy flat uint8 view of a bytes-like object or array."""
    if isinstance(data, np.ndarray):
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


# ---------------------------------------------------------------------------------------------
# Layout


class StripeLayout:
    """Which node holds which segment and which parity, for a group of `num_nodes` nodes.

    There are `num_nodes` stripes. Stripe `s` has parity nodes `[(s + i) % n for i in range(m)]`
    and the other `n - m` nodes, in ascending order, as data nodes (data position = index in that
    list). Every node is a data node in exactly `n - m` stripes and a parity node in `m`, so its
    blob is split into `n - m` equal segments (the last one short) and segment `q` goes to the
    q-th stripe (ascending) in which the node is a data node.

    Args:
        num_nodes: nodes in the parity group (n), each in its own failure domain.
        num_parity: parity units per stripe (m): the number of node losses the group tolerates.
    """

    def __init__(self, num_nodes: int, num_parity: int) -> None:
        if not 1 <= num_parity < num_nodes:
            raise ValueError(
                f"parity group needs 1 <= num_parity < num_nodes, got num_nodes={num_nodes}, "
                f"num_parity={num_parity}: use at least num_parity + 1 nodes"
            )
        self.num_nodes = num_nodes
        self.num_parity = num_parity
        self._parity = [
            tuple((s + i) % num_nodes for i in range(num_parity)) for s in range(num_nodes)
        ]
        self._data = [
            tuple(j for j in range(num_nodes) if j not in self._parity[s]) for s in range(num_nodes)
        ]

    @property
    def num_data(self) -> int:
        """Data units per stripe (k = n - m), also the number of segments of each blob."""
        return self.num_nodes - self.num_parity

    def __repr__(self) -> str:
        return f"StripeLayout(num_nodes={self.num_nodes}, num_parity={self.num_parity})"

    def _check_node(self, node: int) -> None:
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node {node} is not in the parity group 0..{self.num_nodes - 1}")

    def parity_nodes(self, stripe: int) -> tuple[int, ...]:
        """Nodes holding the parity units of `stripe`, parity index order."""
        return self._parity[stripe]

    def data_nodes(self, stripe: int) -> tuple[int, ...]:
        """Nodes whose segments form the data units of `stripe`, data position order."""
        return self._data[stripe]

    def node_segments(self, node: int) -> list[tuple[int, int]]:
        """`(stripe, data position)` of each of `node`'s segments, segment order."""
        self._check_node(node)
        return [
            (s, self._data[s].index(node)) for s in range(self.num_nodes) if node in self._data[s]
        ]

    def segment_stripe(self, node: int, stripe: int) -> tuple[int, int]:
        """`(segment index, data position)` of `node` in `stripe`; ValueError if it holds parity."""
        for q, (s, pos) in enumerate(self.node_segments(node)):
            if s == stripe:
                return q, pos
        raise ValueError(f"node {node} holds parity, not data, in stripe {stripe}")

    def parity_stripes(self, node: int) -> list[tuple[int, int]]:
        """`(stripe, parity index)` of every parity unit `node` stores."""
        self._check_node(node)
        return [
            (s, self._parity[s].index(node))
            for s in range(self.num_nodes)
            if node in self._parity[s]
        ]

    def segment_length(self, blob_length: int) -> int:
        """Length of every segment but possibly the last, for a blob of `blob_length` bytes."""
        return -(-blob_length // self.num_data)

    def split(self, blob: Buffer) -> list[np.ndarray]:
        """`blob` as `n - m` zero-copy segments (the last ones short or empty)."""
        data = as_u8(blob)
        seg = self.segment_length(data.size)
        return [data[q * seg : (q + 1) * seg] for q in range(self.num_data)]


# ---------------------------------------------------------------------------------------------
# Codes


class ErasureCode(Protocol):
    """A systematic (k + m) code over byte units; indices 0..k-1 are data, k..k+m-1 parity."""

    name: str
    num_parity: int

    def encode(self, data_units: Sequence[Buffer]) -> list[np.ndarray]:
        """The m parity units of `data_units` (zero-padded to the longest)."""
        ...

    def decode(self, units: Mapping[int, Buffer], k: int, m: int, length: int) -> list[np.ndarray]:
        """All k data units (each `length` bytes, padding included) from any k of the k + m."""
        ...


def _padded(unit: Buffer, length: int) -> np.ndarray:
    data = as_u8(unit)
    if data.size == length:
        return data
    if data.size > length:
        raise ParityError(f"unit of {data.size} bytes is longer than the stripe's {length}")
    out = np.zeros(length, dtype=np.uint8)
    out[: data.size] = data
    return out


def _check_units(units: Mapping[int, Buffer], k: int, m: int) -> None:
    if len(units) < k:
        missing = sorted(set(range(k + m)) - set(units))
        raise ParityError(
            f"only {len(units)} of the {k} units needed are available (missing unit indices "
            f"{missing}): more than m={m} nodes of the parity group are lost"
        )


def _xor_into(acc: np.ndarray, unit: np.ndarray) -> None:
    """acc[:len(unit)] ^= unit, 8 bytes at a time where both are 8-byte aligned."""
    n = unit.size
    n8 = n - n % 8
    if n8 and acc.ctypes.data % 8 == 0 and unit.ctypes.data % 8 == 0:
        a64 = acc[:n8].view(np.uint64)
        np.bitwise_xor(a64, unit[:n8].view(np.uint64), out=a64)
    else:
        n8 = 0
    if n > n8:
        np.bitwise_xor(acc[n8:n], unit[n8:n], out=acc[n8:n])


class XorCode:
    """Single parity (RAID-5): parity = XOR of the data units; tolerates one lost unit."""

    name = "xor"
    num_parity = 1

    def encode(self, data_units: Sequence[Buffer]) -> list[np.ndarray]:
        """One parity unit, the XOR of `data_units` zero-padded to the longest."""
        units = [as_u8(u) for u in data_units]
        length = max((u.size for u in units), default=0)
        acc = np.zeros(length, dtype=np.uint8)
        for unit in units:
            _xor_into(acc, unit)
        return [acc]

    def decode(
        self, units: Mapping[int, Buffer], k: int, m: int = 1, length: int = 0
    ) -> list[np.ndarray]:
        """All k data units from any k of the k + 1 (`length` = padded unit length)."""
        if m != 1:
            raise ValueError(f"XorCode has exactly one parity unit, got m={m}")
        _check_units(units, k, 1)
        missing = [i for i in range(k) if i not in units]
        out = [_padded(units[i], length) if i in units else None for i in range(k)]
        if missing:
            (lost,) = missing  # _check_units leaves at most one
            acc = _padded(units[k], length).copy()
            for i in range(k):
                if i != lost:
                    _xor_into(acc, out[i])
            out[lost] = acc
        return out  # type: ignore[return-value]


class ReedSolomonCode:
    """Reed-Solomon RS(k, m) (MDS: any k of k + m units rebuild the data) through pyeclib.

    pyeclib (BSD; its abi3 wheel bundles liberasurecode and Intel ISA-L) frames every fragment
    with a small header that its decoder checks. Data units stay raw, so each parity unit carries
    the headers of all k + 1 fragments it needs: `[k data headers | own header | parity payload]`.

    Args:
        num_parity: m, the number of lost units tolerated per stripe.
        ec_type: liberasurecode backend; `isa_l_rs_cauchy` is MDS for every (k, m).
    """

    name = "rs"

    def __init__(self, num_parity: int, ec_type: str = "isa_l_rs_cauchy") -> None:
        if num_parity < 1:
            raise ValueError(f"ReedSolomonCode needs num_parity >= 1, got {num_parity}")
        self.num_parity = num_parity
        self.ec_type = ec_type
        self._drivers: dict[int, Any] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ReedSolomonCode(num_parity={self.num_parity}, ec_type={self.ec_type!r})"

    def _driver(self, k: int) -> Any:
        with self._lock:
            if k not in self._drivers:
                try:
                    from pyeclib.ec_iface import ECDriver
                except ImportError as exc:  # optional at import time, required to use RS
                    raise ImportError(
                        "ReedSolomonCode needs pyeclib: pip install --no-deps pyeclib==1.8.0"
                    ) from exc
                self._drivers[k] = ECDriver(k=k, m=self.num_parity, ec_type=self.ec_type)
            return self._drivers[k]

    def encode(self, data_units: Sequence[Buffer]) -> list[np.ndarray]:
        """m parity units of `data_units` (zero-padded to the longest), headers included."""
        units = [as_u8(u) for u in data_units]
        k, m = len(units), self.num_parity
        length = max((u.size for u in units), default=0)
        if length == 0:
            return [np.zeros(0, dtype=np.uint8) for _ in range(m)]
        pieces: list[Buffer] = []
        for unit in units:
            pieces.append(memoryview(unit))
            if unit.size < length:
                pieces.append(bytes(length - unit.size))
        frags = self._driver(k).encode(b"".join(pieces))
        header = len(frags[0]) - length
        if len(frags) != k + m or any(len(f) != header + length for f in frags) or header < 0:
            raise ParityError(f"pyeclib {self.ec_type} split a stripe unexpectedly (k={k}, m={m})")
        data_headers = b"".join(f[:header] for f in frags[:k])
        return [np.frombuffer(data_headers + f, dtype=np.uint8) for f in frags[k:]]

    def decode(self, units: Mapping[int, Buffer], k: int, m: int, length: int) -> list[np.ndarray]:
        """All k data units (`length` bytes each) from any k of the k + m."""
        if m != self.num_parity:
            raise ValueError(f"{self!r} cannot decode a stripe with m={m}")
        _check_units(units, k, m)
        if all(i in units for i in range(k)):
            return [_padded(units[i], length) for i in range(k)]
        if length == 0:
            return [np.zeros(0, dtype=np.uint8) for _ in range(k)]
        parity = [as_u8(units[i]) for i in range(k, k + m) if i in units]
        header, rem = divmod(parity[0].size - length, k + 1)
        if rem or header <= 0:
            raise ParityError(f"parity unit of {parity[0].size} bytes does not fit length {length}")
        data_headers = parity[0][: k * header].tobytes()
        frags = []
        for i, unit in units.items():
            if i < k:
                frags.append(
                    data_headers[i * header : (i + 1) * header] + _padded(unit, length).tobytes()
                )
            else:
                frags.append(as_u8(unit)[k * header :].tobytes())
        from pyeclib.ec_iface import ECDriverError

        try:
            data = self._driver(k).decode(frags)
        except ECDriverError as exc:
            raise ParityError(f"Reed-Solomon decode failed (k={k}, m={m}): {exc}") from exc
        flat = np.frombuffer(data, dtype=np.uint8)
        if flat.size != k * length:
            raise ParityError(
                f"Reed-Solomon decode returned {flat.size} bytes, expected {k * length}"
            )
        return [flat[i * length : (i + 1) * length] for i in range(k)]


def make_code(name: str, num_parity: int) -> XorCode | ReedSolomonCode:
    """The code called `name` ("xor" or "rs") with `num_parity` parity units per stripe."""
    if name == "xor":
        if num_parity != 1:
            raise ValueError(f"xor parity tolerates one loss: set num_parity=1 (got {num_parity})")
        return XorCode()
    if name == "rs":
        return ReedSolomonCode(num_parity)
    raise ValueError(f"unknown erasure code {name!r}: use 'xor' or 'rs'")


# ---------------------------------------------------------------------------------------------
# Protect and rebuild


@dataclasses.dataclass(frozen=True)
class ParityUnit:
    """One parity unit as stored by its holder, with what a rebuild needs to trim the data."""

    stripe: int
    """Stripe of the layout this unit protects."""
    index: int
    """Parity index 0..m-1 (unit index k + index in the code)."""
    unit_length: int
    """Padded length of the stripe's data units (the longest segment)."""
    data_lengths: tuple[int, ...]
    """True length of each data unit, data position order."""
    payload: np.ndarray
    """Encoded bytes (uint8), opaque to everything but the code."""


def encode_stripe(
    layout: StripeLayout, code: ErasureCode, stripe: int, data_units: Sequence[Buffer]
) -> list[ParityUnit]:
    """The m parity units of `stripe` from its k data units (data position order)."""
    if len(data_units) != layout.num_data:
        raise ValueError(
            f"stripe {stripe} needs {layout.num_data} data units, got {len(data_units)}"
        )
    lengths = tuple(as_u8(u).size for u in data_units)
    payloads = code.encode(data_units)
    return [
        ParityUnit(stripe, i, max(lengths, default=0), lengths, p) for i, p in enumerate(payloads)
    ]


def recover_segment(
    layout: StripeLayout,
    code: ErasureCode,
    stripe: int,
    position: int,
    data_units: Mapping[int, Buffer],
    parity_units: Mapping[int, ParityUnit],
) -> np.ndarray:
    """The data unit at `position` of `stripe` (true length) from the available units.

    Args:
        data_units: data position -> unit, for the live data nodes (true lengths).
        parity_units: parity index -> unit, for the live parity holders.

    Raises:
        ParityError: fewer than k units are available, or the units disagree with each other.
    """
    k, m = layout.num_data, layout.num_parity
    if position in data_units:
        return as_u8(data_units[position])
    if not parity_units:
        raise ParityError(
            f"stripe {stripe}: no parity unit available (holders {layout.parity_nodes(stripe)} "
            f"lost or missing it): more than m={m} nodes of the parity group are lost"
        )
    meta = next(iter(parity_units.values()))
    for pos, unit in data_units.items():
        if as_u8(unit).size != meta.data_lengths[pos]:
            raise ParityError(
                f"stripe {stripe}: data unit {pos} has {as_u8(unit).size} bytes but parity was "
                f"built over {meta.data_lengths[pos]}: the blob changed since parity was made"
            )
    units: dict[int, Buffer] = dict(data_units)
    units.update({k + i: p.payload for i, p in parity_units.items()})
    try:
        decoded = code.decode(units, k, m, meta.unit_length)
    except ParityError as exc:
        raise ParityError(f"stripe {stripe}: {exc}") from exc
    return decoded[position][: meta.data_lengths[position]]


def protect(
    layout: StripeLayout, code: ErasureCode, blobs: Mapping[int, Buffer]
) -> dict[int, list[ParityUnit]]:
    """The parity units each node must store to protect every node's blob.

    Args:
        blobs: node -> its blob, for every node of the group.

    Returns:
        node -> the parity units it holds, `layout.parity_stripes(node)` order.
    """
    if sorted(blobs) != list(range(layout.num_nodes)):
        raise ValueError(f"protect needs the blob of every node 0..{layout.num_nodes - 1}")
    segments = {node: layout.split(blob) for node, blob in blobs.items()}
    held: dict[int, list[ParityUnit]] = {node: [] for node in range(layout.num_nodes)}
    for stripe in range(layout.num_nodes):
        data = [segments[j][layout.segment_stripe(j, stripe)[0]] for j in layout.data_nodes(stripe)]
        for unit in encode_stripe(layout, code, stripe, data):
            held[layout.parity_nodes(stripe)[unit.index]].append(unit)
    return held


def rebuild(
    layout: StripeLayout,
    code: ErasureCode,
    node: int,
    surviving_segments: Mapping[int, Sequence[Buffer]],
    parity_units: Mapping[int, Sequence[ParityUnit]],
    blob_length: int | None = None,
) -> bytes:
    """`node`'s blob, exactly, from the surviving nodes' segments and parity units.

    Args:
        node: the lost node.
        surviving_segments: live node -> its segments (`layout.split` of its blob).
        parity_units: live node -> the parity units it stores.
        blob_length: expected length of the result, checked when given.

    Raises:
        ParityError: more than m nodes of the group are lost (or their units are missing).
    """
    parts = []
    for q, (stripe, position) in enumerate(layout.node_segments(node)):
        data = {
            pos: surviving_segments[j][layout.segment_stripe(j, stripe)[0]]
            for pos, j in enumerate(layout.data_nodes(stripe))
            if j != node and j in surviving_segments
        }
        parity = {
            u.index: u
            for holder in layout.parity_nodes(stripe)
            for u in parity_units.get(holder, ())
            if u.stripe == stripe
        }
        try:
            parts.append(recover_segment(layout, code, stripe, position, data, parity))
        except ParityError as exc:
            raise ParityError(f"cannot rebuild node {node} (segment {q}): {exc}") from exc
    blob = b"".join(memoryview(p) for p in parts)
    if blob_length is not None and len(blob) != blob_length:
        raise ParityError(f"rebuilt node {node} has {len(blob)} bytes, expected {blob_length}")
    return blob


# ---------------------------------------------------------------------------------------------
# Costs and benchmark


def memory_overhead(num_nodes: int, num_parity: int) -> float:
    """Extra memory per protected byte with parity: m / (n - m)."""
    StripeLayout(num_nodes, num_parity)  # validates
    return num_parity / (num_nodes - num_parity)


def replication_overhead(num_failures: int) -> float:
    """Extra memory per protected byte with full replication tolerating `num_failures` losses."""
    if num_failures < 1:
        raise ValueError(f"num_failures must be >= 1, got {num_failures}")
    return float(num_failures)


def overhead_table(group_sizes: Sequence[int], num_parity: int) -> list[dict[str, float]]:
    """Parity vs full-replication memory overhead for each group size (rows for docs/bench)."""
    return [
        {
            "num_nodes": n,
            "num_parity": num_parity,
            "parity_overhead": memory_overhead(n, num_parity),
            "replication_overhead": replication_overhead(num_parity),
            "saving": replication_overhead(num_parity) / memory_overhead(n, num_parity),
        }
        for n in group_sizes
    ]


def encode_gbps(
    code: ErasureCode, nbytes: int, repeats: int = 3, num_data: int = 4, seed: int = 0
) -> float:
    """Encode throughput in GB/s (1e9 data bytes per second, best of `repeats` after a warm-up)."""
    if nbytes < num_data or repeats < 1:
        raise ValueError("encode_gbps needs nbytes >= num_data and repeats >= 1")
    unit = nbytes // num_data
    rng = np.random.default_rng(seed)
    units = [rng.integers(0, 256, unit, dtype=np.uint8) for _ in range(num_data)]
    code.encode(units)  # warm-up: allocator first touch, driver set-up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        code.encode(units)
        best = min(best, time.perf_counter() - start)
    return unit * num_data / best / 1e9
