"""`tools/bench/control_plane.py`, its pure parts: the protocol's request counts, the node and
generation records it writes (against what the product's coordinator writes and reads), its timed
coordinator, and the product's `Coordinator` driven over an in-memory store with the bench's
clients' records: it forms generations, removes an exited rank's replica, and its requests per
tick do not grow with the number of ranks. No store server or process starts here."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

from megatron_mecefo.control import keys
from megatron_mecefo.control.keys import node_key
from megatron_mecefo.control.records import GenerationRecord, NodeReport, RankEntry
from megatron_mecefo.failover.authority.coordinator import Coordinator
from megatron_mecefo.failover.liveness.detector import DetectorConfig
from megatron_mecefo.failover.liveness.evidence import NodeWatch

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(60)


def _load_tool():
    spec = importlib.util.spec_from_file_location(
        "bench_control_plane", ROOT / "tools/bench/control_plane.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_control_plane"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


cp = _load_tool()
model = sys.modules["control_plane_model"]  # the job's model, split from the tool


class MemStore:
    """The TCPStore calls the coordinator makes, on a dict (get of a missing key raises)."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def check(self, names):
        return all(k in self.data for k in names)

    def get(self, key):
        return self.data[key]

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def add(self, key, n):
        value = int(self.data.get(key, b"0")) + n
        self.data[key] = str(value).encode()
        return value

    def append(self, key, value):
        self.data[key] = self.data.get(key, b"") + value.encode()

    def multi_get(self, names):
        return [self.data[k] for k in names]

    def multi_set(self, names, values):
        for k, v in zip(names, values):
            self.set(k, v)

    def compare_set(self, key, expected, desired):
        current = self.data.get(key)
        if (current is None and expected == "") or current == expected.encode():
            self.set(key, desired)
            return desired.encode()
        return expected.encode() if current is None else current

    def delete_key(self, key):
        return self.data.pop(key, None) is not None


# ------------------------------------------------------------------------------ request counts
def test_offered_rps_counts_every_request_of_each_protocol():
    layout = cp.Layout(16384, 8)
    a = cp.offered_rps("a", layout, step_s=2.0)
    # per rank: 5 requests a beat every 0.2 s + 2 progress sets a 2 s step
    assert a["ranks"] == pytest.approx(16384 * (5 / 0.2 + 2 / 2.0))
    # per node, the same agent as in b: set node/<i> + one multi_get every 0.1 s
    assert a["agents"] == pytest.approx(2048 * 2 / 0.1)
    assert a["total"] == pytest.approx(425984 + 40960)
    b = cp.offered_rps("b", layout, step_s=2.0)
    # 2048 nodes x (set + multi_get) / 0.1 s
    assert b == {"ranks": 0.0, "agents": pytest.approx(40960), "total": pytest.approx(40960)}
    with pytest.raises(ValueError):
        cp.offered_rps("c", layout, step_s=2.0)


def test_server_cores_is_offered_load_times_cost():
    assert cp.server_cores(100_000, 8.0) == pytest.approx(0.8)
    assert cp.server_cores(100_000, None) is None


