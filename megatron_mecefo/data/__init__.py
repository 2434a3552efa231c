"""Data pipeline: sentencepiece tokenizer, Megatron indexed datasets, the synthetic demo corpus and
the addressable micro-batch sampler. Importing this package does not import megatron.core, nor
torch: its names load on first use, so a config can be read without either (the node agent does)."""

from __future__ import annotations

import importlib

from megatron_mecefo.data.config import DataConfig

_LAZY = {
    "DataBundle": "megatron_mecefo.data.pipeline",
    "check_vocab": "megatron_mecefo.data.pipeline",
    "prepare_data": "megatron_mecefo.data.pipeline",
    "MicroBatchSampler": "megatron_mecefo.data.sampler",
}

__all__ = ["DataBundle", "DataConfig", "MicroBatchSampler", "check_vocab", "prepare_data"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
