"""Benchmark of the fused low-rank FFN kernels against unfused torch, on Megatron FFN shapes.

Owns timing, FLOP/byte accounting, ceiling measurement and the report table;
`tools/bench/kernels.py` is the CLI. Triton rows need CUDA: on CPU only torch rows run (the fused
rows then use the torch reference) and the report says so. It must not be imported by training code.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from megatron_mecefo.kernels import linear_with_projection, lowrank_weight_grad, triton_available

# Megatron SwiGLU FFN shapes: (hidden d, ffn f); fc1 weight [2f, d] (gate;up), fc2 weight [d, f].
MODELS: dict[str, tuple[int, int]] = {
    "llama-350m": (1024, 2736),
    "llama-1b": (2048, 5461),
    "llama-7b": (4096, 11008),
}


@dataclass(kw_only=True)
class Row:
    """One timed operation on one shape."""

    model: str
    linear: str
    """"fc1" ([2f, d]) or "fc2" ([d, f])."""
    tokens: int
    m: int
    n: int
    rank: int
    op: str
    """fwd_exact, fwd_unfused, fwd_fused, dgrad, wgrad_exact, wgrad_unfused, wgrad_fused."""
    backend: str
    """"torch", "triton", or "torch-ref" (the reference standing in for the fused kernel)."""
    time_ms: float
    tflops: float
    """Useful FLOPs / time (no padding, no wasted work counted)."""
    gbps: float
    """Minimum bytes the op must move / time."""
    pct_flops_ceiling: float
    pct_bw_ceiling: float


@dataclass(kw_only=True)
class Ceilings:
    """Measured roofline of this device."""

    device: str
    matmul_tflops: float
    """Large square GEMM in the bench dtype."""
    copy_gbps: float
    """Device-to-device copy, read + write bytes."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup: int, repeat: int) -> float:
    """Median wall time of `fn` in milliseconds (CUDA-synchronised around each call)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def measure_ceilings(device: torch.device, dtype: torch.dtype, *, repeat: int) -> Ceilings:
    """Measure GEMM throughput and copy bandwidth (small sizes on CPU to stay cheap)."""
    size = 8192 if device.type == "cuda" else 1024
    a = torch.randn(size, size, device=device).to(dtype)
    ms = time_ms(lambda: a @ a, device, warmup=1, repeat=repeat)
    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), device, warmup=1, repeat=repeat)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return Ceilings(
        device=name,
        matmul_tflops=2 * size**3 / ms / 1e9,
        copy_gbps=2 * nbytes / copy_ms / 1e6,
    )


def _ops(b: int, m: int, n: int, r: int, dtype: torch.dtype, device: torch.device, fused: str):
    """(op, backend, fn, flops, bytes) for one shape; tensors are allocated once here."""
    es = torch.finfo(dtype).bits // 8
    x = torch.randn(b, n, device=device).to(dtype)
    w = (torch.randn(m, n, device=device) / n**0.5).to(dtype)
    v = torch.linalg.qr(torch.randn(n, r, device=device)).Q.to(dtype)
    g = torch.randn(b, m, device=device).to(dtype)
    p = (x @ v).contiguous()
    main_grad = torch.zeros(m, n, device=device)

    def wgrad_unfused():
        t = g.t() @ p  # [m, r]
        main_grad.add_(t @ v.t())  # materialises [m, n] in bf16, then reads it again

    fwd_flops, lr_fwd_flops = 2 * b * n * m, 2 * b * n * (m + r)
    fwd_bytes = es * (b * n + m * n + b * m)
    lr_fwd_bytes = fwd_bytes + es * (n * r + b * r)
    wgrad_bytes = es * (b * m + b * n) + 8 * m * n  # main_grad fp32 read + write
    lr_flops = 2 * r * (b * m + m * n)
    lr_bytes = es * (b * m + b * r + n * r) + 8 * m * n
    return [
        ("fwd_exact", "torch", lambda: x @ w.t(), fwd_flops, fwd_bytes),
        ("fwd_unfused", "torch", lambda: (x @ w.t(), x @ v), lr_fwd_flops, lr_fwd_bytes),
        ("fwd_fused", fused, lambda: linear_with_projection(x, w, v, backend=fused), lr_fwd_flops,
         lr_fwd_bytes),
        ("dgrad", "torch", lambda: g @ w, 2 * b * m * n, es * (b * m + m * n + b * n)),
        ("wgrad_exact", "torch", lambda: main_grad.add_(g.t() @ x), 2 * b * m * n, wgrad_bytes),
        ("wgrad_unfused", "torch", wgrad_unfused, lr_flops, lr_bytes),
        ("wgrad_fused", fused,
         lambda: lowrank_weight_grad(g, p, v, out=main_grad, accumulate=True, backend=fused),
         lr_flops, lr_bytes),
    ]  # fmt: skip


def run(
    *,
    models: list[str],
    tokens: int,
    ranks: list[int],
    dtype: torch.dtype,
    device: torch.device,
    warmup: int,
    repeat: int,
) -> tuple[Ceilings, list[Row], list[dict]]:
    """Time every op on every (model, linear, rank); return ceilings, rows and step-time ratios."""
    use_triton = device.type == "cuda" and triton_available()
    fused = "triton" if use_triton else "torch"
    label = {"torch": "torch-ref"} if not use_triton else {}
    ceil = measure_ceilings(device, dtype, repeat=repeat)
    rows: list[Row] = []
    for model in models:
        d, f = MODELS[model]
        for linear, (m, n) in (("fc1", (2 * f, d)), ("fc2", (d, f))):
            for r in ranks:
                for op, backend, fn, flops, nbytes in _ops(tokens, m, n, r, dtype, device, fused):
                    ms = time_ms(fn, device, warmup=warmup, repeat=repeat)
                    tflops, gbps = flops / ms / 1e9, nbytes / ms / 1e6
                    shown = label.get(backend, backend) if op.endswith("_fused") else backend
                    rows.append(
                        Row(
                            model=model, linear=linear, tokens=tokens, m=m, n=n, rank=r, op=op,
                            backend=shown,
                            time_ms=ms, tflops=tflops, gbps=gbps,
                            pct_flops_ceiling=100 * tflops / ceil.matmul_tflops,
                            pct_bw_ceiling=100 * gbps / ceil.copy_gbps,
                        )
                    )  # fmt: skip
    return ceil, rows, step_ratios(rows)


def step_ratios(rows: list[Row]) -> list[dict]:
    """FFN-linear time of a degraded micro-batch over an exact one, per (model, rank).

    exact = fwd + dgrad + exact wgrad; degraded = 2 fwd (forward + recomputation in backward)
    + dgrad + low-rank wgrad, summed over fc1 and fc2. The neighbour runs 2x the micro-batches
    degraded, so its FFN-linear step ratio is 2x this (attention savings are not included).
    """
    t = {(r.model, r.linear, r.rank, r.op): r.time_ms for r in rows}
    out = []
    for model, rank in dict.fromkeys((r.model, r.rank) for r in rows):
        sums = {"exact": 0.0, "unfused": 0.0, "fused": 0.0}
        for linear in ("fc1", "fc2"):
            k = (model, linear, rank)
            sums["exact"] += t[(*k, "fwd_exact")] + t[(*k, "dgrad")] + t[(*k, "wgrad_exact")]
            for impl in ("unfused", "fused"):
                sums[impl] += 2 * t[(*k, f"fwd_{impl}")] + t[(*k, "dgrad")]
                sums[impl] += t[(*k, f"wgrad_{impl}")]
        out.append(
            {
                "model": model,
                "rank": rank,
                "exact_ms": sums["exact"],
                "degraded_unfused_ms": sums["unfused"],
                "degraded_fused_ms": sums["fused"],
                "ratio_unfused": sums["unfused"] / sums["exact"],
                "ratio_fused": sums["fused"] / sums["exact"],
            }
        )
    return out


def format_report(ceil: Ceilings, rows: list[Row], ratios: list[dict], note: str) -> str:
    """Markdown tables: per-op timings and the degraded/exact FFN-linear ratios."""
    lines = [
        f"device: {ceil.device}; ceilings: {ceil.matmul_tflops:.1f} TFLOP/s GEMM, "
        f"{ceil.copy_gbps:.0f} GB/s copy",
        note,
        "",
        "| model | linear | b | m x n | r | op | backend | ms | TFLOP/s | GB/s | %FLOP | %BW |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.linear} | {r.tokens} | {r.m}x{r.n} | {r.rank} | {r.op} | "
            f"{r.backend} | {r.time_ms:.3f} | {r.tflops:.2f} | {r.gbps:.1f} | "
            f"{r.pct_flops_ceiling:.1f} | {r.pct_bw_ceiling:.1f} |"
        )
    lines += [
        "",
        "| model | r | exact ms | degraded unfused ms | degraded fused ms | ratio unfused | "
        "ratio fused |",
        "|---|---|---|---|---|---|---|",
    ]
    for q in ratios:
        lines.append(
            f"| {q['model']} | {q['rank']} | {q['exact_ms']:.3f} | {q['degraded_unfused_ms']:.3f} "
            f"| {q['degraded_fused_ms']:.3f} | {q['ratio_unfused']:.3f} | {q['ratio_fused']:.3f} |"
        )
    return "\n".join(lines)


def to_json(ceil: Ceilings, rows: list[Row], ratios: list[dict], meta: dict) -> dict:
    """JSON-serialisable result document."""
    return {
        "meta": meta,
        "ceilings": asdict(ceil),
        "rows": [asdict(r) for r in rows],
        "step_ratios": ratios,
    }
