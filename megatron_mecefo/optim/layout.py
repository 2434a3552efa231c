"""The flat index space of one rank's trainable parameters, cut into one shard per logical
replica.

Parameters are laid end to end in megatron's optimizer-group order (decayed weights first, then
biases and norms), without padding. Shard `s` of `n` is the range `[s*C, min((s+1)*C, N))`,
`C = ceil(N / n)`: it depends only on the model layout (TP x PP) and on `n`, never on which
replicas are alive, so a shard keeps its identity through failures. A shard is a list of pieces
(a slice of one parameter) and of runs (a stretch of one optimizer group). No collectives here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class Piece:
    """The part of one parameter that falls into a shard."""

    param: int
    """Index into `FlatLayout.params`."""
    param_lo: int
    param_hi: int
    """Element range inside the flattened parameter."""
    shard_lo: int
    """Where it starts inside the shard."""


@dataclasses.dataclass(frozen=True)
class Run:
    """A stretch of a shard that belongs to one optimizer group."""

    lo: int
    hi: int
    group: int


class FlatLayout:
    """Shards of `num_shards` logical replicas over the parameters of `groups`.

    Args:
        groups: the parameters of each optimizer group, in megatron's order.
        names: parameter -> its name (recorded in checkpoints, to refuse another model).
        num_shards: n, the replicas of the failure-free job.
    """

    def __init__(
        self,
        groups: list[list[torch.Tensor]],
        names: dict[torch.Tensor, str],
        num_shards: int,
    ):
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        self.params = [p for g in groups for p in g]
        self.names = [names[p] for p in self.params]
        self.group_bounds: list[tuple[int, int]] = []
        self.param_offsets: list[int] = []
        offset = 0
        for group in groups:
            start = offset
            for p in group:
                self.param_offsets.append(offset)
                offset += p.numel()
            self.group_bounds.append((start, offset))
        self.numel = offset
        self.num_shards = num_shards
        self.shard_numel = max(1, math.ceil(self.numel / num_shards))
        self._pieces: dict[int, list[Piece]] = {}

    def shard_range(self, shard: int) -> tuple[int, int]:
        """[lo, hi) of `shard` in the flat space (empty for trailing shards of a tiny model)."""
        if not 0 <= shard < self.num_shards:
            raise IndexError(f"shard {shard} out of range [0, {self.num_shards})")
        lo = min(shard * self.shard_numel, self.numel)
        return lo, min(lo + self.shard_numel, self.numel)

    def shard_len(self, shard: int) -> int:
        lo, hi = self.shard_range(shard)
        return hi - lo

    def pieces(self, shard: int) -> list[Piece]:
        """The parameter slices of `shard`, in flat order."""
        if shard not in self._pieces:
            lo, hi = self.shard_range(shard)
            out = []
            for i, p in enumerate(self.params):
                start = self.param_offsets[i]
                end = start + p.numel()
                a, b = max(lo, start), min(hi, end)
                if a < b:
                    out.append(Piece(i, a - start, b - start, a - lo))
            self._pieces[shard] = out
        return self._pieces[shard]

    def runs(self, shard: int) -> list[Run]:
        """The optimizer-group stretches of `shard` (shard-relative)."""
        lo, hi = self.shard_range(shard)
        out = []
        for g, (start, end) in enumerate(self.group_bounds):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                out.append(Run(a - lo, b - lo, g))
        return out

    def gather_from_params(self, shard: int, out: torch.Tensor, source: str = "data") -> None:
        """Copy the shard's slice of every parameter (`source`: `data`, or `main_grad` for the
        reduced gradient) into `out` (length >= the shard's)."""
        for piece in self.pieces(shard):
            tensor = getattr(self.params[piece.param], source)
            n = piece.param_hi - piece.param_lo
            out[piece.shard_lo : piece.shard_lo + n].copy_(
                tensor.detach().reshape(-1)[piece.param_lo : piece.param_hi]
            )

    def scatter_to_params(self, shard: int, values: torch.Tensor, lo: int = 0) -> None:
        """Write `values`, the shard's elements `[lo, lo + len(values))` (any float dtype; what
        lies past the shard's end is ignored), into the parameters."""
        hi = lo + values.numel()
        for piece in self.pieces(shard):
            n = piece.param_hi - piece.param_lo
            a, b = max(lo, piece.shard_lo), min(hi, piece.shard_lo + n)
            if a >= b:
                continue
            start = piece.param_lo + (a - piece.shard_lo)
            self.params[piece.param].data.view(-1)[start : start + (b - a)].copy_(
                values[a - lo : b - lo]
            )

    def describe(self) -> dict[str, Any]:
        """What the flat space is (checkpoints compare it before resharding one)."""
        return {
            "numel": self.numel,
            "num_shards": self.num_shards,
            "shard_numel": self.shard_numel,
            "signature": self.signature(),
        }

    def signature(self) -> str:
        """SHA-256 of the parameter names, shapes and group bounds: equal iff the flat space is."""
        h = hashlib.sha256()
        for name, p in zip(self.names, self.params):
            h.update(f"{name}:{tuple(p.shape)};".encode())
        h.update(repr(self.group_bounds).encode())
        return h.hexdigest()[:16]
