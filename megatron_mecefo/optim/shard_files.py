"""Optimizer shards in a checkpoint folder: one file per (PP stage, TP rank, shard), written by
the shard's primary holder, read back by flat-range arithmetic for any number of shards (a
checkpoint resumes on another DP size; TP and PP must match, since they change the flat space).

`<folder>/optim/pp<P>_tp<T>_shard<S>_of<N>.pt` holds the shard's `master`, `exp_avg`,
`exp_avg_sq`, its range `[lo, hi)`, the step count and the layout's signature.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from megatron_mecefo.optim.layout import FlatLayout

SUBDIR = "optim"
_NAME = re.compile(r"pp(\d+)_tp(\d+)_shard(\d+)_of(\d+)\.pt")
FIELDS = ("master", "exp_avg", "exp_avg_sq")


class ShardFileError(ValueError):
    """The folder's shard files are missing, incomplete or of another layout."""


def path(folder: str | os.PathLike, pp: int, tp: int, shard: int, of: int) -> Path:
    return Path(folder) / SUBDIR / f"pp{pp}_tp{tp}_shard{shard}_of{of}.pt"


def write(folder, layout: FlatLayout, pp: int, tp: int, shard: int, step: int, tensors) -> Path:
    """Write one shard atomically (temporary name, then rename)."""
    dest = path(folder, pp, tp, shard, layout.num_shards)
    dest.parent.mkdir(parents=True, exist_ok=True)
    lo, hi = layout.shard_range(shard)
    payload = {
        "signature": layout.signature(),
        "numel": layout.numel,
        "step": int(step),
        "lo": lo,
        "hi": hi,
        **{k: tensors[k].detach().cpu() for k in FIELDS},
    }
    tmp = dest.with_suffix(f".tmp{os.getpid()}")
    torch.save(payload, tmp)
    os.replace(tmp, dest)
    return dest


def present(folder, pp: int, tp: int) -> dict[int, dict[int, Path]]:
    """num_shards -> {shard: file} of one (stage, TP rank)."""
    out: dict[int, dict[int, Path]] = {}
    for f in (Path(folder) / SUBDIR).glob(f"pp{pp}_tp{tp}_shard*_of*.pt"):
        m = _NAME.fullmatch(f.name)
        if m:
            out.setdefault(int(m.group(4)), {})[int(m.group(3))] = f
    return out


def missing(folder, pp_size: int, tp_size: int, num_shards: int) -> list[str]:
    """Files a complete save of `num_shards` shards lacks (empty: complete)."""
    return [
        path(folder, p, t, s, num_shards).name
        for p in range(pp_size)
        for t in range(tp_size)
        for s in range(num_shards)
        if not path(folder, p, t, s, num_shards).is_file()
    ]


def read(folder, layout: FlatLayout, pp: int, tp: int, shard: int) -> tuple[int, dict]:
    """(step count, {master, exp_avg, exp_avg_sq}) of `shard` of `layout`, cut from whatever
    shard count the folder was written with."""
    step, out = read_shards(folder, layout, pp, tp, [shard])
    return step, out[shard]


def read_shards(
    folder, layout: FlatLayout, pp: int, tp: int, shards: list[int]
) -> tuple[int, dict[int, dict]]:
    """`read` for several shards, loading each file once (and checking every file's layout and
    step)."""
    found = present(folder, pp, tp)
    complete = [n for n, files in found.items() if len(files) == n]
    if not complete:
        raise ShardFileError(
            f"{folder} has no complete set of optimizer shards for stage {pp}, TP rank {tp}"
        )
    files = found[max(complete)]
    ranges = {shard: layout.shard_range(shard) for shard in shards}
    out = {
        shard: {k: torch.empty(hi - lo, dtype=torch.float32) for k in FIELDS}
        for shard, (lo, hi) in ranges.items()
    }
    filled = dict.fromkeys(shards, 0)
    steps = set()
    for s in sorted(files):
        data = torch.load(files[s], map_location="cpu", weights_only=True)
        if data["signature"] != layout.signature() or data["numel"] != layout.numel:
            raise ShardFileError(
                f"{files[s].name} is of another parameter layout (signature "
                f"{data['signature']}, this run {layout.signature()}): the model, TP or PP differ"
            )
        steps.add(int(data["step"]))
        for shard, (lo, hi) in ranges.items():
            a, b = max(lo, data["lo"]), min(hi, data["hi"])
            if a < b:
                for k in FIELDS:
                    out[shard][k][a - lo : b - lo].copy_(data[k][a - data["lo"] : b - data["lo"]])
                filled[shard] += b - a
    if len(steps) != 1:
        raise ShardFileError(f"{folder}: optimizer shards of different steps {sorted(steps)}")
    for shard, (lo, hi) in ranges.items():
        if filled[shard] != hi - lo:
            raise ShardFileError(f"{folder}: the shard files do not cover [{lo}, {hi})")
    return steps.pop(), out
