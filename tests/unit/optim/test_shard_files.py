"""Optimizer shard files (`optim/shard_files.py`): shards written for n replicas read back for
any m, element for element, by flat-range arithmetic (no processes)."""

from __future__ import annotations

import pytest
import torch

from megatron_mecefo.optim import shard_files
from megatron_mecefo.optim.layout import FlatLayout


def _layout(num_shards: int) -> tuple[FlatLayout, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    decayed = [torch.randn(7, 5, generator=gen), torch.randn(11, generator=gen)]
    norms = [torch.randn(6, generator=gen)]
    names = {p: f"p{i}" for i, p in enumerate(decayed + norms)}
    return FlatLayout([decayed, norms], names, num_shards), decayed + norms


def _flat(num_elements: int, offset: float) -> torch.Tensor:
    return torch.arange(num_elements, dtype=torch.float32) + offset


@pytest.mark.parametrize("written, read", [(3, 2), (2, 3), (1, 4), (4, 1), (3, 5)])
def test_any_shard_count_reads_back_the_same_elements(tmp_path, written, read):
    src, _ = _layout(written)
    n = src.numel
    flats = {"master": _flat(n, 0.0), "exp_avg": _flat(n, 1000.0), "exp_avg_sq": _flat(n, 2000.0)}
    for s in range(written):
        lo, hi = src.shard_range(s)
        shard_files.write(tmp_path, src, 0, 0, s, 7, {k: v[lo:hi] for k, v in flats.items()})
    dst, _ = _layout(read)
    step, got = shard_files.read_shards(tmp_path, dst, 0, 0, list(range(read)))
    assert step == 7
    for s in range(read):
        lo, hi = dst.shard_range(s)
        for k, flat in flats.items():
            assert torch.equal(got[s][k], flat[lo:hi]), (s, k)


def test_an_incomplete_set_or_another_layout_is_refused(tmp_path):
    src, _ = _layout(2)
    for s in range(2):
        lo, hi = src.shard_range(s)
        shard_files.write(
            tmp_path, src, 0, 0, s, 1, {k: torch.zeros(hi - lo) for k in shard_files.FIELDS}
        )
    flat = torch.zeros(src.numel)
    other = FlatLayout([[flat]], {flat: "flat"}, 2)  # same size, another parameter
    with pytest.raises(shard_files.ShardFileError, match="another parameter layout"):
        shard_files.read(tmp_path, other, 0, 0, 0)
    shard_files.path(tmp_path, 0, 0, 1, 2).unlink()
    with pytest.raises(shard_files.ShardFileError, match="no complete set"):
        shard_files.read(tmp_path, src, 0, 0, 0)
