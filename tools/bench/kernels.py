#!/usr/bin/env python
"""Fused vs unfused MeCeFO low-rank FFN kernels on llama FFN shapes; prints a table, writes JSON.

    python tools/bench/kernels.py --out bench_kernels.json            # GPU: all models, b=4096
    python tools/bench/kernels.py --models llama-350m --tokens 256    # CPU defaults (torch only)
    python tools/bench/kernels.py --check --out k.json  # also: fused vs fp32 reference error

Without CUDA the Triton rows are skipped (fused rows then time the torch reference) and the report
says so. Library code: `megatron_mecefo.kernels.bench`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from megatron_mecefo.kernels import linear_with_projection, lowrank_weight_grad, triton_available
from megatron_mecefo.kernels.bench import MODELS, format_report, run, to_json

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# max |got - want| / max |want| allowed (tests/gpu/test_kernels_gpu.py): one bf16 rounding of an
# fp32-accumulated forward; the weight gradient accumulates in fp32 (its T V^T in tf32)
_TOLERANCE = {"fwd_fused": 1e-2, "wgrad_fused": 2e-3}


def check(models, tokens, ranks, dtype, device) -> list[dict]:
    """Relative max error of the fused forward and weight gradient against the fp32 torch
    reference on every (model, linear, rank), with the backend the timing rows use."""
    from megatron_mecefo.kernels.reference import (
        linear_with_projection_torch,
        lowrank_weight_grad_torch,
    )

    backend = "triton" if device.type == "cuda" and triton_available() else "torch"
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    def rel(got, want) -> float:
        return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()

    out = []
    for model in models:
        d, f = MODELS[model]
        for linear, (m, n) in (("fc1", (2 * f, d)), ("fc2", (d, f))):
            for r in ranks:
                x, w, g = rand(tokens, n), rand(m, n) / n**0.5, rand(tokens, m)
                v = torch.linalg.qr(torch.randn(n, r, generator=gen, device=device)).Q.to(dtype)
                y, p = linear_with_projection(x, w, v, backend=backend)
                y0, p0 = linear_with_projection_torch(x.float(), w.float(), v.float())
                grad = torch.randn(m, n, generator=gen, device=device)
                want = grad.clone()
                lowrank_weight_grad(g, p, v, out=grad, accumulate=True, backend=backend)
                lowrank_weight_grad_torch(
                    g.float(), p.float(), v.float(), out=want, accumulate=True
                )
                errs = {"fwd_fused": max(rel(y, y0), rel(p, p0)), "wgrad_fused": rel(grad, want)}
                for op, err in errs.items():
                    out.append(
                        {
                            "model": model,
                            "linear": linear,
                            "rank": r,
                            "op": op,
                            "backend": backend,
                            "rel_err": err,
                            "tolerance": _TOLERANCE[op],
                            "ok": err <= _TOLERANCE[op],
                        }
                    )
    return out


def main(argv: list[str] | None = None) -> int:
    on_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        default=",".join(MODELS) if on_gpu else "llama-350m",
        help=f"comma-separated subset of {list(MODELS)} (CPU default: llama-350m)",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=4096 if on_gpu else 256,
        help="micro-batch tokens b = seq_len * micro_batch_size (CPU default 256)",
    )
    parser.add_argument("--ranks", default="64,128,256", help="comma-separated ranks r")
    parser.add_argument("--dtype", choices=list(_DTYPES), default="bf16")
    parser.add_argument("--warmup", type=int, default=5 if on_gpu else 1)
    parser.add_argument("--repeat", type=int, default=20 if on_gpu else 3)
    parser.add_argument("--out", default=None, help="write results as JSON to this path")
    parser.add_argument(
        "--check", action="store_true", help="also check the fused ops against the reference"
    )
    args = parser.parse_args(argv)

    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    ranks = [int(r) for r in args.ranks.split(",") if r]
    device = torch.device("cuda" if on_gpu else "cpu")
    if on_gpu and triton_available():
        note = "triton rows: fused kernels (fwd_fused, wgrad_fused)"
    elif on_gpu:
        note = "triton not installed: triton rows skipped (fused rows use the torch reference)"
    else:
        note = "no GPU: triton rows skipped (fused rows use the torch reference; CPU timings only)"
    print(note, file=sys.stderr)
    ceil, rows, ratios = run(
        models=models,
        tokens=args.tokens,
        ranks=ranks,
        dtype=_DTYPES[args.dtype],
        device=device,
        warmup=args.warmup,
        repeat=args.repeat,
    )
    print(format_report(ceil, rows, ratios, note))
    checked = check(models, args.tokens, ranks, _DTYPES[args.dtype], device) if args.check else []
    bad = [c for c in checked if not c["ok"]]
    if checked:
        worst = max(checked, key=lambda c: c["rel_err"] / c["tolerance"])
        print(
            f"check: {len(checked) - len(bad)}/{len(checked)} within tolerance; worst "
            f"{worst['op']} {worst['model']} {worst['linear']} r={worst['rank']}: "
            f"{worst['rel_err']:.2e} (tol {worst['tolerance']:.0e})"
        )
    if args.out:
        meta = {
            "note": note,
            "dtype": args.dtype,
            "tokens": args.tokens,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "triton_available": triton_available(),
        }
        with open(args.out, "w") as fh:
            json.dump({**to_json(ceil, rows, ratios, meta), "check": checked}, fh, indent=2)
        print(f"wrote {args.out}", file=sys.stderr)
    if bad:
        print(f"error: {len(bad)} of {len(checked)} fused results past tolerance", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
