"""`mecefo-smp`: the per-node snapshot management process (SMP), started by `mecefo-launch`.

It owns the node's snapshot folder on shared memory (trainers write their slots into it, see
`slots`), outlives trainer crashes, and protects the node's snapshot with erasure coding across
the nodes of its parity group (`parity.ParityService`): whenever every local rank holds a clean
snapshot of a newer step, it publishes the node's blob (the local ranks' slot files, each CRC
checked) to the parity holders. On start, a node whose folder holds no snapshot (a replacement
node, or its memory was lost) rebuilds it from the peers' parity before it reports ready.

    mecefo-smp --dir /dev/shm/mecefo-<run>/node0001 --node 1 --nnodes 3 --ranks 2,3 \\
        --coordinator HOST:PORT [--parity xor|rs|none] [--group K] [--rs-parity M]

It never deletes the folder (the agent does, once the job finished) and exits when its parent
(the agent) is gone or on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import struct
import sys
import threading
import time
from pathlib import Path

from megatron_mecefo.config.snapshot import SnapshotConfig
from megatron_mecefo.errors import SnapshotCorruptError
from megatron_mecefo.snapshot.slots import SlotPair

READY_MARKER = "smp.ready"
"""Written once the SMP finished its start-up (and any rebuild); trainers wait for it."""
SMP_ADDRESS_KEY = "smp/{node}"
"""Coordinator store key of a node's parity service address."""
_BLOB_HEAD = struct.Struct("<I")


def parity_groups(nnodes: int, group: int) -> list[list[int]]:
    """Consecutive node ranks in groups of `group` (0 = one group): `SnapshotConfig`'s."""
    return SnapshotConfig(parity_group=group).parity_groups(nnodes)


# ------------------------------------------------------------------ node blob
def node_blob(directory: Path, ranks: list[int], step: int) -> bytes | None:
    """The node's snapshot of `step`: a JSON index, then each local rank's slot bytes. None if
    a rank does not hold a clean, CRC-valid snapshot of `step`."""
    parts, index = [], []
    for rank in ranks:
        slot = SlotPair(directory, rank).clean_steps().get(step)
        if slot is None:
            return None
        try:
            head, raw = slot.read_raw(verify=True)
        except SnapshotCorruptError:
            return None  # being rewritten, or corrupt: never protect it
        if head.step != step:
            return None
        parts.append(raw)
        index.append({"rank": rank, "nbytes": len(raw)})
    head = json.dumps({"step": step, "slots": index}).encode()
    return _BLOB_HEAD.pack(len(head)) + head + b"".join(parts)


def restore_blob(directory: Path, blob: bytes) -> int:
    """Write a rebuilt node blob back as slot files; returns its step."""
    (hlen,) = _BLOB_HEAD.unpack_from(blob, 0)
    head = json.loads(blob[_BLOB_HEAD.size : _BLOB_HEAD.size + hlen])
    offset = _BLOB_HEAD.size + hlen
    directory.mkdir(parents=True, exist_ok=True)
    for item in head["slots"]:
        raw = blob[offset : offset + item["nbytes"]]
        offset += item["nbytes"]
        path = SlotPair(directory, item["rank"]).slots[0].path
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(raw)
        tmp.replace(path)
    return int(head["step"])


def newest_common_step(directory: Path, ranks: list[int]) -> int | None:
    common = None
    for rank in ranks:
        steps = set(SlotPair(directory, rank).clean_steps())
        common = steps if common is None else common & steps
    return max(common) if common else None


