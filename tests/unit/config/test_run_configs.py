"""Real-size run configs and the fixed global batch (issue 18, item 6): every configs/run/
llama-*-<N>n.yaml passes `mecefo-train --dry-run` at its own size (N nodes x 8 GPUs; the Llama 3
405B layout too: TP 8 x PP 16 on 2048 nodes; Llama 3 70B: TP 8 x PP 4 on 128 nodes with the
distributed optimizer, issue 26), the 1- and
4-node configs of a model train the same trajectory (same global batch and config hash, so either
can resume the other's checkpoints), and a layout that does not divide the global batch is a
one-line error naming the numbers. The failover presets load."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import yaml

from megatron_mecefo import train
from megatron_mecefo.config.batch import resolve_global_batch, world_size_from_env
from megatron_mecefo.config.failover import FailoverConfig
from megatron_mecefo.config.loader import load_config
from megatron_mecefo.config.run import RunConfig
from megatron_mecefo.errors import ConfigError, DistributedSetupError, ExitCode
from megatron_mecefo.training.identity import config_hash

pytestmark = pytest.mark.timeout(60)

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
REAL = sorted((CONFIGS / "run").glob("llama-*-*n.yaml"))
GPUS_PER_NODE = 8


def _nodes(path: Path) -> int:
    return int(re.search(r"-(\d+)n\.yaml$", path.name).group(1))


def _dry_run(path: Path, world: int, monkeypatch, *extra: str, err=None) -> tuple[int, str]:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    out = io.StringIO()
    keep_stderr = contextlib.nullcontext() if err is None else contextlib.redirect_stderr(err)
    with contextlib.redirect_stdout(out), keep_stderr:
        code = train.main(["--config", str(path), "--dry-run", *extra])
    return code, out.getvalue()


def test_there_are_real_configs_for_1_and_4_nodes():
    names = {p.name for p in REAL}
    for model in ("llama-350m", "llama-1b", "llama-7b"):
        assert {f"{model}-1n.yaml", f"{model}-4n.yaml"} <= names, names


@pytest.mark.parametrize("path", REAL, ids=lambda p: p.name)
def test_real_config_dry_runs_at_its_size(path, monkeypatch, tmp_path):
    world = _nodes(path) * GPUS_PER_NODE
    monkeypatch.chdir(tmp_path)  # the config's relative data paths: not there yet
    err = io.StringIO()
    code, out = _dry_run(path.resolve(), world, monkeypatch, err=err)
    assert code == ExitCode.OK and "num_microbatches" in out  # a layout check before the data
    assert err.getvalue().startswith("note: data not checked: none of ")
    assert len(err.getvalue().strip().splitlines()) == 1
    data = load_config(RunConfig, path).data
    names = (f"{data.path}.bin", f"{data.path}.idx", data.tokenizer_model)
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / names[0]).touch()
    code, _ = _dry_run(path.resolve(), world, monkeypatch)
    assert code == ExitCode.DATA_ERROR  # some data is there: all of it is checked
    for name in names:
        (tmp_path / name).touch()
    err = io.StringIO()
    code, out = _dry_run(path.resolve(), world, monkeypatch, err=err)
    assert err.getvalue() == ""
    assert code == ExitCode.OK
    resolved = yaml.safe_load(out)
    t, p = resolved["training"], resolved["parallel"]
    dp = world // (p["tensor_model_parallel_size"] * p["pipeline_model_parallel_size"])
    assert t["global_batch_size"] == t["micro_batch_size"] * t["num_microbatches"] * dp
    assert p["backend"] == "nccl" and t["precision"] == "bf16"
    assert resolved["checkpoint"]["interval"] > 0 and resolved["snapshot"]["interval"] > 0
    assert resolved["failover"]["coordinator_timeout_s"] >= 30  # the cluster preset
    assert resolved["data"]["path"] and resolved["data"]["tokenizer_model"]


@pytest.mark.parametrize("model", ["llama-350m", "llama-1b", "llama-7b"])
def test_one_and_four_nodes_train_the_same_trajectory(model):
    hashes, batches = set(), set()
    for nodes in (1, 4):
        cfg = load_config(RunConfig, CONFIGS / "run" / f"{model}-{nodes}n.yaml")
        dp = nodes * GPUS_PER_NODE // cfg.parallel.tensor_model_parallel_size
        cfg = resolve_global_batch(cfg, nodes * GPUS_PER_NODE)
        t = cfg.training
        batches.add(t.micro_batch_size * t.num_microbatches * dp)
        hashes.add(config_hash(cfg, dp))
    assert len(batches) == 1 and len(hashes) == 1, (batches, hashes)


def test_a_layout_that_does_not_divide_the_global_batch_is_refused(monkeypatch, capsys):
    path = CONFIGS / "run" / "llama-7b-4n.yaml"
    code, _ = _dry_run(path, 24, monkeypatch)  # TP 4: DP 6 does not divide 1024
    err = capsys.readouterr().err
    assert code == ExitCode.CONFIG_ERROR
    assert "global_batch_size=1024" in err and "1 x 6 = 6" in err and "\n" not in err.strip()


def test_resolution_rules():
    cfg = load_config(RunConfig, CONFIGS / "run" / "demo_cpu.yaml")
    assert resolve_global_batch(cfg, 2) is cfg  # no global batch: unchanged
    fixed = load_config(
        RunConfig, CONFIGS / "run" / "demo_cpu.yaml", ["training.global_batch_size=64"]
    )
    assert resolve_global_batch(fixed, 1).training.num_microbatches == 8  # 64 / (8 x 1)
    assert resolve_global_batch(fixed, 4).training.num_microbatches == 2  # 64 / (8 x 4)
    with pytest.raises(ConfigError, match="not a multiple"):
        resolve_global_batch(fixed, 3)
    with pytest.raises(ConfigError, match="positive multiple of micro_batch_size"):
        load_config(RunConfig, CONFIGS / "run" / "demo_cpu.yaml", ["training.global_batch_size=12"])
    tp2 = load_config(
        RunConfig,
        CONFIGS / "run" / "demo_cpu.yaml",
        ["parallel.tensor_model_parallel_size=2", "training.global_batch_size=64"],
    )
    assert world_size_from_env(tp2, {}) == 2  # unset: one replica
    assert world_size_from_env(tp2, {"WORLD_SIZE": "8"}) == 8
    assert world_size_from_env(tp2, {"MECEFO_DRY_RUN_WORLD": "4"}) == 4
    with pytest.raises(DistributedSetupError, match="not divisible by TP x PP = 2 x 1"):
        resolve_global_batch(tp2, 3)  # exit 4: a layout the job cannot run (launch/README.md)


@pytest.mark.parametrize(
    "path", sorted((CONFIGS / "failover").glob("*.yaml")), ids=lambda p: p.name
)
def test_failover_presets_load(path):
    cfg = load_config(FailoverConfig, path)
    assert cfg.coordinator_timeout_s > cfg.heartbeat_interval_s


def test_the_llama3_405b_layout_is_a_128_gpu_pipeline(monkeypatch, tmp_path):
    cfg = load_config(RunConfig, CONFIGS / "run" / "llama-405b-2048n.yaml")
    p = cfg.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (8, 16)
    assert cfg.model.num_layers == 126 and 405e9 < cfg.model.num_parameters() < 410e9
    bad = [f"--config={CONFIGS / 'run' / 'llama-405b-2048n.yaml'}", "--dry-run"]
    monkeypatch.setenv("WORLD_SIZE", str(2048 * GPUS_PER_NODE))
    monkeypatch.chdir(tmp_path)
    code = train.main([*bad, "parallel.num_layers_in_first_pipeline_stage=null"])
    assert code == ExitCode.CONFIG_ERROR  # 126 layers do not split evenly over 16 stages


def test_the_llama3_70b_layout_shards_the_optimizer_over_32_replicas(monkeypatch, tmp_path):
    path = CONFIGS / "run" / "llama-70b-128n.yaml"
    cfg = load_config(RunConfig, path)
    p, m = cfg.parallel, cfg.model
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (8, 4)
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size) == (80, 8192, 28672)
    assert (m.num_attention_heads, m.num_query_groups, m.vocab_size) == (64, 8, 128256)
    assert 70e9 < m.num_parameters() < 71e9 and cfg.training.use_distributed_optimizer
    world = _nodes(path) * GPUS_PER_NODE  # WORLD_SIZE=1024: DP 32
    monkeypatch.chdir(tmp_path)
    data = cfg.data
    for name in (f"{data.path}.bin", f"{data.path}.idx", data.tokenizer_model):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    code, out = _dry_run(path, world, monkeypatch)
    assert code == ExitCode.OK
    resolved = yaml.safe_load(out)["training"]
    assert resolved["use_distributed_optimizer"] is True
    assert resolved["num_microbatches"] == 32  # 1024 sequences / (1 x 32 replicas)
    code, _ = _dry_run(path, world, monkeypatch, "parallel.pipeline_model_parallel_size=3")
    assert code == ExitCode.CONFIG_ERROR  # 80 layers do not split over 3 stages


def test_sample_granularity_is_refused_with_pipeline_stages():
    """A slice of a micro-batch cannot cross pipeline stages (fixed activation shapes): a PP 2 job
    with sample-granular takeover crashed every replica at its first takeover with 3 replicas."""
    with pytest.raises(ValueError, match="sample needs parallel.pipeline_model_parallel_size = 1"):
        load_config(
            RunConfig,
            CONFIGS / "run" / "demo_cpu.yaml",
            ["parallel.pipeline_model_parallel_size=2", "mecefo.takeover_granularity=sample"],
        )
    ok = ["parallel.pipeline_model_parallel_size=2", "mecefo.takeover_granularity=microbatch"]
    assert load_config(RunConfig, CONFIGS / "run" / "demo_cpu.yaml", ok).parallel
