"""`prepare_data`: from a `DataConfig` to a tokenizer plus train/valid datasets on every rank.

Rank 0 creates the demo corpus if needed and writes Megatron's index cache; the caller's `barrier`
orders the other ranks after it (no module-global process group). All user-fixable problems raise
`DataError`/`ConfigError` with a one-line message.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from megatron_mecefo.data.config import DataConfig
from megatron_mecefo.errors import ConfigError, DataError


@dataclasses.dataclass
class DataBundle:
    """What the trainer gets from `prepare_data`."""

    tokenizer: Any
    """Megatron tokenizer: `.vocab_size`, `.eod`, `.tokenize(str)`, `.detokenize(ids)`."""
    train: Any
    """Train `GPTDataset` (at least `num_train_samples` samples, whole epochs)."""
    valid: Any
    """Validation `GPTDataset`."""
    entropy_floor_nats_per_token: float | None
    """Demo corpus only: the source's conditional entropy of the validation documents divided by
    their token count (EOD included), i.e. the expected loss of a perfect model. None otherwise."""
    data_prefix: str = ""
    """The `.bin/.idx` prefix in use."""
    tokenizer_model: str = ""
    """The sentencepiece model in use."""
    source_entropy_rate_nats_per_word: float | None = None
    """Demo corpus only: the Markov source's exact entropy rate (a word or an EOD per symbol)."""


def check_vocab(tokenizer_vocab_size: int, model_vocab_size: int) -> None:
    """`DataError` if the tokenizer emits ids the model's embedding cannot hold."""
    if model_vocab_size < 1:
        raise ConfigError(f"model vocab_size must be >= 1, got {model_vocab_size}")
    if tokenizer_vocab_size > model_vocab_size:
        padded = -(-tokenizer_vocab_size // 128) * 128
        raise DataError(
            f"tokenizer has {tokenizer_vocab_size} tokens but the model vocab_size is "
            f"{model_vocab_size}; set model vocab_size >= {tokenizer_vocab_size} (e.g. {padded}) "
            f"or retrain the tokenizer with --vocab-size <= {model_vocab_size}"
        )


def prepare_data(
    cfg: DataConfig,
    *,
    seq_length: int,
    num_train_samples: int,
    num_valid_samples: int,
    seed: int,
    rank: int,
    barrier: Callable[[], None],
) -> DataBundle:
    """Load (rank 0: first create) the data on every rank; all ranks call this in the same order.

    Args:
        cfg: data config; `cfg.path is None` selects the demo corpus.
        seq_length: tokens per sample.
        num_train_samples: train samples to index (steps x global batch size).
        num_valid_samples: validation samples to index; 0 means one epoch of the split.
        seed: shuffling seed of Megatron's sample index (same on all ranks).
        rank: this process's global rank; rank 0 builds, the others wait on `barrier`.
        barrier: blocks until all ranks reach it; called exactly twice per rank.

    Raises:
        DataError: missing/corrupt data or tokenizer, or a split too small for one sample.
    """
    from megatron_mecefo.data import demo
    from megatron_mecefo.mcore import datasets as mds

    if seq_length < 1 or num_train_samples < 1 or num_valid_samples < 0:
        raise ConfigError("need seq_length >= 1, num_train_samples >= 1, num_valid_samples >= 0")
    corpus = None
    if cfg.path is None:
        fp = demo.demo_fingerprint(
            num_documents=cfg.demo_num_documents, seed=cfg.demo_seed, vocab_size=cfg.demo_vocab_size
        )
        if rank == 0:
            demo.ensure_demo_corpus(
                cfg.demo_dir,
                num_documents=cfg.demo_num_documents,
                seed=cfg.demo_seed,
                vocab_size=cfg.demo_vocab_size,
            )
        barrier()
        corpus = demo.load_demo_corpus(cfg.demo_dir, fp)
        if corpus is None:
            raise DataError(
                f"demo corpus missing or incomplete in {cfg.demo_dir} after rank 0 made it; "
                "data.demo_dir must be a directory every rank can see"
            )
        prefix, tok_model = corpus.prefix, corpus.tokenizer_model
        cache_dir = cfg.cache_dir or os.path.join(cfg.demo_dir, "index_cache")
    else:
        barrier()  # same barrier count on every path
        prefix, tok_model = cfg.path, cfg.tokenizer_model
        cache_dir = build_dir(cfg)

    info = mds.validate_indexed_dataset(prefix)
    tokenizer = mds.SentencePieceTokenizer(tok_model)
    mds.check_token_ids(prefix, tokenizer.vocab_size)
    splits = mds.build_gpt_datasets(
        prefix,
        tokenizer,
        seq_length=seq_length,
        split=cfg.split,
        num_train_samples=num_train_samples,
        num_valid_samples=num_valid_samples or None,
        seed=seed,
        cache_dir=cache_dir,
        eod_mask_loss=cfg.eod_mask_loss,
        rank=rank,
        barrier=barrier,
    )
    floor = rate = None
    if corpus is not None:
        # With eod_mask_loss the prediction after each EOD is unscored; that removes part of the
        # first word's information in a way token counts cannot express, so no floor is given.
        if not cfg.eod_mask_loss:
            floor = valid_floor(
                corpus.document_entropy_nats(), info.document_lengths, splits.valid_document_ids
            )
        rate = float(corpus.meta["entropy_rate_nats_per_symbol"])
    return DataBundle(
        tokenizer=tokenizer,
        train=splits.train,
        valid=splits.valid,
        entropy_floor_nats_per_token=floor,
        data_prefix=prefix,
        tokenizer_model=tok_model,
        source_entropy_rate_nats_per_word=rate,
    )


def check_paths(cfg: DataConfig) -> None:
    """The files `cfg` names exist (a cheap check before start-up: no megatron import).

    Raises:
        DataError: a missing `.bin`/`.idx` or tokenizer model, or a demo folder that is a file.
    """
    if cfg.path is None:
        if os.path.exists(cfg.demo_dir) and not os.path.isdir(cfg.demo_dir):
            raise DataError(f"data.demo_dir {cfg.demo_dir} is a file, not a directory")
        return
    for path in (f"{cfg.path}.bin", f"{cfg.path}.idx"):
        if not os.path.isfile(path):
            raise DataError(
                f"data file not found: {path} (data.path is the prefix of the .bin/.idx pair "
                "written by tools/preprocess_data.py; leave it unset to use the demo corpus)"
            )
    if not os.path.isfile(cfg.tokenizer_model):
        raise DataError(f"data.tokenizer_model not found: {cfg.tokenizer_model}")


def build_dir(cfg: DataConfig) -> str:
    """The folder data preparation writes into: the demo corpus folder, else the index cache
    (`cache_dir`, default `index_cache/` next to the data files)."""
    if cfg.path is None:
        return cfg.demo_dir
    return cfg.cache_dir or os.path.join(os.path.dirname(os.path.abspath(cfg.path)), "index_cache")


def valid_floor(entropy: np.ndarray, lengths: np.ndarray, ids: np.ndarray) -> float:
    """Per-token floor of documents `ids`: total conditional entropy over total tokens."""
    return float(entropy[ids].sum() / lengths[ids].sum())
