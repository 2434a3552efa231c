"""Does FFN recompute (`mecefo.recompute_ffn`) buy a covering rank memory it needs? Peak memory and
step time of a covering rank's step with recompute on vs off, next to a normal rank's exact step.

    python tools/bench/recompute_memory.py --quick          # llama-350m shapes, 2 layers, ~1 min
    python tools/bench/recompute_memory.py --num-layers 4 --seq 512 --reps 5

A covering (neighbour) rank runs its micro-batches one after another (own, then taken over), each
forward + backward, gradients accumulating into the same buffers: so its peak is one micro-batch's
activations on top of weights and gradients, never two micro-batches' at once. Configurations,
interleaved round by round on one process (same weights, same tokens): `exact` (a normal rank's
step: K exact micro-batches), `degraded, recompute on` and `degraded, recompute off` (K degraded
micro-batches, the other techniques at their defaults).

Memory, CPU: the high-water mark of the process's resident memory over the step (`VmHWM` in
/proc/self/status, reset before each step by writing 5 to /proc/self/clear_refs), minus the
resident memory at the step's start. glibc is told (`mallopt`) to serve every block >= 64 KiB with
its own mmap and to unmap it on free, so resident memory follows the live tensor bytes, transients
included (matmul outputs, softmax of the logits), not only what autograd saves; weights and
gradient buffers exist before the step (warm-up step) and are excluded by the subtraction. Cross-
checked with the bytes autograd saves for backward (saved-tensor hooks, `mecefo.memory`).
(torch.profiler's profile_memory records no CPU allocation events in this torch build.)
GPU: `torch.cuda.max_memory_allocated` above the step's starting allocation.

Step time: fastest of `--reps` interleaved rounds (interference only ever adds time). Prints a table
and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CONFIGS = ("exact", "recompute_on", "recompute_off")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="llama-350m", help="preset under configs/model")
    p.add_argument("--num-layers", type=int, default=2, help="layers (the preset's shapes)")
    p.add_argument("--seq", type=int, default=256, help="sequence length (preset: 1024)")
    p.add_argument("--mbs", type=int, default=1, help="micro-batch size (sequences)")
    p.add_argument(
        "--microbatches", type=int, default=2, help="K micro-batches in the covering step"
    )
    p.add_argument("--reps", type=int, default=3, help="interleaved timed rounds")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--quick", action="store_true", help="seq 128, 2 rounds")
    p.add_argument("--out", default="bench_out/recompute_memory.json")
    return p.parse_args()


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_high_water() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _malloc_returns_large_blocks() -> None:
    """Every block >= 64 KiB gets its own mmap, unmapped on free (M_MMAP_THRESHOLD = -3,
    M_TRIM_THRESHOLD = -1): resident memory then tracks live tensor bytes."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)
    libc.mallopt(-1, 64 * 1024)


class CoveringRank:
    """A GPTModel with degraded-mode hooks; runs K micro-batches in one mode, no optimizer."""

    def __init__(self, model_cfg, args, device, recompute: bool):
        from bench_engine import synthetic_batch

        from megatron_mecefo.mcore.model import build_gpt_model
        from megatron_mecefo.mcore.parallel import seed_everything
        from megatron_mecefo.mecefo import MecefoConfig, install_degraded_mode

        seed_everything(1234)
        self.model = build_gpt_model(model_cfg)[0].to(device)
        self.controller = install_degraded_mode(self.model, MecefoConfig(recompute_ffn=recompute))
        self.batch = synthetic_batch(model_cfg, args.mbs, device)
        self.k = args.microbatches

    def micro_batch(self, degraded: bool) -> None:
        tokens, pos, labels = self.batch
        self.controller.set_degraded(degraded)
        loss = self.model(tokens, pos, attention_mask=None, labels=labels).float().mean()
        (loss / self.k).backward()
        self.controller.set_degraded(False)

    def step(self, degraded: bool) -> tuple[float, int]:
        """(seconds, peak bytes above the start) of K micro-batches in this mode."""
        import torch

        cuda = torch.cuda.is_available()
        self.model.zero_grad(set_to_none=False)  # gradient buffers stay allocated (baseline)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            _reset_high_water()
            base = _status_bytes("VmRSS")
        start = time.perf_counter()
        for _ in range(self.k):
            self.micro_batch(degraded)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() if cuda else _status_bytes("VmHWM")
        return seconds, peak - base

    def saved_bytes(self, degraded: bool) -> dict[int, int]:
        """Activation bytes autograd saves for one micro-batch (weights excluded), per layer
        (-1: outside the layers)."""
        from megatron_mecefo.mecefo.memory import saved_bytes_per_layer

        tokens, pos, labels = self.batch
        self.controller.set_degraded(degraded)
        try:
            layers = list(self.model.decoder.layers)
            with saved_bytes_per_layer(layers, self.model.parameters()) as saved:
                loss = self.model(tokens, pos, attention_mask=None, labels=labels).float().mean()
            del loss
        finally:
            self.controller.set_degraded(False)
        return dict(saved)


