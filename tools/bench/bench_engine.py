"""Shared by the benchmark scripts: a training engine on the embedded demo corpus for a preset,
a preset's model config, and a synthetic batch for a bare model.

Benchmarks time the real `Engine.train_step`; this builds it from `configs/run/demo_cpu.yaml` plus
the benchmark's shape overrides, evaluation off.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build_bench_engine(
    ctx,
    model: str,
    *,
    demo_dir: str,
    micro_batch_size: int,
    num_microbatches: int,
    max_steps: int,
    overrides: list[str] | tuple[str, ...] = (),
):
    """`build_engine` for preset `model` on an existing `ParallelContext`; returns the Engine."""
    from megatron_mecefo.config.loader import load_config
    from megatron_mecefo.config.run import RunConfig
    from megatron_mecefo.training.engine import build_engine

    cfg = load_config(
        RunConfig,
        ROOT / "configs" / "run" / "demo_cpu.yaml",
        [
            f"model={model}",
            f"data.demo_dir={demo_dir}",
            f"training.micro_batch_size={micro_batch_size}",
            f"training.num_microbatches={num_microbatches}",
            f"training.max_steps={max_steps}",
            "training.eval_interval=0",
            *overrides,
        ],
    )
    return build_engine(cfg, ctx)


def load_model_cfg(name: str, num_layers: int | None):
    """The `ModelConfig` of preset `name` (its layer count replaced when `num_layers` is set)."""
    from megatron_mecefo.config.loader import load_config
    from megatron_mecefo.mcore.config import ModelConfig

    overrides = [f"num_layers={num_layers}"] if num_layers else []
    return load_config(ModelConfig, ROOT / "configs" / "model" / f"{name}.yaml", overrides)


def synthetic_batch(model_cfg, micro_batch_size: int, device):
    """A fixed random (tokens, position ids, labels) micro-batch for a bare GPTModel."""
    import torch

    gen = torch.Generator().manual_seed(0)
    s = model_cfg.seq_length
    tokens = torch.randint(0, model_cfg.vocab_size, (micro_batch_size, s), generator=gen)
    tokens = tokens.to(device)
    positions = torch.arange(s, device=device).expand(micro_batch_size, s)
    return tokens, positions, tokens.roll(-1, 1)
