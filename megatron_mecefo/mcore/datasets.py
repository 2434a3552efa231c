"""Megatron-Core data seams: sentencepiece tokenizer, indexed-dataset I/O, GPTDataset building.

Owns everything in the data pipeline that touches `megatron.core`: a `MegatronTokenizerBase`
subclass over a sentencepiece model, writing/validating `.bin/.idx` files, and building the
train/valid `GPTDataset`s through `BlendedMegatronDatasetBuilder` with an index cache. It never
calls a `torch.distributed` collective: rank ordering uses the `barrier` callback the caller passes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import (
    _INDEX_HEADER,
    DType,
    IndexedDatasetBuilder,
)
from megatron.core.tokenizers import MegatronTokenizerBase

from megatron_mecefo.errors import DataError

_REBUILD_HINT = "re-run tools/preprocess_data.py to rebuild it"


class SentencePieceTokenizer(MegatronTokenizerBase):
    """A sentencepiece model as a Megatron tokenizer; its end-of-sentence piece is the EOD token."""

    def __init__(self, model_path: str) -> None:
        """Load `model_path`; a missing or unreadable file is a `DataError`."""
        import sentencepiece

        super().__init__(model_path, {})
        if not os.path.isfile(model_path):
            raise DataError(
                f"tokenizer model not found: {model_path} (give the .model file written by "
                "tools/preprocess_data.py as data.tokenizer_model or --tokenizer-model)"
            )
        with open(model_path, "rb") as f:
            blob = f.read()
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=blob)
        except Exception as exc:  # sentencepiece raises RuntimeError/OSError with C++ text
            raise DataError(
                f"cannot read tokenizer model {model_path}: {str(exc).splitlines()[0]} "
                "(is it a sentencepiece .model file?)"
            ) from None
        if self._sp.eos_id() < 0:
            raise DataError(
                f"tokenizer model {model_path} has no end-of-sentence piece to use as EOD; "
                "train it with tools/preprocess_data.py"
            )
        # Megatron hashes this into the index-cache key: content-addressed, not path-addressed.
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("sha256", hashlib.sha256(blob).hexdigest())]
        )

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: list[str], num_threads: int = -1) -> list[list[int]]:
        return self._sp.encode(texts, num_threads=num_threads)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    @property
    def vocab(self) -> dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: self._sp.id_to_piece(i) for i in range(self.vocab_size)}

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def unk(self) -> int:
        return self._sp.unk_id()

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("pretraining tokenizer: no chat template")


@dataclasses.dataclass(frozen=True)
class IndexInfo:
    """What a valid `.bin/.idx` pair holds."""

    num_documents: int
    num_tokens: int
    dtype: type
    document_lengths: np.ndarray
    """Tokens per document (one sequence per document), EOD included."""


def token_dtype(vocab_size: int) -> type:
    """Storage dtype Megatron uses for token ids of a vocabulary this large."""
    return DType.optimal_dtype(vocab_size)


def write_indexed_dataset(
    documents: Iterable[Sequence[int]], output_prefix: str, *, vocab_size: int, eod: int
) -> IndexInfo:
    """Write `<prefix>.bin/.idx`, one sequence per document with `eod` appended.

    Files are written under temporary names and renamed at the end (the old `.idx` is removed
    first), so an interrupted run never leaves a pair that looks valid.
    """
    dtype = token_dtype(vocab_size)
    tmp = f".tmp{os.getpid()}"
    bin_tmp, idx_tmp = f"{output_prefix}.bin{tmp}", f"{output_prefix}.idx{tmp}"
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    try:
        builder = IndexedDatasetBuilder(bin_tmp, dtype=dtype)
        for ids in documents:
            arr = np.empty(len(ids) + 1, dtype=dtype)
            arr[:-1] = ids
            arr[-1] = eod
            builder.add_document(arr, [arr.size])
        builder.finalize(idx_tmp)
        if len(builder.sequence_lengths) == 0:
            raise DataError("no documents to write: the input has no non-empty document")
        if os.path.exists(f"{output_prefix}.idx"):
            os.remove(f"{output_prefix}.idx")
        os.replace(bin_tmp, f"{output_prefix}.bin")
        os.replace(idx_tmp, f"{output_prefix}.idx")
    finally:
        for path in (bin_tmp, idx_tmp):
            if os.path.exists(path):
                os.remove(path)
    return validate_indexed_dataset(output_prefix)


def validate_indexed_dataset(prefix: str) -> IndexInfo:
    """Check that `<prefix>.bin/.idx` exist and are consistent; `DataError` naming the fix if not.

    Checks the magic, version and dtype code, that the `.idx` size matches its counts exactly
    (catches truncation), that document boundaries are sane, and that the `.bin` size matches the
    sum of sequence lengths.
    """
    idx_path, bin_path = f"{prefix}.idx", f"{prefix}.bin"
    for path in (bin_path, idx_path):
        if not os.path.isfile(path):
            raise DataError(
                f"data file not found: {path} (data.path is the prefix of the .bin/.idx pair "
                "written by tools/preprocess_data.py; leave it unset to use the demo corpus)"
            )
    header_size = len(_INDEX_HEADER) + 8 + 1 + 8 + 8
    with open(idx_path, "rb") as f:
        header = f.read(header_size)
    idx_size = os.path.getsize(idx_path)

    def corrupt(reason: str) -> DataError:
        return DataError(f"corrupt index file {idx_path}: {reason}; {_REBUILD_HINT}")

    if len(header) < header_size:
        raise corrupt(f"only {idx_size} bytes, shorter than the {header_size}-byte header")
    if header[: len(_INDEX_HEADER)] != _INDEX_HEADER:
        raise corrupt("wrong magic (not a Megatron indexed dataset)")
    version, code, seq_count, doc_count = struct.unpack("<QBQQ", header[len(_INDEX_HEADER) :])
    if version != 1:
        raise corrupt(f"unsupported version {version}")
    try:
        dtype = DType.dtype_from_code(code)
    except ValueError:
        raise corrupt(f"unknown token dtype code {code}") from None
    expected = header_size + seq_count * (4 + 8) + doc_count * 8
    if idx_size != expected:
        raise corrupt(f"size {idx_size} bytes, expected {expected} (truncated or overwritten)")
    if doc_count < 2 or seq_count < 1:
        raise corrupt("it holds no documents")
    mm = np.memmap(idx_path, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(mm, dtype=np.int32, count=seq_count, offset=header_size).copy()
    doc_idx = np.frombuffer(
        mm, dtype=np.int64, count=doc_count, offset=header_size + seq_count * 12
    ).copy()
    del mm
    if doc_idx[0] != 0 or doc_idx[-1] != seq_count or np.any(np.diff(doc_idx) < 0):
        raise corrupt("document boundaries are inconsistent")
    if np.any(lengths < 0):
        raise corrupt("negative sequence length")
    num_tokens = int(lengths.sum(dtype=np.int64))
    itemsize = np.dtype(dtype).itemsize
    bin_size = os.path.getsize(bin_path)
    if bin_size != num_tokens * itemsize:
        raise DataError(
            f"data file {bin_path} has {bin_size} bytes but {idx_path} describes "
            f"{num_tokens * itemsize}; the pair does not belong together or was truncated; "
            f"{_REBUILD_HINT}"
        )
    if doc_count - 1 == seq_count:
        doc_lengths = lengths.astype(np.int64)
    else:  # several sequences per document (not written by us, but valid Megatron data)
        doc_lengths = np.add.reduceat(lengths.astype(np.int64), doc_idx[:-1])
    return IndexInfo(doc_count - 1, num_tokens, dtype, doc_lengths)


def check_token_ids(prefix: str, vocab_size: int, *, max_tokens: int = 1 << 26) -> None:
    """`DataError` if a token id among the first `max_tokens` of `<prefix>.bin` >= vocab_size."""
    info = validate_indexed_dataset(prefix)
    count = min(info.num_tokens, max_tokens)
    tokens = np.memmap(f"{prefix}.bin", mode="r", dtype=info.dtype, shape=(count,))
    top = int(tokens.max()) if count else -1
    del tokens
    if top >= vocab_size:
        raise DataError(
            f"{prefix}.bin holds token id {top} but the tokenizer has only {vocab_size} tokens: "
            "the data was made with a different tokenizer; set data.tokenizer_model to the one "
            "used by tools/preprocess_data.py"
        )


def split_document_ranges(split: str, num_documents: int) -> list[tuple[int, int] | None]:
    """Megatron's [train, valid, test] document ranges for a split string like "98,2"."""
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    out: list[tuple[int, int] | None] = []
    for bookends in matrix:
        if bookends is None:
            out.append(None)
        else:
            beg = int(round(bookends[0] * float(num_documents)))
            end = int(round(bookends[1] * float(num_documents)))
            out.append((beg, end))
    return out


