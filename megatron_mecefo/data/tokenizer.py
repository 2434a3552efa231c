"""Sentencepiece tokenizer training and loading.

Training is plain sentencepiece (no megatron import); loading returns the Megatron tokenizer
subclass from `megatron_mecefo.mcore.datasets`, imported lazily. Models are written atomically.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Literal

from megatron_mecefo.errors import DataError

if TYPE_CHECKING:
    from megatron_mecefo.mcore.datasets import SentencePieceTokenizer

# Fixed special ids: unk 0, bos 1, eos 2 (= EOD, appended to every document), no pad piece.
_SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": -1}


def train_tokenizer(
    sentences: Iterable[str],
    model_path: str,
    *,
    vocab_size: int,
    model_type: Literal["unigram", "bpe"] = "unigram",
    byte_fallback: bool = False,
    max_sentences: int = 2_000_000,
    num_threads: int = 2,
) -> None:
    """Train a sentencepiece model on `sentences` and write it to `model_path` atomically.

    Args:
        sentences: training text, one sentence (or line) per item; empty items are skipped.
        model_path: output `.model` file.
        vocab_size: exact vocabulary size, special pieces included.
        model_type: sentencepiece algorithm.
        byte_fallback: encode unknown characters as bytes (costs 256 vocabulary entries).
        max_sentences: sentences sampled for training from a larger input.
        num_threads: trainer threads.
    """
    import sentencepiece

    proto = io.BytesIO()
    seen = [0]
    reader_error: list[BaseException] = []

    def counted(items: Iterable[str]) -> Iterator[str]:
        try:
            for item in items:
                if item.strip():
                    seen[0] += 1
                    yield item
        except Exception as exc:  # sentencepiece would bury it in its own RuntimeError text
            reader_error.append(exc)
            raise

    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=counted(sentences),
            model_writer=proto,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=byte_fallback,
            character_coverage=1.0 if not byte_fallback else 0.9995,
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
            max_sentence_length=1 << 16,
            num_threads=num_threads,
            minloglevel=2,
            **_SPECIAL_IDS,
        )
    except RuntimeError as exc:
        if reader_error:
            raise reader_error[0] from None
        # e.g. "INTERNAL: src/trainer_interface.cc(744) [...] Vocabulary size too high (9000). ..."
        msg = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        msg = msg.rsplit("] ", 1)[-1]
        if seen[0] == 0:
            raise DataError("no text to train the tokenizer on: the input is empty") from None
        raise DataError(
            f"tokenizer training failed: {msg} (a small corpus needs a smaller --vocab-size)"
        ) from None
    _atomic_write(model_path, proto.getvalue())


def load_tokenizer(model_path: str) -> SentencePieceTokenizer:
    """Load a sentencepiece `.model` as a Megatron tokenizer; `DataError` if missing/unreadable."""
    from megatron_mecefo.mcore.datasets import SentencePieceTokenizer

    return SentencePieceTokenizer(model_path)


def _atomic_write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
