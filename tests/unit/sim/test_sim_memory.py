"""Per-GPU memory of the real layouts (issue 26, docs/memory.md): the parameters one GPU of each
pipeline stage holds, counted from the model's shape, and the bytes of weights, fp32 gradients and
Adam state with the optimizer replicated or sharded over DP (R copies of each shard)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_mecefo.config.loader import load_config
from megatron_mecefo.config.run import RunConfig
from megatron_mecefo.errors import ConfigError
from megatron_mecefo.sim.layout import memory_per_gpu, stage_layers, stage_parameters_per_gpu

pytestmark = pytest.mark.timeout(60)
RUN = Path(__file__).resolve().parents[3] / "configs" / "run"


def _cfg(name: str) -> RunConfig:
    return load_config(RunConfig, RUN / name)


@pytest.mark.parametrize("name", ["llama-70b-128n.yaml", "llama-405b-2048n.yaml"])
def test_the_stages_of_one_tp_rank_hold_the_whole_model_at_tp_1(name):
    cfg = _cfg(name)
    tp1 = dataclasses.replace(cfg.parallel, tensor_model_parallel_size=1)
    assert sum(stage_parameters_per_gpu(cfg.model, tp1)) == cfg.model.num_parameters()
    assert sum(stage_layers(cfg.model.num_layers, cfg.parallel)) == cfg.model.num_layers


def test_llama3_70b_per_gpu_by_hand():
    cfg = _cfg("llama-70b-128n.yaml")
    d, f, v, kv = 8192, 28672, 128256, 8192 // 64 * 8  # GQA: K and V are 8 heads of 128
    layer = d * (d + 2 * kv) + d * d + 3 * f * d  # QKV, proj, SwiGLU fc1 (2f) and fc2
    assert 70.5e9 < cfg.model.num_parameters() < 70.6e9  # Llama 3 70B: 70.6B
    assert stage_layers(80, cfg.parallel) == [20, 20, 20, 20]
    first = (20 * layer + v * d) // 8 + 20 * 2 * d  # norms are whole on every TP rank
    middle = 20 * layer // 8 + 20 * 2 * d
    last = middle + v * d // 8 + d  # the output layer and the final norm
    assert stage_parameters_per_gpu(cfg.model, cfg.parallel) == [first, middle, middle, last]
    mem = memory_per_gpu(cfg, 128 * 8)
    assert (mem.parameters_per_gpu, mem.dp) == (last, 32)
    assert mem.weights == 2 * last and mem.grads == 4 * last
    assert mem.optimizer_replicated == 12 * last
    assert mem.optimizer_sharded(1) == pytest.approx(12 * last / 32)
    assert mem.optimizer_sharded(2) == pytest.approx(24 * last / 32)
    assert mem.total(mem.optimizer_replicated) / 1e9 == pytest.approx(40.87, abs=0.01)
    assert mem.total(mem.optimizer_sharded(1)) / 1e9 == pytest.approx(14.48, abs=0.01)


def test_llama3_405b_largest_stage_is_a_middle_one():
    cfg = _cfg("llama-405b-2048n.yaml")
    assert stage_layers(126, cfg.parallel) == [7] + [8] * 14 + [7]
    stages = stage_parameters_per_gpu(cfg.model, cfg.parallel)
    assert max(stages) == stages[1] > stages[0] and stages[-1] > stages[0]  # output + final norm
    mem = memory_per_gpu(cfg, 2048 * 8)
    assert mem.dp == 128 and mem.parameters_per_gpu == stages[1]
    # the replicated optimizer: 18 bytes a parameter, ~57 GB before activations on an 80 GB GPU
    assert 55e9 < mem.total(mem.optimizer_replicated) < 60e9
    assert mem.total(mem.optimizer_sharded(2)) < 20e9


def test_bad_sizes_are_refused():
    cfg = _cfg("llama-70b-128n.yaml")
    with pytest.raises(ConfigError, match="multiple of TP x PP = 32"):
        memory_per_gpu(cfg, 1000)
    mem = memory_per_gpu(cfg, 64)  # DP 2
    assert mem.optimizer_sharded(2) == mem.optimizer_replicated  # 2 copies of 2 shards
    with pytest.raises(ConfigError, match="shard copies"):
        mem.optimizer_sharded(3)
