"""The job-wide summary: rebuilt from the job's metric rows, and checked against them."""

from __future__ import annotations

import json

import pytest

from megatron_mecefo.metrics.summary import check_summary, job_wide

pytestmark = pytest.mark.timeout(30)


def _rows(path, steps, *, degraded=(), short=()):
    with open(path, "w") as fh:
        for s in steps:
            row = {
                "step": s,
                "loss": 10.0 - s,
                "tokens_per_s": 100.0 + s,
                "global_microbatches": 6 if s in short else 8,
                "job_degraded": s in degraded,
            }
            if s % 5 == 4:
                row["val_loss"] = 9.0 - s
            fh.write(json.dumps(row) + "\n")
        fh.write('{"step": 99, "loss"')  # a line cut short by a crash is ignored


def test_a_restarted_leader_summarises_the_whole_job(tmp_path):
    _rows(tmp_path / "metrics.jsonl", range(10), degraded={3, 4, 5})
    local = {  # what a leader restarted at step 6 saw itself
        "steps": 4,
        "first_loss": 4.0,
        "final_loss": 1.0,
        "val_losses": [[9, 0.0]],
        "final_val_loss": 0.0,
        "failover": {"steps_degraded": 0, "samples_lost": 0, "failures": 1},
    }
    out = job_wide(local, tmp_path / "metrics.jsonl", start_step=0, expected_microbatches=8)
    assert (out["steps"], out["first_loss"], out["final_loss"]) == (10, 10.0, 1.0)
    assert out["val_losses"] == [(4, 5.0), (9, 0.0)] and out["final_val_loss"] == 0.0
    assert out["failover"]["steps_degraded"] == 3 and out["failover"]["failures"] == 1
    assert out["mean_tokens_per_s"] == pytest.approx(sum(100.0 + s for s in range(1, 10)) / 9)
    resumed = job_wide(local, tmp_path / "metrics.jsonl", start_step=6, expected_microbatches=8)
    assert (resumed["steps"], resumed["first_loss"], resumed["start_step"]) == (4, 4.0, 6)


def test_samples_lost_are_counted_from_every_row(tmp_path):
    _rows(tmp_path / "metrics.jsonl", range(5), short={2})
    out = job_wide(
        {"failover": {}}, tmp_path / "metrics.jsonl", start_step=0, expected_microbatches=8
    )
    assert out["failover"]["samples_lost"] == 2


def _events(path, events):
    """Lines as the coordinator writes them (each with its `seq`, 1-based per launch)."""
    with open(path, "a") as fh:
        for seq, event in enumerate(events, start=1):
            fh.write(json.dumps({**event, "seq": seq}) + "\n")


def test_check_summary_names_each_disagreement(tmp_path):
    _rows(tmp_path / "metrics.jsonl", range(10), degraded={3})
    events = [
        {"type": "failure"},
        {"type": "detection", "latency_ms": 40.0},
        {"type": "step_redone"},
        {"type": "rejoin"},
    ]
    _events(tmp_path / "events.jsonl", events)
    good = job_wide(
        {"failover": {"samples_lost": 0}},
        tmp_path / "metrics.jsonl",
        start_step=0,
        expected_microbatches=8,
        events=events,
        events_seq=4,
    )
    assert good["failover"]["steps_redone"] == 1 and good["failover"]["detection_ms"] == [40.0]
    (tmp_path / "summary.json").write_text(json.dumps(good))
    assert check_summary(tmp_path) == []
    bad = {
        **good,
        "steps": 4,
        "first_loss": 4.0,
        "failover": {**good["failover"], "failures": 0, "steps_degraded": 0, "steps_redone": 0},
    }
    (tmp_path / "summary.json").write_text(json.dumps(bad))
    problems = check_summary(tmp_path)
    assert len(problems) == 5, problems
    assert any("steps 4 but metrics.jsonl has 10" in p for p in problems)
    assert any("failover.failures = 0 but events.jsonl has 1" in p for p in problems)
    assert any("failover.steps_redone = 0 but events.jsonl has 1" in p for p in problems)


def test_check_summary_reads_only_this_launchs_events(tmp_path):
    """A resumed run appends to events.jsonl: the summary counts the events of its own launch
    (from the line where it began, up to the last one it saw), and so does the check."""
    _rows(tmp_path / "metrics.jsonl", range(6, 10))
    earlier = [{"type": "failure"}, {"type": "rejoin"}, {"type": "failure"}]
    _events(tmp_path / "events.jsonl", earlier)  # the first launch
    start = (tmp_path / "events.jsonl").stat().st_size
    ours = [{"type": "failure"}, {"type": "step_redone"}]
    # this launch (seq from 1 again), and a rejoin posted after the leader wrote the summary
    _events(tmp_path / "events.jsonl", [*ours, {"type": "rejoin"}])
    summary = job_wide(
        {"failover": {"samples_lost": 0}},
        tmp_path / "metrics.jsonl",
        start_step=6,
        expected_microbatches=8,
        events=ours,
        events_seq=2,
        events_start=start,
    )
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert check_summary(tmp_path) == []  # the late rejoin (seq 3 > events_seq) is not counted
    fo = summary["failover"]
    (tmp_path / "summary.json").write_text(
        json.dumps({**summary, "failover": {**fo, "events_start": 0}})
    )
    assert any("failover.failures = 1 but events.jsonl has 2" in p for p in check_summary(tmp_path))


