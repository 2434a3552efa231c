"""The run's `events.jsonl`, written by the coordinator from the events posted to the store.

Any process posts an event (`control.records.post_event`: the counter, then the value); the
coordinator copies them, in order, into the run directory once the first leader has published it
(`keys.RUN_DIR`). Each line carries its `seq`, so a restarted coordinator continues after the
last line its predecessor wrote, and a resumed run appends after the lines of earlier launches
(`keys.JOB_EVENTS_START`). The line format is `metrics/events.py`'s.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from megatron_mecefo.control import keys
from megatron_mecefo.errors import ConfigError
from megatron_mecefo.metrics.events import EventWriter

EVENT_WAIT_S = 5.0
"""How long a posted event number may lack its value before it is skipped (its poster died)."""


class EventLog:
    """Copies posted events into `events.jsonl` (`drain` every tick; `close` drains once more)."""

    def __init__(self, store, *, log=print):
        self.store = store
        self.log = log
        self.writer: EventWriter | None = None
        self.next_event = 1
        self._missing: dict[int, float] = {}  # event index -> first seen without a value
        self._marked: int | None = None  # the EVENTS_WRITTEN this instance last set

    def drain(self) -> None:
        if self.writer is None:
            if not self.store.check([keys.RUN_DIR]):
                return
            run_dir, _, start = self.store.get(keys.RUN_DIR).decode().rpartition("|")
            path = Path(run_dir) / "events.jsonl"
            ours = keys.get_int(self.store, keys.JOB_EVENTS_START)  # earlier launches end here
            self.next_event = max(self.next_event, last_seq(path, ours) + 1)
            self.writer = EventWriter(path, float(start))
        last = keys.get_int(self.store, keys.EVENT_SEQ, 0)
        self._copy(last)
        if self.next_event - 1 != self._marked:  # the job's leader waits for this before it ends
            self.store.set(keys.EVENTS_WRITTEN, str(self.next_event - 1))
            self._marked = self.next_event - 1

    def _copy(self, last: int) -> None:
        while self.next_event <= last:
            key = keys.event(self.next_event)
            if not self.store.check([key]):  # posted counter first, value next: next tick
                since = self._missing.setdefault(self.next_event, time.monotonic())
                if time.monotonic() - since < EVENT_WAIT_S:
                    return
                self.log(
                    f"[coordinator] event {self.next_event} was never written (its poster "
                    f"died between the two store calls); skipping it"
                )
                self.next_event += 1
                continue
            ev = json.loads(self.store.get(key))
            epoch = ev.pop("epoch_s")
            ev_type = ev.pop("type")
            # `seq` lets a restarted coordinator skip what its predecessor wrote before dying
            try:
                self.writer.write(ev_type, time_s=epoch, seq=self.next_event, **ev)
            except ConfigError as exc:  # a bad event must not crash-loop the coordinator
                self.log(f"[coordinator] event {self.next_event} is invalid, skipped: {exc}")
            self.next_event += 1

    def close(self) -> None:
        try:
            self.drain()
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
        if self.writer is not None:
            self.writer.close()


def last_seq(path: Path, start: int = 0) -> int:
    """The `seq` of the last complete line of an events file after byte `start` (0 if none)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(start, fh.tell() - 65536))
            lines = fh.read().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line).get("seq", 0))
        except (ValueError, AttributeError):
            continue
    return 0