def test_live_nodes_are_bounded_and_every_node_has_one_worker():
    layout = cp.Layout(16384, 8)
    per_node_a = cp.offered_rps("a", layout, step_s=2.0)["total"] / layout.nodes
    assert cp.live_nodes("a", layout, step_s=2.0, client_rps=20000) == int(20000 // per_node_a)
    assert cp.live_nodes("b", layout, step_s=2.0, client_rps=1e9) == layout.nodes
    assert cp.live_nodes("a", layout, step_s=2.0, client_rps=1) == 4
    plan = cp.assign_nodes(layout, 60, 3)
    nodes = [n for part in plan for n in part["live"] + part["bulk"]]
    assert sorted(nodes) == list(range(layout.nodes))
    assert [len(part["live"]) for part in plan] == [20, 20, 20]


def test_percentile_and_tick_summary():
    assert cp.percentile([], 50) is None
    assert cp.percentile([3, 1, 2, 4], 50) == 2
    assert cp.percentile(range(1, 101), 99) == 99
    # (start, wall, reads heartbeats, requests, store s, cpu s)
    ticks = [(0.0, 0.03, True, 12, 0.01, 0.02), (0.05, 0.01, False, 3, 0.0, 0.01)]
    ticks += [(0.2, 0.05, True, 14, 0.02, 0.04), (0.25, 0.01, False, 3, 0.0, 0.01)]
    out = cp.tick_summary(ticks)
    assert out["hb_tick_s"]["max"] == 0.05
    assert out["hb_tick_cpu_s"]["p50"] == 0.02
    assert out["light_tick_s"]["p50"] == 0.01
    assert out["hb_read_period_s"]["p50"] == pytest.approx(0.2)
    assert out["requests_per_hb_tick"] == 12


# ---------------------------------------------------------------------------------- formats
def test_generation_record_is_what_the_coordinator_publishes(tmp_path):
    _, store, coord = _mode_b(tmp_path, 64)
    coord.tick()  # every rank registered: the first generation
    raw = store.get(keys.gen_record(1)).decode()
    published = GenerationRecord.from_json(raw)
    ours = cp.generation_record(cp.Layout(64, 8))
    assert list(json.loads(ours)) == list(json.loads(raw))  # the same fields, in the same order
    assert dataclasses.replace(
        GenerationRecord.from_json(ours), epoch_s=0.0
    ) == dataclasses.replace(published, epoch_s=0.0)
    big = cp.generation_record(cp.Layout(16384, 8))
    assert 150_000 < len(big) < 250_000  # what each of 16k trainers reads at a new generation


def test_removed_replicas_reads_what_the_record_type_writes():
    assert model.removed_replicas(cp.generation_record(cp.Layout(16384, 8))) == []
    for removed in ([1], [1, 3], list(range(0, 2048, 7))):
        members = [r for r in range(2048) if r not in removed]
        incarnations = {str(r): 1 for r in range(64)}
        rec = GenerationRecord(members, removed, [5], "failure", 8, 1.5, 1.0, 9, incarnations)
        assert model.removed_replicas(rec.to_json()) == removed


def test_node_reports_in_both_formats():
    inc = {8: 2}
    a = cp.report_template("a", [8, 9], inc) % {"seq": "2:5", "hb": 7, "progress": "3:compute"}
    watch = NodeWatch(5.0)
    watch.update(1, NodeReport.from_json(a), now=10.0)  # the format the coordinator reads
    assert watch.node_of == {8: 1, 9: 1}
    entries = {8: model.rank_entry(8, 2), 9: model.rank_entry(9, 0)}
    assert a == NodeReport("2:5", entries).to_json()
    b = cp.report_template("b", [8, 9], inc) % {"seq": "2:5", "hb": 7, "progress": "3:reduce"}
    entries[8].beats, entries[8].progress = 7, "2:3:reduce"
    entries[9].beats, entries[9].progress = 7, "0:3:reduce"
    assert b == NodeReport("2:5", entries).to_json()
    assert NodeReport.from_json(b).ranks[8] == RankEntry(2, 100008, "S", 1, 7, "2:3:reduce")
    assert model.progress_now(100.0, 2.0, 105.0) == "2:compute"
    assert model.progress_now(100.0, 2.0, 105.6) == "2:reduce"


# ------------------------------------------------------------------- the coordinator, mode b
def _mode_b(tmp_path: Path, ranks: int, cls=None):
    layout = cp.Layout(ranks, 8)
    store = model.CountingStore(MemStore())
    cp._populate(store, "b", layout, str(tmp_path), 8)
    cls = cls or Coordinator
    coord = cls(store, ranks, DetectorConfig(grace_s=0.0), log=lambda m: None)
    coord.restore()
    return layout, store, coord


def test_aggregated_coordinator_forms_generations_and_removes_an_exited_rank(tmp_path):
    layout, store, coord = _mode_b(tmp_path, 64)
    coord.tick()
    assert coord.gen == 1 and coord.members == tuple(range(8))
    assert coord.ranks[9].node == 1 and coord.ranks[9].hb_value == 0
    # node 1's agent reports a beat: the coordinator reads it from the node report alone
    beat = cp.report_template("b", list(layout.node_ranks(1)), {}) % {
        "seq": "2:1",
        "hb": 5,
        "progress": "0:compute",
    }
    store.set(node_key(1), beat)
    coord.tick()
    coord.tick()
    assert coord.ranks[9].hb_value == 5 and coord.ranks[9].progress == "0:0:compute"
    # rank 10 exits: its agent reports it (dead key, then the log, then the counter)
    store.set(keys.dead(10), f"0:{time.time()}")
    store.append(cp.DEAD_LOG, "10,")
    store.add(keys.DEAD_SEQ, 1)
    coord.tick()
    assert coord.gen == 2 and 1 not in coord.members
    raw = store.get(keys.gen_record(2)).decode()
    record = GenerationRecord.from_json(raw)
    assert record.removed == [1] and record.reason == "failure"
    assert model.removed_replicas(raw) == [1]  # what the bench's clients read of it
    # rank 10 comes back with incarnation 1 (registration log, then the counter)
    reg = json.loads(store.get(keys.registration(10)))
    store.set(keys.registration(10), json.dumps({**reg, "incarnation": 1}))
    for r in layout.node_ranks(1):
        if r != 10:
            store.set(keys.registration(r), json.dumps({**reg, "incarnation": 1}))
    store.append(cp.REG_LOG, "".join(f"{r}," for r in layout.node_ranks(1)))
    store.add(keys.REG_SEQ, 1)
    back = cp.report_template(
        "b", list(layout.node_ranks(1)), dict.fromkeys(layout.node_ranks(1), 1)
    )
    store.set(node_key(1), back % {"seq": "2:2", "hb": 1, "progress": "1:compute"})
    for _ in range(2):
        coord.tick()
    assert coord.gen == 3 and 1 in coord.members


def test_timed_coordinator_times_each_tick_of_its_own_loop(tmp_path):
    layout = cp.Layout(64, 8)
    store = model.CountingStore(MemStore())
    cp._populate(store, "b", layout, str(tmp_path), 8)
    after = []
    coord = model.TimedCoordinator(
        store, 64, DetectorConfig(poll_s=0.001), log=lambda m: None, on_tick=lambda: after.append(1)
    )
    coord.restore()
    assert coord.run(lambda: coord.ticks >= 5) == "stopped"
    assert coord.gen == 1 and len(coord.timings) == 5 == len(after)
    # heartbeats are read before the first generation, then every other tick
    assert [t[2] for t in coord.timings] == [True, True, False, True, False]
    requests = [t[3] for t in coord.timings]
    assert requests[1] > requests[2] and requests[3] > requests[4]  # the reads are real
    starts = [t[0] for t in coord.timings]
    assert starts == sorted(starts) and all(t[1] >= 0 and t[5] >= 0 for t in coord.timings)


def _hb_tick_requests(coord, store) -> int:
    coord.tick()  # the first generation
    coord.tick()  # the first death-report scan (today's: one check per rank, once)
    counts = []
    for _ in range(2):
        before = store.requests
        coord.tick()
        counts.append(store.requests - before)
    return max(counts)  # the tick that reads heartbeats


class _KeyLog:
    """Records every key the coordinator asks the store for."""

    def __init__(self, store):
        self.store, self.keys = store, []
        for name in model.CountingStore.OPS:
            setattr(self, name, self._wrap(getattr(store, name)))

    @property
    def requests(self) -> int:
        return self.store.requests

    def _wrap(self, fn):
        def call(names, *args):
            self.keys += names if isinstance(names, list) else [names]
            return fn(names, *args)

        return call


def test_aggregated_reads_do_not_grow_with_ranks_and_read_no_rank_key(tmp_path):
    counts = {}
    for mode in ("a", "b"):
        for ranks in (64, 512):
            store = model.CountingStore(MemStore())
            cp._populate(store, mode, cp.Layout(ranks, 8), str(tmp_path), 8)
            logged = _KeyLog(store)
            coord = Coordinator(logged, ranks, DetectorConfig(), log=lambda m: None)
            coord.restore()
            logged.keys.clear()
            counts[mode, ranks] = _hb_tick_requests(coord, logged)
            per_rank = [k for k in logged.keys if k.startswith(("hb/", "progress/", "reg/0"))]
            # mode b: the node reports carry every beat: no request names a rank's key
            assert (mode == "b") == (not per_rank), (mode, per_rank[:3])
    assert counts["b", 64] == counts["b", 512] < 20
    assert counts["a", 64] == counts["a", 512] < 20  # batched too, but N keys in each multi_get


def test_tables_render_missing_values(tmp_path):
    rows = [
        {"mode": "a", "ranks": 1024, "error": "no first generation within 120 s"},
        {"mode": "b", "ranks": 1024, "live_ranks": 1024, "silent": {"detection_s": 3.2}},
    ]
    text = cp.format_tables(rows)
    assert "no first generation" in text and "3.20" in text and "n/a" in text
    real = cp.format_real([{"nproc": 32, "skipped": "needs ~14 GB"}])
    assert "needs ~14 GB" in real
