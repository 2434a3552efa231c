"""The whole training state of one replica as one object: what a rejoining rank receives from a
live peer (and what snapshots and checkpoints will store): model, optimizer, RNG states and the
next step. The data position is a pure function of the step (the sampler is addressable)."""

from __future__ import annotations

import io
from typing import Any

import torch

from megatron_mecefo.mcore.checkpointing import is_sharded
from megatron_mecefo.mcore.parallel import rng_states, set_rng_states


def state_dict(engine: Any, next_step: int, *, shards: bool = True) -> dict[str, Any]:
    """Model, optimizer, RNG and `next_step` (the first step not yet applied). A sharded
    optimizer gives its held shards; without `shards` only its step count (a rejoining replica
    receives its shards from their holders)."""
    optimizer = engine.optimizer
    return {
        "next_step": int(next_step),
        "model": engine.ddp.module.state_dict(),
        "optimizer": optimizer.state_dict(shards)
        if is_sharded(optimizer)
        else optimizer.state_dict(),
        "rng": rng_states(),
    }


def load_state_dict(engine: Any, state: dict[str, Any]) -> int:
    """Load `state` into `engine`; returns its `next_step`. Cached low-rank bases are dropped."""
    engine.ddp.module.load_state_dict(state["model"])
    engine.optimizer.load_state_dict(state["optimizer"])
    set_rng_states(state["rng"])
    engine.controller.clear_caches()
    return int(state["next_step"])


def next_step_of(state: Any) -> int | None:
    """The `next_step` a state dict holds (None if it is not one of ours)."""
    try:
        return int(state["next_step"])
    except (TypeError, KeyError, ValueError):
        return None


def to_bytes(state: dict[str, Any]) -> torch.Tensor:
    """Serialise a state dict into one uint8 tensor (for point-to-point transfer)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def from_bytes(payload: torch.Tensor) -> dict[str, Any]:
    return torch.load(io.BytesIO(payload.numpy().tobytes()), map_location="cpu", weights_only=False)


def digest(engine: Any) -> dict[str, Any]:
    """SHA-256 of the model and of the optimizer state (replicas must agree bit for bit). A
    sharded optimizer: its step count and layout, and under `shards` each held shard's digest
    (every holder of a shard must agree)."""
    import hashlib

    def walk(obj: Any, h) -> None:
        if isinstance(obj, torch.Tensor):
            h.update(
                obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            )
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                h.update(str(k).encode())
                walk(obj[k], h)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item, h)
        else:
            h.update(repr(obj).encode())

    out: dict[str, Any] = {}
    optimizer = engine.optimizer
    if is_sharded(optimizer):
        out["shards"] = {str(s): d for s, d in optimizer.digests().items()}
    for name, obj in (
        ("model", engine.ddp.module.state_dict()),
        (
            "optimizer",
            optimizer.state_dict(False) if is_sharded(optimizer) else optimizer.state_dict(),
        ),
    ):
        h = hashlib.sha256()
        walk(obj, h)
        out[name] = h.hexdigest()
    return out
