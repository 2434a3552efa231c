#!/usr/bin/env python
"""Fused vs unfused MeCeFO low-rank FFN kernels on llama FFN shapes; prints a table, writes JSON.

    python tools/bench/kernels.py --out bench_kernels.json            # GPU: all models, b=4096
    python tools/bench/kernels.py --models llama-350m --tokens 256    # CPU defaults (torch only)

Without CUDA the Triton rows are skipped (fused rows then time the torch reference) and the report
says so. Library code: `megatron_mecefo.kernels.bench`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from megatron_mecefo.kernels import triton_available
from megatron_mecefo.kernels.bench import MODELS, format_report, run, to_json

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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
            json.dump(to_json(ceil, rows, ratios, meta), fh, indent=2)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