@dataclasses.dataclass
class GPTSplits:
    """The built datasets plus what callers need to reason about them."""

    train: GPTDataset
    valid: GPTDataset
    valid_document_ids: np.ndarray
    """Documents (rows of the indexed dataset) that make up the validation split."""


class _CallerOrderedBuilder(BlendedMegatronDatasetBuilder):
    """The stock builder minus its `torch.distributed.barrier()` on the default group.

    Rank ordering (rank 0 writes the index cache, then the others read it) is done by
    `build_gpt_datasets` with the caller's barrier, so a rank can also (re)build alone, e.g. a
    rank rejoining after a failure, without the whole world calling into this.
    """

    @staticmethod
    def build_generic_dataset(cls, is_built_on_rank, synchronize_ranks, *args):
        return cls(*args)


def build_gpt_datasets(
    prefix: str,
    tokenizer: SentencePieceTokenizer,
    *,
    seq_length: int,
    split: str,
    num_train_samples: int,
    num_valid_samples: int | None,
    seed: int,
    cache_dir: str,
    eod_mask_loss: bool,
    rank: int,
    barrier: Callable[[], None],
) -> GPTSplits:
    """Build train/valid `GPTDataset`s from one `.bin/.idx` prefix.

    All ranks call this in order: rank 0 builds (writing the index cache into `cache_dir`), then
    `barrier()`, then the other ranks build from the cache. Each rank calls `barrier` exactly once.
    Samples are `seq_length` tokens (`seq_length + 1` drawn, shifted into tokens/labels).
    """
    info = validate_indexed_dataset(prefix)
    ranges = split_document_ranges(split, info.num_documents)
    for name, rng in (("train", ranges[0]), ("validation", ranges[1])):
        docs = 0 if rng is None else rng[1] - rng[0]
        tokens = 0 if rng is None else int(info.document_lengths[rng[0] : rng[1]].sum())
        if tokens < seq_length + 1:
            raise DataError(
                f"the {name} split of {prefix} has {docs} documents / {tokens} tokens, fewer than "
                f"one sample of seq_length+1={seq_length + 1} tokens; use more data or change "
                f"data.split (now {split!r})"
            )
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([prefix], None),
        split=split,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=False,
        mmap_bin_files=True,
    )
    sizes = [num_train_samples, num_valid_samples or None, None]
    builder = _CallerOrderedBuilder(GPTDataset, sizes, lambda: True, config)
    datasets = _build(builder, cache_dir) if rank == 0 else None
    barrier()
    if rank != 0:
        datasets = _build(builder, cache_dir)
    train, valid, _ = datasets
    return GPTSplits(train=train, valid=valid, valid_document_ids=np.asarray(valid.indices))


def _build(builder: BlendedMegatronDatasetBuilder, cache_dir: str) -> list:
    try:
        os.makedirs(cache_dir, exist_ok=True)
        return builder.build()
    except FileNotFoundError as exc:
        # A non-zero rank with an initialized process group only reads the cache.
        raise DataError(
            f"dataset index cache missing in {cache_dir} ({os.path.basename(str(exc.filename))}); "
            "rank 0 must build it first and data.cache_dir must be visible to every rank"
        ) from None
    except OSError as exc:
        raise DataError(
            f"cannot write the dataset index cache in {cache_dir}: {exc.strerror}; "
            "set data.cache_dir to a writable directory"
        ) from None
