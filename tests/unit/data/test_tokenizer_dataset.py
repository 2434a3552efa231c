"""Tokenizer training and the indexed dataset: round trips, EOD placement, JSONL input, reuse."""

from __future__ import annotations

import json

import numpy as np

from megatron_mecefo.data.demo import DemoCorpus
from megatron_mecefo.data.preprocess import preprocess
from megatron_mecefo.data.synthetic import MarkovSource, MarkovSourceSpec
from megatron_mecefo.data.tokenizer import load_tokenizer
from megatron_mecefo.mcore.datasets import validate_indexed_dataset


def read_documents(prefix: str) -> list[np.ndarray]:
    info = validate_indexed_dataset(prefix)
    flat = np.fromfile(f"{prefix}.bin", dtype=info.dtype)
    bounds = np.concatenate([[0], np.cumsum(info.document_lengths)])
    return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def test_demo_round_trip_and_eod(demo_cfg, bundle):
    corpus = DemoCorpus(demo_cfg.demo_dir, {})
    docs = MarkovSource(MarkovSourceSpec(seed=demo_cfg.demo_seed)).generate(
        demo_cfg.demo_num_documents, seed=demo_cfg.demo_seed
    )
    stored = read_documents(corpus.prefix)
    tok = bundle.tokenizer
    assert tok.vocab_size == demo_cfg.demo_vocab_size
    assert len(stored) == len(docs)
    for i in (0, 1, 17, len(docs) - 1):
        ids = stored[i]
        assert ids[-1] == tok.eod and tok.eod not in ids[:-1]
        assert tok.detokenize(ids[:-1].tolist()) == docs[i].text
        assert tok.tokenize(docs[i].text) == ids[:-1].tolist()
    assert all(int(d[-1]) == tok.eod for d in stored)


def test_jsonl_preprocess_round_trip_and_tokenizer_reuse(tmp_path, bundle):
    texts = [f"record {i} says hello to the world number {i * 7}" for i in range(300)]
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(texts)))
    res = preprocess([str(src)], str(tmp_path / "out"), vocab_size=64, json_key="body")
    assert res.num_documents == len(texts) and res.vocab_size == 64
    tok = load_tokenizer(res.tokenizer_model)
    stored = read_documents(res.output_prefix)
    assert [tok.detokenize(d[:-1].tolist()) for d in stored] == texts
    assert res.num_tokens == sum(len(d) for d in stored)

    # Same documents as plain text, tokenized with the existing model: identical token stream.
    txt = tmp_path / "corpus.txt"
    txt.write_text("\n\n".join(texts) + "\n")  # blank lines are not documents
    res2 = preprocess([str(txt)], str(tmp_path / "again"), tokenizer_model=res.tokenizer_model)
    assert not (tmp_path / "again.model").exists()
    again = read_documents(res2.output_prefix)
    assert len(again) == len(stored)
    assert all(np.array_equal(a, b) for a, b in zip(again, stored))
