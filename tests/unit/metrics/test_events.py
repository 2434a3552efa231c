"""events.jsonl: EventWriter -> read_events round trip, replay by `mecefo-sim`, and validation."""

from __future__ import annotations

import json
import math
import re
import time

import pytest

from megatron_mecefo.errors import ConfigError, ExitCode
from megatron_mecefo.metrics.events import EVENT_TYPES, Event, EventWriter, read_events
from megatron_mecefo.sim import events as sim_events
from megatron_mecefo.sim.cli import main


def _write_run(path, run_start):
    """A failure of DP rank 1 'now' (about 100 s into the run), then its handling and rejoin."""
    with EventWriter(path, run_start) as w:
        fail = w.write("failure", step=7, dp_rank=1, generation=0, ranks=[2, 3], detail="SIGKILL")
        t_fail = run_start + fail.time_s  # epoch time of the failure
        w.write("detection", step=7, dp_rank=1, time_s=t_fail + 2.0, latency_ms=250.0)
        w.write("regroup", step=7, dp_rank=None, time_s=t_fail + 3.0, latency_ms=1200, generation=1)
        w.write("rejoin", step=9, dp_rank=1, time_s=t_fail + 40.0, generation=2, host="node7")
    return fail


@pytest.mark.timeout(60)
def test_write_then_replay_round_trip(tmp_path):
    path = tmp_path / "run" / "events.jsonl"
    run_start = time.time() - 100.0
    fail = _write_run(path, run_start)
    assert 99.0 < fail.time_s < 130.0
    # the line on disk: relative time, unset optionals left out, extra keys kept
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 4
    assert lines[0]["time_s"] == pytest.approx(fail.time_s)
    assert "latency_ms" not in lines[0] and "detail" not in lines[1]
    assert lines[3]["host"] == "node7"

    evs = read_events(path)
    assert [e.type for e in evs] == ["failure", "detection", "regroup", "rejoin"]
    f, d, g, r = evs
    assert f == Event(
        type="failure",
        step=7,
        dp_rank=1,
        time_s=fail.time_s,
        generation=0,
        ranks=[2, 3],
        detail="SIGKILL",
    )
    assert d.time_s == pytest.approx(f.time_s + 2.0) and d.latency_ms == 250.0
    assert g.dp_rank is None and g.generation == 1 and g.latency_ms == 1200.0
    assert r.time_s == pytest.approx(f.time_s + 40.0) and r.extra == {"host": "node7"}
    assert all(99.0 < e.time_s < 180.0 for e in evs)

    tr = sim_events.events_to_trace(evs)
    assert tr.groups.tolist() == [1]
    assert tr.times_s.tolist() == [f.time_s]
    assert tr.repair_s[0] == pytest.approx(r.time_s - f.time_s)
    assert tr.repair_s[0] == pytest.approx(40.0)
    # the events' own latency_ms wins over the time differences (2 s, 3 s)
    assert sim_events.measured_latencies(evs) == pytest.approx(
        {"detection_s": 0.25, "regroup_s": 1.2}
    )


@pytest.mark.timeout(60)
def test_measured_latencies_fall_back_to_time_difference():
    evs = [
        Event(type="failure", step=1, dp_rank=0, time_s=10.0),
        Event(type="detection", step=1, dp_rank=0, time_s=10.5),
        Event(type="regroup", step=1, dp_rank=None, time_s=12.0),
    ]
    assert sim_events.measured_latencies(evs) == pytest.approx(
        {"detection_s": 0.5, "regroup_s": 2.0}
    )


@pytest.mark.timeout(60)
def test_writers_append_clamp_and_reexport(tmp_path):
    path = tmp_path / "events.jsonl"
    run_start = time.time()
    with EventWriter(path, run_start) as w:
        early = w.write("checkpoint", step=0, dp_rank=None, time_s=run_start - 5.0)
    assert early.time_s == 0.0  # clamped at the run start
    w2 = EventWriter(path, run_start)  # e.g. after a restart: same file, same clock
    w2.write("restart", step=3, dp_rank=None, time_s=run_start + 30.0, detail="exit 4")
    w2.close()
    w2.close()  # idempotent
    evs = read_events(path)
    assert [(e.type, e.time_s, e.detail) for e in evs] == [
        ("checkpoint", 0.0, ""),
        ("restart", pytest.approx(30.0), "exit 4"),
    ]
    assert sim_events.Event is Event and sim_events.read_events is read_events
    assert sim_events.EVENT_TYPES == EVENT_TYPES and "abort" in EVENT_TYPES


@pytest.mark.timeout(60)
def test_mecefo_sim_replay_reads_writer_output(tmp_path, capsys):
    path = tmp_path / "events.jsonl"
    _write_run(path, time.time() - 100.0)
    argv = [
        "replay",
        str(path),
        "--gpus",
        "8",
        "--gpus-per-group",
        "1",
        "--steps",
        "100",
        "--step-time-s",
        "5",
        "--json",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["events"] == 4 and out["failures"] == 1
    assert out["measured"] == pytest.approx({"detection_s": 0.25, "regroup_s": 1.2})
    assert len(out["results"]) == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"type": "explode", "step": 1, "dp_rank": 0, "time_s": 1.0}', "unknown type 'explode'"),
        ('{"type": "detection", "step": -1, "dp_rank": 0, "time_s": 1.0}', "step must be an"),
        (
            '{"type": "failure", "step": 1, "dp_rank": null, "time_s": 1.0}',
            "a failure event needs a dp_rank",
        ),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, capsys, line, message):
    path = tmp_path / "events.jsonl"
    good = '{"type": "checkpoint", "step": 0, "dp_rank": null, "time_s": 0.0}'
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(ConfigError, match="^" + re.escape(f"{path}:3: {message}")) as exc:
        read_events(path)
    assert "\n" not in str(exc.value)
    # the CLI turns the same error into one `error:` line and CONFIG_ERROR
    argv = ["replay", str(path), "--gpus", "8", "--gpus-per-group", "1", "--steps", "10"]
    assert main(argv) == ExitCode.CONFIG_ERROR
    assert f"events.jsonl:3: {message}" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_writer_rejects_bad_events_and_writes_nothing(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventWriter(path, time.time()) as w:
        with pytest.raises(ConfigError, match="unknown type 'boom'"):
            w.write("boom", step=1, dp_rank=0)
        with pytest.raises(ConfigError, match="a rejoin event needs a dp_rank"):
            w.write("rejoin", step=1, dp_rank=None)
        with pytest.raises(ConfigError, match="latency_ms must be a number >= 0"):
            w.write("detection", step=1, dp_rank=0, latency_ms=-3.0)
        with pytest.raises(ConfigError, match="latency_ms must be a number >= 0"):
            w.write("detection", step=1, dp_rank=0, latency_ms=math.nan)
        with pytest.raises(ConfigError, match="generation must be an integer >= 0"):
            w.write("regroup", step=1, dp_rank=None, generation=1.5)
    assert path.read_text() == ""
    with pytest.raises(ValueError, match="must not hold schema field"):
        Event(type="abort", step=0, dp_rank=None, time_s=0.0, extra={"ranks": [1]})
