"""Turn text/JSONL files into a tokenizer plus a Megatron `.bin/.idx` dataset.

Owns input reading (`.txt`: one document per line; `.jsonl`/`.json`: one JSON object per line, the
document under `json_key`) and the preprocessing flow. Megatron I/O is delegated to
`megatron_mecefo.mcore.datasets`, imported lazily. Outputs appear only when complete.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Iterable, Iterator
from typing import Literal

from megatron_mecefo.data.tokenizer import load_tokenizer, train_tokenizer
from megatron_mecefo.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".json")


@dataclasses.dataclass(frozen=True)
class PreprocessResult:
    """Where the outputs are and what they hold."""

    output_prefix: str
    tokenizer_model: str
    vocab_size: int
    num_documents: int
    num_tokens: int
    """Tokens written, one EOD per document included."""


def check_inputs(paths: Iterable[str]) -> list[str]:
    """Return `paths` as a list; `DataError` if one is missing or none is given."""
    paths = list(paths)
    if not paths:
        raise DataError("no input files given (pass --input FILE [FILE ...])")
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"input file not found: {path}")
    return paths


def read_documents(paths: Iterable[str], *, json_key: str = "text") -> Iterator[str]:
    """Yield non-empty documents from text files (one per line) and JSONL files (`json_key`)."""
    for path in paths:
        is_jsonl = path.endswith(JSONL_SUFFIXES)
        with open(path, encoding="utf-8", errors="strict") as f:
            try:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    text = _json_text(line, path, lineno, json_key) if is_jsonl else line
                    text = text.rstrip("\n")
                    if text.strip():
                        yield text
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})"
                ) from None


def _json_text(line: str, path: str, lineno: int, key: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{path}:{lineno}: invalid JSON ({exc.msg}); expected one object per line"
        ) from None
    if not isinstance(record, dict) or key not in record:
        raise DataError(
            f"{path}:{lineno}: no key {key!r} in the record (choose the text field with --json-key)"
        )
    value = record[key]
    if not isinstance(value, str):
        raise DataError(f"{path}:{lineno}: {key!r} is {type(value).__name__}, expected a string")
    return value


def training_sentences(documents: Iterable[str]) -> Iterator[str]:
    """Lines of the documents, the unit sentencepiece trains on."""
    for doc in documents:
        yield from doc.splitlines()


def write_dataset(
    documents: Iterable[str],
    output_prefix: str,
    tokenizer,
    *,
    total: int | None = None,
    progress: bool = False,
    batch_size: int = 1024,
) -> tuple[int, int]:
    """Tokenize `documents` and write `<output_prefix>.bin/.idx`; returns (documents, tokens)."""
    from megatron_mecefo.mcore.datasets import write_indexed_dataset

    def token_lists() -> Iterator[list[int]]:
        it = iter(documents)
        bar = _progress(total, progress, "tokenize")
        try:
            while batch := list(itertools.islice(it, batch_size)):
                yield from tokenizer.tokenize_batch(batch)
                bar.update(len(batch))
        finally:
            bar.close()

    info = write_indexed_dataset(
        token_lists(), output_prefix, vocab_size=tokenizer.vocab_size, eod=tokenizer.eod
    )
    return info.num_documents, info.num_tokens


def preprocess(
    inputs: Iterable[str],
    output_prefix: str,
    *,
    vocab_size: int = 8192,
    tokenizer_model: str | None = None,
    json_key: str = "text",
    model_type: Literal["unigram", "bpe"] = "unigram",
    byte_fallback: bool = False,
    progress: bool = False,
) -> PreprocessResult:
    """Train a tokenizer (unless `tokenizer_model` is given) and write the indexed dataset.

    Outputs: `<output_prefix>.bin`, `<output_prefix>.idx` and, when trained,
    `<output_prefix>.model`.
    """
    paths = check_inputs(inputs)
    trained_tmp = None
    if tokenizer_model is None:
        # Old outputs go first, and the new model is renamed in last: a crash leaves no pair of
        # dataset and tokenizer that look valid together.
        for suffix in (".idx", ".model"):
            if os.path.exists(output_prefix + suffix):
                os.remove(output_prefix + suffix)
        trained_tmp = f"{output_prefix}.model.tmp{os.getpid()}"
        train_tokenizer(
            training_sentences(read_documents(paths, json_key=json_key)),
            trained_tmp,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=byte_fallback,
        )
    try:
        tokenizer = load_tokenizer(trained_tmp or tokenizer_model)
        num_docs, num_tokens = write_dataset(
            read_documents(paths, json_key=json_key), output_prefix, tokenizer, progress=progress
        )
        if trained_tmp is not None:
            tokenizer_model = f"{output_prefix}.model"
            os.replace(trained_tmp, tokenizer_model)
    finally:
        if trained_tmp is not None and os.path.exists(trained_tmp):
            os.remove(trained_tmp)
    return PreprocessResult(
        output_prefix, tokenizer_model, tokenizer.vocab_size, num_docs, num_tokens
    )


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int | None, enabled: bool, desc: str):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="doc", unit_scale=True)