def test_node_losses_and_replacements_are_counted_with_time_to_full_strength(tmp_path):
    """Spare nodes (failover/authority/spare_pool.py): `node_lost` and `node_replaced` events are
    counted, and each replacement's `latency_ms` (failure -> every rank back) gives
    full_strength_ms and its max and median; check_summary names a summary that disagrees with
    events.jsonl."""
    _rows(tmp_path / "metrics.jsonl", range(10))
    events = [
        {"type": "node_lost", "ranks": [2, 3], "epoch_s": 1.0},
        {"type": "failure", "dp_rank": 2},
        {"type": "node_replaced", "ranks": [2, 3], "latency_ms": 5412.34},
        {"type": "node_lost", "ranks": [4, 5], "epoch_s": 9.0},
        {"type": "node_lost", "ranks": [6, 7], "epoch_s": 9.5},  # no standby left for this one
        {"type": "node_replaced", "ranks": [4, 5], "latency_ms": 7000.0},
        {"type": "node_replaced", "ranks": [0, 1], "latency_ms": 6100.0},
        {"type": "node_lost", "ranks": [0, 1], "epoch_s": 20.0},  # still lost at the end
    ]
    _events(tmp_path / "events.jsonl", events)
    summary = job_wide(
        {"failover": {"samples_lost": 0}},
        tmp_path / "metrics.jsonl",
        start_step=0,
        expected_microbatches=8,
        events=events,
        events_seq=len(events),
    )
    fo = summary["failover"]
    assert (fo["nodes_lost"], fo["nodes_replaced"], fo["failures"]) == (4, 3, 1), fo
    assert fo["full_strength_ms"] == [5412.3, 7000.0, 6100.0], fo
    assert (fo["full_strength_ms_max"], fo["full_strength_ms_median"]) == (7000.0, 6100.0), fo
    assert fo["detection_ms"] == []  # node_replaced's latency is not a detection's
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert check_summary(tmp_path) == []
    for key, value, problem in (
        ("nodes_lost", 3, "failover.nodes_lost = 3 but events.jsonl has 4"),
        ("nodes_replaced", 0, "failover.nodes_replaced = 0 but events.jsonl has 3"),
        ("full_strength_ms", [5412.3], "failover.full_strength_ms has 1 latencies but"),
        ("full_strength_ms_max", 6100.0, "failover.full_strength_ms_max = 6100.0 but"),
        ("full_strength_ms_median", None, "failover.full_strength_ms_median = None but"),
    ):
        bad = {**summary, "failover": {**fo, key: value}}
        (tmp_path / "summary.json").write_text(json.dumps(bad))
        problems = check_summary(tmp_path)
        assert len(problems) == 1 and problem in problems[0], (key, problems)


def test_a_job_without_node_events_counts_zero_and_no_time_to_full_strength(tmp_path):
    _rows(tmp_path / "metrics.jsonl", range(3))
    events = [{"type": "failure"}, {"type": "detection", "latency_ms": 12.0}]
    fo = job_wide(
        {"failover": {"samples_lost": 0}},
        tmp_path / "metrics.jsonl",
        start_step=0,
        expected_microbatches=8,
        events=events,
        events_seq=2,
    )["failover"]
    assert (fo["nodes_lost"], fo["nodes_replaced"], fo["full_strength_ms"]) == (0, 0, [])
    assert fo["full_strength_ms_max"] is None and fo["full_strength_ms_median"] is None


def test_posted_events_reads_the_store_not_the_file():
    """The leader counts the posted events from the store itself: it never depends on how far the
    coordinator has copied them to events.jsonl, and waits (bounded) for one whose counter was
    bumped but whose value is not written yet."""
    import datetime
    import time

    import torch.distributed as dist

    from megatron_mecefo.control import keys
    from megatron_mecefo.control.records import post_event, posted_events

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(5)
    )
    post_event(store, "failure", step=3, dp_rank=1)
    post_event(store, "step_redone", step=3, dp_rank=None)
    store.add(keys.EVENT_SEQ, 1)  # a poster that died between its two writes
    t0 = time.monotonic()
    events, seq = posted_events(store, wait_s=0.3)
    assert [e["type"] for e in events] == ["failure", "step_redone"] and seq == 3
    assert 0.3 <= time.monotonic() - t0 < 2.0


