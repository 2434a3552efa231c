"""Data pipeline: sentencepiece tokenizer, Megatron indexed datasets, the synthetic demo corpus and
the addressable micro-batch sampler. Importing this package does not import megatron.core."""

from megatron_mecefo.data.config import DataConfig
from megatron_mecefo.data.pipeline import DataBundle, check_vocab, prepare_data
from megatron_mecefo.data.sampler import MicroBatchSampler

__all__ = ["DataBundle", "DataConfig", "MicroBatchSampler", "check_vocab", "prepare_data"]
