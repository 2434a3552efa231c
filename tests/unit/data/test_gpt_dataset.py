"""prepare_data on the demo corpus: GPTDataset samples, the entropy floor, cache and demo reuse."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from megatron_mecefo.data import prepare_data
from megatron_mecefo.data.demo import DemoCorpus, ensure_demo_corpus
from megatron_mecefo.mcore.datasets import validate_indexed_dataset

from .conftest import NUM_TRAIN_SAMPLES, SEED, SEQ_LENGTH, no_barrier, small_demo_config


def test_samples_have_seq_length_and_shifted_labels(bundle):
    assert len(bundle.train) >= NUM_TRAIN_SAMPLES and len(bundle.valid) > 0
    for ds in (bundle.train, bundle.valid):
        for idx in (0, 1, len(ds) - 1):
            s = ds[idx]
            assert s["tokens"].shape == (SEQ_LENGTH,) and s["labels"].shape == (SEQ_LENGTH,)
            assert torch.equal(s["tokens"][1:], s["labels"][:-1])
            assert torch.equal(s["position_ids"], torch.arange(SEQ_LENGTH))
            assert s["loss_mask"].dtype == torch.float32 and bool((s["loss_mask"] == 1).all())
            assert int(s["tokens"].max()) < bundle.tokenizer.vocab_size
    # Samples cross document boundaries: the stream holds EOD tokens.
    tokens = torch.cat([bundle.train[i]["tokens"] for i in range(40)])
    assert int((tokens == bundle.tokenizer.eod).sum()) > 0


def test_entropy_floor_is_valid_documents_entropy_over_tokens(demo_cfg, bundle):
    corpus = DemoCorpus(demo_cfg.demo_dir, {})
    info = validate_indexed_dataset(corpus.prefix)
    n = info.num_documents
    valid_ids = np.arange(int(round(0.98 * n)), n)  # "98,2": the last 2% of documents
    with np.load(os.path.join(demo_cfg.demo_dir, "doc_stats.npz")) as st:
        entropy, words = st["conditional_entropy_nats"], st["num_words"]
    expected = entropy[valid_ids].sum() / info.document_lengths[valid_ids].sum()
    assert bundle.entropy_floor_nats_per_token == expected
    # A word is at least one token and the EOD exactly one: per-token floor <= per-symbol entropy.
    per_symbol = entropy[valid_ids].sum() / (words[valid_ids] + 1).sum()
    assert 0 < bundle.entropy_floor_nats_per_token <= per_symbol
    # The tokens of the valid split are the tokens of exactly those documents.
    assert set(np.asarray(bundle.valid.indices).tolist()) == set(valid_ids.tolist())


def test_second_prepare_reuses_demo_and_cache(demo_cfg, bundle):
    meta = os.path.join(demo_cfg.demo_dir, "meta.json")
    cache = os.path.join(demo_cfg.demo_dir, "index_cache")
    before = {f: os.stat(os.path.join(cache, f)).st_mtime_ns for f in os.listdir(cache)}
    meta_mtime = os.stat(meta).st_mtime_ns
    again = prepare_data(
        demo_cfg,
        seq_length=SEQ_LENGTH,
        num_train_samples=NUM_TRAIN_SAMPLES,
        num_valid_samples=0,
        seed=SEED,
        rank=0,
        barrier=no_barrier,
    )
    assert os.stat(meta).st_mtime_ns == meta_mtime
    assert {f: os.stat(os.path.join(cache, f)).st_mtime_ns for f in os.listdir(cache)} == before
    for idx in (0, 5, len(again.train) - 1):
        assert torch.equal(again.train[idx]["tokens"], bundle.train[idx]["tokens"])


def test_demo_regenerated_when_incomplete_or_settings_change(tmp_path):
    demo_dir = str(tmp_path / "demo")
    kw = {"num_documents": 60, "seed": 1, "vocab_size": 128}
    first = ensure_demo_corpus(demo_dir, **kw)
    os.remove(first.prefix + ".idx")  # incomplete
    second = ensure_demo_corpus(demo_dir, **kw)
    assert os.path.isfile(second.prefix + ".idx")
    assert second.meta["num_tokens"] == first.meta["num_tokens"]  # same settings, same corpus
    third = ensure_demo_corpus(demo_dir, **{**kw, "seed": 2})
    assert third.meta["source"]["seed"] == 2
    assert json.load(open(os.path.join(demo_dir, "meta.json")))["source"]["seed"] == 2
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]  # no temporary leftovers


def test_valid_samples_requested_and_eod_mask_loss(tmp_path, demo_cfg):
    cfg = small_demo_config(demo_cfg.demo_dir, eod_mask_loss=True, cache_dir=str(tmp_path / "c"))
    b = prepare_data(
        cfg,
        seq_length=16,
        num_train_samples=10,
        num_valid_samples=500,
        seed=1,
        rank=0,
        barrier=no_barrier,
    )
    assert len(b.valid) >= 500  # several epochs of the small validation split
    assert b.entropy_floor_nats_per_token is None  # not expressible with masked EOD predictions
    s = b.train[3]
    assert torch.equal(s["loss_mask"] == 0, s["tokens"] == b.tokenizer.eod)
