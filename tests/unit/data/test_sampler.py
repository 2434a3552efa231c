"""MicroBatchSampler: addressing formula, factorisation invariance, determinism across processes."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from megatron_mecefo.data import MicroBatchSampler

from .conftest import NUM_TRAIN_SAMPLES, SEED, SEQ_LENGTH, small_demo_config

ADDRESSES = [(0, 0, 0), (0, 1, 1), (3, 1, 0), (7, 0, 1), (40, 1, 1)]


class RangeDataset:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        t = torch.full((4,), i)
        return {"tokens": t, "labels": t + 1, "loss_mask": torch.ones(4), "position_ids": t * 0}


def test_indices_follow_the_addressing_formula():
    s = MicroBatchSampler(RangeDataset(50), micro_batch_size=3, num_microbatches=2, num_replicas=4)
    assert s.global_batch_size == 24
    for step, r, m in [(0, 0, 0), (1, 3, 1), (2, 2, 0), (5, 1, 1)]:
        expected = [(step * 24 + (r * 2 + m) * 3 + j) % 50 for j in range(3)]
        assert s.sample_indices(step, r, m) == expected
        batch = s.get(step, r, m)
        assert batch["tokens"][:, 0].tolist() == expected
    with pytest.raises(ValueError):
        s.sample_indices(0, 4, 0)
    with pytest.raises(ValueError):
        s.sample_indices(0, 0, 2)


@pytest.mark.parametrize("gbs_layouts", [[(2, 2), (1, 4), (4, 1)], [(3, 2), (6, 1), (2, 3)]])
def test_global_batch_is_the_same_for_any_factorisation(bundle, gbs_layouts):
    mbs = 2
    for step in (0, 1, 9):
        seen = []
        for replicas, micro in gbs_layouts:
            s = MicroBatchSampler(
                bundle.train, micro_batch_size=mbs, num_microbatches=micro, num_replicas=replicas
            )
            rows = torch.cat(
                [s.get(step, r, m)["tokens"] for r in range(replicas) for m in range(micro)]
            )
            seen.append(sorted(map(tuple, rows.tolist())))
        assert all(x == seen[0] for x in seen[1:])
        assert len(seen[0]) == mbs * gbs_layouts[0][0] * gbs_layouts[0][1]
    # Consecutive steps draw different samples.
    s = MicroBatchSampler(bundle.train, micro_batch_size=2, num_microbatches=2, num_replicas=2)
    assert not set(s.step_indices(0)) & set(s.step_indices(1))


def test_batch_layout(bundle):
    s = MicroBatchSampler(bundle.train, micro_batch_size=3, num_microbatches=2, num_replicas=2)
    b = s.get(2, 1, 1)
    assert set(b) == {"tokens", "labels", "loss_mask", "position_ids"}
    for key, dtype in [
        ("tokens", torch.int64),
        ("labels", torch.int64),
        ("loss_mask", torch.float32),
        ("position_ids", torch.int64),
    ]:
        assert b[key].shape == (3, SEQ_LENGTH) and b[key].dtype == dtype
    assert torch.equal(b["tokens"][1], bundle.train[s.sample_indices(2, 1, 1)[1]]["tokens"])


def _store_barrier(store, world_size: int):
    import time

    count = [0]

    def barrier() -> None:
        count[0] += 1
        store.add("barrier", 1)
        deadline = time.monotonic() + 60
        while store.add("barrier", 0) < count[0] * world_size:
            if time.monotonic() > deadline:
                raise TimeoutError("barrier")
            time.sleep(0.01)

    return barrier


def _rank_builds(rank: int, demo_dir: str, store_path: str) -> dict:
    """One rank of a 2-process gloo job; the barrier goes through a FileStore, not the group, so a
    hidden torch.distributed.barrier() inside the data code would deadlock (and time out)."""
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_mecefo.data import prepare_data

    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=40))
    bundle = prepare_data(
        small_demo_config(demo_dir),
        seq_length=SEQ_LENGTH,
        num_train_samples=NUM_TRAIN_SAMPLES,
        num_valid_samples=0,
        seed=SEED,
        rank=rank,
        barrier=_store_barrier(store, 2),
    )
    s = MicroBatchSampler(bundle.train, micro_batch_size=2, num_microbatches=2, num_replicas=2)
    # numpy, not tensors: tensors would travel as shared-memory handles that die with the process.
    out = {a: {k: v.numpy() for k, v in s.get(*a).items()} for a in ADDRESSES}
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(180)
def test_same_address_same_tensors_in_separate_processes(tmp_path, bundle):
    sys.path.insert(0, os.getcwd())
    from tests.helpers.dist import run_distributed

    # Fresh demo dir: rank 0 generates corpus + tokenizer + index cache, rank 1 waits then loads.
    results = run_distributed(
        _rank_builds, 2, str(tmp_path / "demo"), str(tmp_path / "store"), timeout_s=150
    )
    local = MicroBatchSampler(bundle.train, micro_batch_size=2, num_microbatches=2, num_replicas=2)
    for addr in ADDRESSES:
        expected = local.get(*addr)
        for rank_out in results:
            for key, value in expected.items():
                got = torch.from_numpy(rank_out[addr][key])
                assert got.dtype == value.dtype and torch.equal(got, value), (addr, key)


class MaskedDataset(RangeDataset):
    """Items whose loss mask zeroes a different number of tokens per sample (like EOD masks)."""

    def __getitem__(self, i):
        item = super().__getitem__(i)
        item["loss_mask"] = (torch.arange(4) >= i % 3).float()
        return item


@pytest.mark.timeout(30)
def test_slices_are_parts_of_their_micro_batch():
    s = MicroBatchSampler(MaskedDataset(50), micro_batch_size=5, num_microbatches=2, num_replicas=3)
    for step, r, m in [(0, 0, 0), (1, 2, 1), (9, 1, 0)]:
        whole = s.get(step, r, m)
        cuts = [(0, 2), (2, 3), (3, 5)]
        parts = [s.get(step, r, m, cut) for cut in cuts]
        for key in whole:
            assert torch.equal(torch.cat([p[key] for p in parts]), whole[key]), key
        assert s.sample_indices(step, r, m, (1, 4)) == s.sample_indices(step, r, m)[1:4]
        # the denominator of every slice: the whole micro-batch's loss tokens, exactly
        assert s.loss_tokens(step, r, m) == float(whole["loss_mask"].sum())
    for bad in [(0, 0), (3, 2), (-1, 2), (0, 6)]:
        with pytest.raises(ValueError, match="slice"):
            s.sample_indices(0, 0, 0, bad)
