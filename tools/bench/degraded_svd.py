"""The SVD cost benchmark: exact vs randomized top-r right singular vectors of the FFN weights at
a preset's shape (the V refresh of the low-rank gradient technique), and how far apart their
subspaces are.

Imported by `degraded.py`, which puts `tools/bench` and the repository on `sys.path`."""

from __future__ import annotations

import time

from bench_common import sync
from bench_engine import load_model_cfg


def bench_svd(name: str, device) -> list[dict]:
    """Exact vs randomized top-r right singular vectors of the FFN weights at a preset's shape."""
    import torch

    from megatron_mecefo.mecefo import MecefoConfig
    from megatron_mecefo.mecefo.lowrank import top_right_singular_vectors

    cfg = load_model_cfg(name, None)
    d, f = cfg.hidden_size, cfg.ffn_hidden_size
    out = []
    for label, shape in (("fc1", (2 * f, d)), ("fc2", (d, f))):
        w = torch.randn(*shape, device=device) * 0.02
        r = MecefoConfig().resolve_rank(shape[1])
        row = {"model": name, "linear": label, "shape": list(shape), "rank": r}
        for method in ("exact", "randomized"):
            top_right_singular_vectors(w[:64, :64].contiguous(), 8, method=method)  # warm-up
            sync()
            start = time.perf_counter()
            v = top_right_singular_vectors(w, r, method=method, seed=1)
            sync()
            row[f"{method}_s"] = time.perf_counter() - start
            row[f"{method}_v"] = v
        proj = lambda v: v @ v.T  # noqa: E731
        row["subspace_rel_diff"] = float(
            (proj(row.pop("randomized_v")) - proj(row.pop("exact_v"))).norm() / r**0.5
        )
        print(
            f"  svd {name} {label} {shape} r={r}: exact {row['exact_s']:.3f} s, "
            f"randomized {row['randomized_s']:.3f} s",
            flush=True,
        )
        out.append(row)
    return out
