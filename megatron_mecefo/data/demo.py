"""The demo corpus on disk: synthetic documents, their tokenizer and indexed dataset, made once.

`ensure_demo_corpus` builds `<demo_dir>/` (tokenizer.model, demo_text_document.bin/.idx,
doc_stats.npz, meta.json) in a temporary sibling directory and renames it into place, with meta.json
written last; an existing directory is reused only if its meta.json matches the requested settings.
Call it on one rank only (the others wait on a barrier, then `load_demo_corpus`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

import numpy as np

from megatron_mecefo.data.preprocess import write_dataset
from megatron_mecefo.data.synthetic import MarkovSource, MarkovSourceSpec
from megatron_mecefo.data.tokenizer import load_tokenizer, train_tokenizer
from megatron_mecefo.errors import DataError

DEMO_FORMAT_VERSION = 2
_KIND = "megatron_mecefo demo corpus"
_PREFIX_NAME = "demo_text_document"
_TOKENIZER_TRAINING_DOCUMENTS = 2000


@dataclasses.dataclass(frozen=True)
class DemoCorpus:
    """A complete demo corpus directory."""

    directory: str
    meta: dict

    @property
    def prefix(self) -> str:
        return os.path.join(self.directory, _PREFIX_NAME)

    @property
    def tokenizer_model(self) -> str:
        return os.path.join(self.directory, "tokenizer.model")

    def document_entropy_nats(self) -> np.ndarray:
        """Per-document sum of H(next | state) over its symbols (words and the EOD)."""
        with np.load(os.path.join(self.directory, "doc_stats.npz")) as stats:
            return stats["conditional_entropy_nats"]


def demo_fingerprint(*, num_documents: int, seed: int, vocab_size: int) -> dict:
    """Everything that determines the demo corpus bytes."""
    spec = MarkovSourceSpec(seed=seed)
    return {
        "kind": _KIND,
        "version": DEMO_FORMAT_VERSION,
        "source": dataclasses.asdict(spec),
        "num_documents": num_documents,
        "vocab_size": vocab_size,
    }


def load_demo_corpus(demo_dir: str, fingerprint: dict) -> DemoCorpus | None:
    """The corpus in `demo_dir` if complete and made with `fingerprint`, else None."""
    meta = _read_meta(demo_dir)
    if meta is None or {k: meta.get(k) for k in fingerprint} != fingerprint:
        return None
    corpus = DemoCorpus(demo_dir, meta)
    needed = [corpus.tokenizer_model, corpus.prefix + ".bin", corpus.prefix + ".idx"]
    needed.append(os.path.join(demo_dir, "doc_stats.npz"))
    return corpus if all(os.path.isfile(p) for p in needed) else None


def ensure_demo_corpus(
    demo_dir: str, *, num_documents: int, seed: int, vocab_size: int
) -> DemoCorpus:
    """Return the demo corpus in `demo_dir`, generating it first if missing, stale or incomplete."""
    fingerprint = demo_fingerprint(num_documents=num_documents, seed=seed, vocab_size=vocab_size)
    corpus = load_demo_corpus(demo_dir, fingerprint)
    if corpus is not None:
        return corpus
    if os.path.isdir(demo_dir) and os.listdir(demo_dir) and _read_meta(demo_dir) is None:
        raise DataError(
            f"data.demo_dir {demo_dir} exists but is not a demo corpus directory; "
            "delete it or choose another data.demo_dir"
        )
    parent = os.path.dirname(os.path.abspath(demo_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(demo_dir))}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        _generate(tmp, fingerprint, num_documents=num_documents, seed=seed, vocab_size=vocab_size)
        if os.path.isdir(demo_dir):
            shutil.rmtree(demo_dir)  # a stale or incomplete demo corpus (it has our meta.json)
        os.rename(tmp, demo_dir)
    except OSError as exc:
        if load_demo_corpus(demo_dir, fingerprint) is None:  # not just lost a race to a twin
            raise DataError(
                f"cannot create the demo corpus in {demo_dir}: {exc.strerror}; "
                "set data.demo_dir to a writable directory"
            ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    corpus = load_demo_corpus(demo_dir, fingerprint)
    assert corpus is not None
    return corpus


def _generate(out_dir: str, fingerprint: dict, *, num_documents: int, seed: int, vocab_size: int):
    t0 = time.perf_counter()
    source = MarkovSource(MarkovSourceSpec(seed=seed))
    docs = source.generate(num_documents, seed=seed)
    tok_path = os.path.join(out_dir, "tokenizer.model")
    # ~1 MB of text learns this vocabulary as well as the whole corpus, in a quarter of the time.
    train_docs = docs[:_TOKENIZER_TRAINING_DOCUMENTS]
    train_tokenizer((d.text for d in train_docs), tok_path, vocab_size=vocab_size)
    tokenizer = load_tokenizer(tok_path)
    _, num_tokens = write_dataset(
        (d.text for d in docs), os.path.join(out_dir, _PREFIX_NAME), tokenizer
    )
    cond = np.array([d.conditional_entropy_nats for d in docs])
    nll = np.array([d.nll_nats for d in docs])
    words = np.array([d.num_words for d in docs], dtype=np.int64)
    np.savez(
        os.path.join(out_dir, "doc_stats.npz"),
        conditional_entropy_nats=cond,
        nll_nats=nll,
        num_words=words,
    )
    num_symbols = int(words.sum()) + num_documents
    meta = {
        **fingerprint,
        "entropy_rate_nats_per_symbol": source.entropy_rate(),
        "num_words": int(words.sum()),
        "num_symbols": num_symbols,
        "num_tokens": num_tokens,
        "num_bytes": sum(len(d.text.encode()) + 1 for d in docs),
        "floor_nats_per_token_all_documents": float(cond.sum()) / num_tokens,
        "generation_seconds": round(time.perf_counter() - t0, 3),
    }
    with open(os.path.join(out_dir, "meta.json"), "w") as f:  # written last: marks completeness
        json.dump(meta, f, indent=2)


def _read_meta(demo_dir: str) -> dict | None:
    try:
        with open(os.path.join(demo_dir, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("kind") == _KIND else None
