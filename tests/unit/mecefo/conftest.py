"""Fixtures for the MeCeFO unit tests: a single-process megatron context, tiny-model helpers."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def parallel_ctx():
    """Single-process gloo + megatron parallel state (idempotent; the CPU compat layer applied)."""
    from megatron_mecefo.mcore.config import ParallelConfig
    from megatron_mecefo.mcore.parallel import init_parallel

    return init_parallel(ParallelConfig())


@pytest.fixture
def build_tiny(parallel_ctx):
    """build_tiny(**overrides) -> (model, model_cfg): the tiny GPTModel, same weights every call."""
    from megatron_mecefo.mcore.config import ModelConfig
    from megatron_mecefo.mcore.model import build_gpt_model
    from megatron_mecefo.mcore.parallel import seed_everything

    def build(**overrides):
        cfg = ModelConfig(**({"spec": "local"} | overrides))
        seed_everything(1234)
        model, _, _ = build_gpt_model(cfg)
        return model, cfg

    return build


@pytest.fixture
def tiny_batch():
    """batch(model_cfg, mbs=2, seed=0) -> (tokens, position_ids, labels)."""

    def make(cfg, mbs: int = 2, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab_size, (mbs, cfg.seq_length), generator=gen)
        pos = torch.arange(cfg.seq_length).expand(mbs, cfg.seq_length)
        return tokens, pos, tokens.roll(-1, 1)

    return make