def test_a_new_leader_writes_the_step_its_dead_predecessor_never_logged(tmp_path):
    """The leader died after step 10 committed but before logging it; the next leader holds the
    same record and writes it before its own first row: every step is logged once."""
    from megatron_mecefo.metrics.config import LoggingConfig
    from megatron_mecefo.metrics.logger import MetricsLogger

    lead = {"now": "a"}
    a, b = (
        MetricsLogger(
            LoggingConfig(print_interval=0),
            tmp_path,
            enabled=True,
            total_steps=20,
            writer=lambda who=who: lead["now"] == who,
        )
        for who in ("a", "b")
    )
    row = lambda s: {"step": s, "loss": 1.0 / (s + 1), "tokens_per_s": 1.0}  # noqa: E731
    for s in range(10):
        a.log_step(row(s))
        b.log_step(row(s))
    b.log_step(row(10))  # a died before logging step 10
    lead["now"] = "b"
    b.log_step(row(11))
    b.log_step(row(12))
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(13))


def test_an_event_missing_from_events_jsonl_is_named(tmp_path):
    """A coordinator_restart line the coordinator never wrote (it was killed before draining):
    no counter covers that type, but the summary's event count does."""
    _rows(tmp_path / "metrics.jsonl", range(3))
    events = [{"type": "coordinator_restart"}, {"type": "coordinator_restart"}]
    summary = job_wide(
        {"failover": {"samples_lost": 0}},
        tmp_path / "metrics.jsonl",
        start_step=0,
        expected_microbatches=8,
        events=events,
        events_seq=2,
    )
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    _events(tmp_path / "events.jsonl", events)
    assert check_summary(tmp_path) == []
    (tmp_path / "events.jsonl").unlink()
    _events(tmp_path / "events.jsonl", events[:1])
    (problem,) = check_summary(tmp_path)
    assert "failover.events = 2 but events.jsonl has 1" in problem


FIRST_HOUR_KILL_EVENTS = [  # events.jsonl of the README's first-hour kill job (issue 32, item 7)
    {"type": "failure", "step": 15, "dp_rank": 1, "time_s": 1.111, "ranks": [1]},
    {"type": "detection", "step": 15, "dp_rank": 1, "time_s": 1.436, "latency_ms": 324.85},
    {"type": "step_redone", "step": 15, "dp_rank": None, "generation": 1, "attempt": 0},
    {"type": "regroup", "step": 15, "dp_rank": 1, "generation": 2, "latency_ms": 335.27},
    {"type": "takeover", "step": 15, "dp_rank": None, "generation": 2},
    {"type": "regroup", "step": 28, "dp_rank": 1, "generation": 3},
    {
        "type": "rejoin",
        "step": 28,
        "dp_rank": 1,
        "generation": 3,
        "latency_ms": 410.79,
        "ranks": [1],
        "detail": "state of step 28 from replica 0: 2.02 MB in 21 ms (96.0 MB/s)",
        "bytes": 2017827,
        "transfer_ms": 21.019,
    },
]


def test_rejoin_and_regroup_fields_are_the_jobs_not_the_leaders(tmp_path):
    """Issue 32, item 7: the leader (rank 0) formed generations 1, 2 and 3 and received no state;
    the job had 2 regroup events and one 2.02 MB rejoin. The summary says what the events say,
    and check_summary names a summary that holds the leader's own view instead."""
    _rows(tmp_path / "metrics.jsonl", range(40))
    events = FIRST_HOUR_KILL_EVENTS
    _events(tmp_path / "events.jsonl", events)
    leader = {"regroups": 3, "rejoin_bytes": 0, "rejoin_s": None, "final_generation": 3}
    summary = job_wide(
        {"failover": leader},
        tmp_path / "metrics.jsonl",
        start_step=0,
        expected_microbatches=8,
        events=events,
        events_seq=len(events),
    )
    fo = summary["failover"]
    assert (fo["regroups"], fo["rejoin_bytes"], fo["rejoin_s"]) == (2, 2017827, 0.021), fo
    assert fo["final_generation"] == 3  # what only a process knows is kept
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert check_summary(tmp_path) == []
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "failover": {**fo, **leader}}))
    problems = check_summary(tmp_path)
    assert sorted(problems) == [
        "failover.regroups = 3 but events.jsonl has 2",
        "failover.rejoin_bytes = 0 but events.jsonl says 2017827",
        "failover.rejoin_s = None but events.jsonl says 0.021",
    ], problems


def test_rejoin_fields_sum_the_bytes_and_keep_the_longest_transfer(tmp_path):
    _rows(tmp_path / "metrics.jsonl", range(3))
    events = [
        {"type": "rejoin", "bytes": 1000, "transfer_ms": 40.0},
        {"type": "rejoin", "bytes": 500, "transfer_ms": 95.5},
        {"type": "rejoin"},  # an older line without the transfer's fields
    ]
    fo = job_wide(
        {"failover": {}},
        tmp_path / "metrics.jsonl",
        start_step=0,
        expected_microbatches=8,
        events=events,
        events_seq=3,
    )["failover"]
    assert (fo["rejoins"], fo["rejoin_bytes"], fo["rejoin_s"]) == (3, 1500, 0.096), fo
    none = job_wide(
        {"failover": {}},
        tmp_path / "metrics.jsonl",
        start_step=0,
        expected_microbatches=8,
        events=[],
        events_seq=0,
    )["failover"]
    assert (none["regroups"], none["rejoin_bytes"], none["rejoin_s"]) == (0, 0, None)