# ------------------------------------------------------------------ process
class SnapshotProcess:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.dir = Path(args.dir)
        self.ranks = [int(r) for r in args.ranks.split(",") if r != ""]
        self.service = None
        self.published: int | None = None
        self.stop = threading.Event()

    def log(self, msg: str) -> None:
        print(f"[smp {self.args.node}] {msg}", flush=True)

    def start(self) -> None:
        from megatron_mecefo.control import keys

        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / READY_MARKER).unlink(missing_ok=True)
        group = next(
            g for g in parity_groups(self.args.nnodes, self.args.group) if self.args.node in g
        )
        if self.args.parity != "none" and len(group) >= 2:
            from megatron_mecefo.snapshot import codec
            from megatron_mecefo.snapshot.parity import ParityService

            m = 1 if self.args.parity == "xor" else self.args.rs_parity
            if m >= len(group):
                raise SystemExit(
                    f"error: {self.args.parity} parity with {m} parity units needs more than "
                    f"{m} nodes per group, the group has {len(group)}"
                )
            store = keys.connect(self.args.coordinator, 30.0)

            def peers() -> dict[int, str]:
                out = {}
                for i, node in enumerate(group):
                    key = SMP_ADDRESS_KEY.format(node=node)
                    if store.check([key]):
                        out[i] = store.get(key).decode()
                return out

            self.service = ParityService(
                group.index(self.args.node),
                codec.StripeLayout(len(group), m),
                codec.make_code(self.args.parity, m),
                self.dir / "parity",
                peers,
                lambda step: node_blob(self.dir, self.ranks, step),
                log=self.log,
                host=self.args.host,
            )
            self.service.start()
            store.set(SMP_ADDRESS_KEY.format(node=self.args.node), self.service.address)
            self.log(
                f"parity {self.args.parity} over nodes {group} (m = {m}), serving on "
                f"{self.service.address}"
            )
            if newest_common_step(self.dir, self.ranks) is None:
                self._rebuild()
        (self.dir / READY_MARKER).write_text(str(os.getpid()))

    def _rebuild(self) -> None:
        from megatron_mecefo.errors import CheckpointError
        from megatron_mecefo.snapshot.paths import REBUILT_MARKER

        t0 = time.perf_counter()
        try:
            step, blob = self.service.rebuild()
        except CheckpointError as exc:
            self.log(f"no snapshot here and none rebuildable from parity ({exc})")
            return
        restore_blob(self.dir, blob)
        elapsed = time.perf_counter() - t0
        marker = {"step": step, "bytes": len(blob), "seconds": elapsed}
        (self.dir / REBUILT_MARKER).write_text(json.dumps(marker))
        self.log(
            f"rebuilt this node's snapshot of step {step} from parity: "
            f"{len(blob) / 1e6:.2f} MB in {1000 * elapsed:.0f} ms"
        )

    def run(self) -> int:
        parent = os.getppid()
        while not self.stop.is_set() and os.getppid() == parent:
            if self.service is not None:
                step = newest_common_step(self.dir, self.ranks)
                if step is not None and step != self.published:
                    blob = node_blob(self.dir, self.ranks, step)
                    if blob is not None:
                        self.service.publish(step, memoryview(blob))
                        self.service.flush(self.args.publish_timeout_s)
                        self.published = step
            self.stop.wait(self.args.poll_s)
        if self.service is not None:
            self.service.close()
        return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mecefo-smp", description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="this node's snapshot folder (shared memory)")
    p.add_argument("--node", type=int, required=True, help="this node's rank")
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--ranks", required=True, help="comma-separated global ranks on this node")
    p.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator store")
    p.add_argument("--parity", choices=("xor", "rs", "none"), default="xor")
    p.add_argument("--group", type=int, default=0, help="nodes per parity group (0 = all)")
    p.add_argument("--rs-parity", type=int, default=2)
    p.add_argument("--host", default=os.environ.get("MECEFO_SMP_HOST", "127.0.0.1"))
    p.add_argument("--poll-s", type=float, default=0.05)
    p.add_argument("--publish-timeout-s", type=float, default=30.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    smp = SnapshotProcess(args)
    signal.signal(signal.SIGTERM, lambda signum, frame: smp.stop.set())
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    smp.start()
    return smp.run()


if __name__ == "__main__":
    sys.exit(main())
