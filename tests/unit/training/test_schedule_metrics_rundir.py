"""LR schedule, metrics sinks, run-dir lifecycle and the step-plan contract (no processes)."""

from __future__ import annotations

import json
import math

import pytest

from megatron_mecefo.config.training import TrainingConfig
from megatron_mecefo.errors import ConfigError
from megatron_mecefo.metrics.config import LoggingConfig
from megatron_mecefo.metrics.logger import MetricsLogger
from megatron_mecefo.metrics.mfu import mfu, peak_flops
from megatron_mecefo.plan.step_plan import MicroBatchTask, RankStepPlan, failure_free_plan
from megatron_mecefo.training.lr_schedule import lr_at
from megatron_mecefo.training.run_dir import RunDir


def test_warmup_then_cosine_to_min():
    cfg = TrainingConfig(max_steps=110, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, cfg) == pytest.approx(0.1)
    lrs = [lr_at(s, cfg) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:])), "cosine phase must be non-increasing"


def test_training_config_rejects_bad_values():
    with pytest.raises(ValueError, match="min_lr"):
        TrainingConfig(lr=1e-4, min_lr=1e-3)
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1"):
        TrainingConfig(micro_batch_size=0)
    assert TrainingConfig(use_distributed_optimizer=True).use_distributed_optimizer


def _record(step, **extra):
    return {
        "step": step,
        "loss": 3.0 - 0.1 * step,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "tokens_per_s": 1000.0,
        **extra,
    }


def test_metrics_jsonl_interval_eval_rows(tmp_path, capsys):
    cfg = LoggingConfig(log_interval=2, print_interval=2, progress_bar=False)
    logger = MetricsLogger(cfg, tmp_path, enabled=True, total_steps=5)
    for step in range(5):
        logger.log_step(_record(step, **({"val_loss": 2.5} if step == 3 else {})))
    logger.log_step(_record(5, loss=float("nan")))
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 2, 3, 4]  # every 2nd step, plus the eval row
    assert rows[2]["val_loss"] == 2.5
    assert not (tmp_path / "events.jsonl").exists(), "events.jsonl belongs to EventWriter"
    assert "val_loss 2.5000" in capsys.readouterr().out


def test_metrics_disabled_on_other_ranks(tmp_path):
    logger = MetricsLogger(LoggingConfig(), tmp_path / "x", enabled=False, total_steps=1)
    logger.log_step(_record(0))
    logger.close()
    assert not (tmp_path / "x").exists()


def test_optional_sinks_need_their_packages(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tb(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard") or name == "wandb":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tb)
    with pytest.raises(ConfigError, match=r"megatron-mecefo\[tensorboard\]"):
        MetricsLogger(LoggingConfig(tensorboard=True), tmp_path, enabled=True, total_steps=1)
    with pytest.raises(ConfigError, match=r"megatron-mecefo\[wandb\]"):
        MetricsLogger(LoggingConfig(wandb=True), tmp_path / "w", enabled=True, total_steps=1)


def test_mfu_peak_lookup():
    assert peak_flops(None) is None and peak_flops("Intel CPU") is None
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert mfu(1000.0, 6e9, 1, 989e12) == pytest.approx(6e12 / 989e12)
    assert mfu(1000.0, 6e9, 1, None) is None


def test_run_dir_refuses_existing_run_and_discards_on_failed_setup(tmp_path):
    path = tmp_path / "run"
    rd = RunDir(path, overwrite=False)
    rd.create({"a": 1}, {"world_size": 1})
    env = json.loads((path / "env.json").read_text())
    assert env["world_size"] == 1 and "git_sha" in env and env["versions"]["torch"]
    (path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="already holds a run"):
        RunDir(path, overwrite=False)
    RunDir(path, overwrite=True)  # allowed
    rd.discard_if_created()
    assert not path.exists()
    existing = tmp_path / "kept"
    existing.mkdir()
    rd2 = RunDir(existing, overwrite=False)
    rd2.create({}, {})
    rd2.discard_if_created()
    assert existing.exists(), "a directory the user made must never be deleted"


@pytest.mark.timeout(30)
def test_resume_drops_metric_rows_it_will_redo_and_a_row_cut_short(tmp_path):
    """A crashed run may have logged past its last checkpoint and cut its last row short; resuming
    keeps the rows before the resume step and does not trip over the broken one."""
    from megatron_mecefo.training.run_dir import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(6)) + '{"step": 6, "lo')
    truncate_metrics(path, 4)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]


def test_step_plan_scales():
    plan = failure_free_plan(dp_rank=1, num_replicas=4, num_microbatches=3)
    assert [t.source_dp_rank for t in plan.tasks] == [1, 1, 1]
    assert plan.grad_scale == plan.attention_grad_scale == 0.25 and plan.num_degraded == 0
    covering = RankStepPlan(
        tasks=(MicroBatchTask(0, 0, True), MicroBatchTask(1, 0, True)),
        num_replicas=4,
        microbatches_per_replica=1,
        masked_scale=0.5,
    )
    assert covering.attention_grad_scale == 0.5 and covering.num_degraded == 2
    with pytest.raises(ValueError):
        RankStepPlan(tasks=(), num_replicas=0, microbatches_per_replica=1)