def run(args) -> dict:
    import torch

    from megatron_mecefo.config.loader import load_config
    from megatron_mecefo.mcore.config import ModelConfig, ParallelConfig
    from megatron_mecefo.mcore.parallel import init_parallel

    torch.set_num_threads(args.threads)
    ctx = init_parallel(ParallelConfig())
    model_cfg = load_config(
        ModelConfig,
        ROOT / "configs" / "model" / f"{args.model}.yaml",
        [f"num_layers={args.num_layers}", f"seq_length={args.seq}", "spec=local"],
    )
    print(
        f"{args.model} shapes: {model_cfg.num_layers} layers, d={model_cfg.hidden_size}, "
        f"f={model_cfg.ffn_hidden_size}, heads={model_cfg.num_attention_heads}, "
        f"vocab={model_cfg.vocab_size}, seq={model_cfg.seq_length}, mbs={args.mbs}, "
        f"K={args.microbatches} micro-batches per step, {args.threads} thread(s), {ctx.device}",
        flush=True,
    )
    ranks = {
        "recompute_on": CoveringRank(model_cfg, args, ctx.device, recompute=True),
        "recompute_off": CoveringRank(model_cfg, args, ctx.device, recompute=False),
    }
    runs = {"exact": (ranks["recompute_on"], False)}
    runs |= {name: (rank, True) for name, rank in ranks.items()}
    for rank, degraded in runs.values():  # warm-up: grads allocated, V computed (bucket 0)
        rank.controller.on_step_start(0)
        rank.step(degraded)
    best_s = {c: float("inf") for c in CONFIGS}
    peak_b = {c: 0 for c in CONFIGS}
    for rep in range(args.reps):
        for c in CONFIGS:
            seconds, peak = runs[c][0].step(runs[c][1])
            best_s[c] = min(best_s[c], seconds)
            peak_b[c] = max(peak_b[c], peak)
            print(f"  round {rep}: {c:<14} {seconds * 1e3:8.0f} ms  peak {peak / 2**20:8.1f} MiB")
    saved = {c: runs[c][0].saved_bytes(runs[c][1]) for c in CONFIGS}
    rows = []
    for c in CONFIGS:
        per_layer = [v for k, v in sorted(saved[c].items()) if k >= 0]
        rows.append(
            {
                "config": c,
                "step_s": best_s[c],
                "step_ratio_vs_exact": best_s[c] / best_s["exact"],
                "peak_bytes": peak_b[c],
                "peak_ratio_vs_exact": peak_b[c] / peak_b["exact"],
                "saved_bytes_per_layer": per_layer,
                "saved_bytes_outside_layers": saved[c].get(-1, 0),
            }
        )
    return {
        "model": args.model,
        "shapes": {
            k: getattr(model_cfg, k)
            for k in ("num_layers", "hidden_size", "ffn_hidden_size", "vocab_size", "seq_length")
        },
        "mbs": args.mbs,
        "microbatches": args.microbatches,
        "threads": args.threads,
        "reps": args.reps,
        "device": str(ctx.device),
        "memory_method": "cuda max_memory_allocated"
        if torch.cuda.is_available()
        else "VmHWM - VmRSS with mmap'd malloc",
        "rows": rows,
        "recompute_on_vs_off": {
            "step_time_ratio": best_s["recompute_on"] / best_s["recompute_off"],
            "peak_ratio": peak_b["recompute_on"] / peak_b["recompute_off"],
        },
    }


def print_table(result: dict) -> None:
    print(
        f"\n{'config':<16}{'step ms':>10}{'x exact':>9}{'peak MiB':>10}{'x exact':>9}"
        f"{'saved/layer MiB':>17}"
    )
    for r in result["rows"]:
        per_layer = r["saved_bytes_per_layer"]
        mean_layer = sum(per_layer) / max(1, len(per_layer)) / 2**20
        print(
            f"{r['config']:<16}{r['step_s'] * 1e3:>10.0f}{r['step_ratio_vs_exact']:>9.2f}"
            f"{r['peak_bytes'] / 2**20:>10.1f}{r['peak_ratio_vs_exact']:>9.2f}{mean_layer:>17.2f}"
        )
    on_off = result["recompute_on_vs_off"]
    print(
        f"recompute on / off: step time {on_off['step_time_ratio']:.3f}, "
        f"peak memory {on_off['peak_ratio']:.3f}"
    )


def main() -> int:
    args = parse_args()
    if args.quick:
        args.seq, args.reps = 128, 2
    _malloc_returns_large_blocks()
    result = run(args)
    print_table(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
