"""The rank-0 metrics logger (issue 18, item 7): the printed step line carries ms/iter, tokens/s,
memory, replicas alive and degraded micro-batches; W&B gets a stable run id with resume (the same
run dir gives the same id, so a requeued job continues its run); failover events from events.jsonl
reach TensorBoard and W&B once (not repeated by a later writer), never metrics.jsonl. W&B and
TensorBoard are replaced by recording fakes (neither is installed in CI)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from megatron_mecefo.metrics.config import LoggingConfig
from megatron_mecefo.metrics.logger import MetricsLogger, _format_line
from megatron_mecefo.metrics.sinks import EventTail, wandb_run_id

pytestmark = pytest.mark.timeout(30)

RECORD = {
    "step": 10,
    "loss": 5.9325,
    "lr": 1.1e-3,
    "grad_norm": 0.943,
    "tokens_per_s": 37910.0,
    "step_time_s": 0.0542,
    "degraded_microbatches": 3,
    "replicas_alive": 3,
}


def test_step_line_shows_time_throughput_memory_replicas_degraded():
    line = _format_line(RECORD, "0.4 GiB rss")
    for part in ("step     10", "54.2 ms/iter", "37910 tok/s", "mem 0.4 GiB rss", "replicas 3"):
        assert part in line, line
    assert line.endswith("degraded 3"), line


def test_step_line_is_printed_with_memory(tmp_path, capsys):
    cfg = LoggingConfig(progress_bar=False, print_interval=5)
    logger = MetricsLogger(cfg, tmp_path, enabled=True, total_steps=20)
    logger.log_step(RECORD)
    logger.close()
    out = capsys.readouterr().out
    assert "ms/iter" in out and "mem " in out and "GiB" in out, out


class FakeWandb:
    def __init__(self):
        self.inits, self.logs = [], []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        run = types.SimpleNamespace()
        run.log = lambda values, step, commit=True: self.logs.append((values, step, commit))
        run.finish = lambda: None
        return run


@pytest.fixture
def fake_wandb(monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=fake.init))
    return fake


def _event(kind, step, **extra):
    return json.dumps({"type": kind, "step": step, "dp_rank": 1, "time_s": 1.0, **extra}) + "\n"


def test_wandb_run_id_is_stable_and_resumes(tmp_path, fake_wandb):
    (tmp_path / "identity.json").write_text(json.dumps({"run_id": "a56f845000a7"}))
    cfg = LoggingConfig(progress_bar=False, print_interval=0, wandb=True)
    for _ in range(2):  # the job, then its requeued continuation
        logger = MetricsLogger(cfg, tmp_path, enabled=True, total_steps=20)
        logger.close()
    ids = {init["id"] for init in fake_wandb.inits}
    assert ids == {"mecefo-a56f845000a7"}, fake_wandb.inits
    assert all(init["resume"] == "allow" for init in fake_wandb.inits)
    other = tmp_path / "other"
    other.mkdir()
    assert wandb_run_id(other) != wandb_run_id(tmp_path)  # another run, another W&B run
    assert wandb_run_id(other) == wandb_run_id(other)  # no identity yet: from the path
    assert wandb_run_id(other, "mine") == "mine"


def test_failover_events_reach_wandb_once_and_not_metrics_jsonl(tmp_path, fake_wandb):
    events = tmp_path / "events.jsonl"
    events.write_text(_event("failure", 4) + _event("detection", 4, latency_ms=302.0))
    cfg = LoggingConfig(progress_bar=False, print_interval=0, wandb=True)
    logger = MetricsLogger(cfg, tmp_path, enabled=True, total_steps=20, start_step=4)
    logger.log_step({**RECORD, "step": 5})
    with open(events, "a") as fh:
        fh.write(_event("rejoin", 6))
        fh.write('{"type": "regroup", "step"')  # a line being written: not yet
    logger.log_step({**RECORD, "step": 6})
    logger.close()
    event_logs = [(v, s) for v, s, commit in fake_wandb.logs if not commit]
    kinds = [
        next(k for k in v if k.startswith("failover/") and k != "failover/event")
        for v, _ in event_logs
    ]
    assert kinds == ["failover/failure", "failover/detection", "failover/rejoin"], event_logs
    assert event_logs[1][0]["failover/detection"] == 302.0
    assert [s for _, s in event_logs] == [5, 5, 6]
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(not any(k.startswith("failover/") for k in m) for m in metrics)


def test_a_later_writer_does_not_repeat_earlier_events(tmp_path, fake_wandb):
    (tmp_path / "events.jsonl").write_text(_event("failure", 3) + _event("rejoin", 9))
    cfg = LoggingConfig(progress_bar=False, print_interval=0, wandb=True)
    logger = MetricsLogger(cfg, tmp_path, enabled=True, total_steps=20, start_step=8)
    logger.log_step({**RECORD, "step": 8})  # e.g. the requeued job, resumed at step 8
    logger.close()
    sent = [v for v, _, commit in fake_wandb.logs if not commit]
    assert [k for v in sent for k in v if k == "failover/rejoin"] == ["failover/rejoin"]
    assert not [v for v in sent if "failover/failure" in v], sent


def test_tensorboard_gets_event_scalars_and_text(tmp_path, monkeypatch):
    calls = []

    class Writer:
        def __init__(self, log_dir):
            pass

        def add_scalar(self, key, value, step):
            calls.append(("scalar", key, value, step))

        def add_text(self, key, text, step):
            calls.append(("text", key, text, step))

        def close(self):
            pass

    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = Writer
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    (tmp_path / "events.jsonl").write_text(_event("regroup", 2, latency_ms=120.5))
    cfg = LoggingConfig(progress_bar=False, print_interval=0, tensorboard=True)
    logger = MetricsLogger(cfg, tmp_path, enabled=True, total_steps=20)
    logger.log_step({**RECORD, "step": 2})
    logger.close()
    assert ("scalar", "failover/regroup", 120.5, 2) in calls, calls
    assert any(c[0] == "text" and "regroup at step 2" in c[2] for c in calls), calls
    assert ("scalar", "loss", RECORD["loss"], 2) in calls


def test_event_tail_waits_for_whole_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    tail = EventTail(path)
    assert tail.read_new() == []  # no file yet
    path.write_text(_event("failure", 1) + '{"type": "det')
    assert [e["type"] for e in tail.read_new()] == ["failure"]
    with open(path, "a") as fh:
        fh.write('ection", "step": 1, "dp_rank": 1, "time_s": 2.0}\n')
    assert [e["type"] for e in tail.read_new()] == ["detection"]
    assert tail.read_new() == []
