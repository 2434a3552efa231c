"""Saved-activation accounting with autograd saved-tensor hooks (tests and the benchmark).

Counts the bytes autograd keeps for backward during a forward, attributed to the TransformerLayer
that was running, each storage counted once per layer. Measurement only: no effect on the graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch


@contextlib.contextmanager
def saved_bytes_per_layer(
    layers: list[torch.nn.Module], exclude: Iterable[torch.Tensor] = ()
) -> Iterator[dict]:
    """Within the block, record saved-for-backward bytes per layer index (key -1: outside layers).

    Args:
        layers: The transformer layers to attribute to (e.g. `model.decoder.layers`).
        exclude: Tensors whose storages are not counted (e.g. `model.parameters()`: weights that
            autograd saves are not activation memory).

    Yields:
        A dict {layer index: bytes} filled while the block runs.
    """
    result: dict[int, int] = {}
    seen: set[tuple[int, int]] = set()
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    current = [-1]
    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)))
        handles.append(layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, -1)))

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        key = (current[0], storage.data_ptr())
        if key not in seen and key[1] not in excluded:
            seen.add(key)
            result[current[0]] = result.get(current[0], 0) + storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield result
    finally:
        for h in handles:
            h.remove()


def measure_saved_bytes(layers: list[torch.nn.Module], forward: Callable[[], object]) -> dict:
    """Run `forward()` (which should return the loss) and return {layer index: saved bytes}."""
    with saved_bytes_per_layer(layers) as result:
        forward()
    return dict(result)
