"""The parts of the one-call GPU check (`tools/gpu/check.py`): what each runs, its time bound, what
it needs, and the one-line figure its JSON gives for the table.

Bounds add up to `BUDGET_S` with check.sh's wheel install and the environment probe: one device
call of at most 9 minutes. Arguments are sized for one H100/H200; `{json}` is the part's JSON path.
No torch import here (the dry mode runs without it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

BUDGET_S = 540
"""One device call: 9 minutes, all parts, the install and the probe included."""
INSTALL_BOUND_S = 45
"""check.sh's `pip install --no-index` of the carried wheels (keep in step with check.sh)."""
ENV_BOUND_S = 30
"""The environment probe (imports torch, asks CUDA and nvidia-smi)."""


@dataclasses.dataclass(frozen=True)
class Part:
    """One bounded piece of the check; `runs` are (label, argv after the python executable)."""

    name: str
    title: str
    bound_s: int
    needs: tuple[str, ...]
    """Of "cuda", "megatron", "triton", "nvidia-smi": skipped with a line when one is missing."""
    runs: tuple[tuple[str, tuple[str, ...]], ...]
    summary: Callable[[dict], str]
    stop_on_failure: bool = True
    """With several runs: stop at the first that fails (a preset that does not fit)."""

    @property
    def scripts(self) -> list[str]:
        return sorted({argv[0] for _, argv in self.runs})


def _pct(x) -> str:
    return f"{100 * x:.1f}%" if isinstance(x, int | float) else "n/a"


def _step_time(res: dict) -> str:
    r = res["rows"][0]
    return (
        f"{r['model']}: {1e3 * r['step_time_s']:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s, "
        f"MFU {_pct(r['mfu'])} ({r['device']})"
    )


def _largest(res: dict) -> str:
    tried = ", ".join(f"{k} {v['status']}" for k, v in res["tried"].items())
    return f"largest that fits: {res['largest_fit'] or 'none tried fits'} ({tried})"


def _degraded(res: dict) -> str:
    m = res["models"][0]
    cost = m["cost_model"]
    exact = cost["exact_microbatch_s"]
    sets = ", ".join(
        f"{key} {1e3 * s:.1f} ms ({s / exact:.2f}x)"
        for key, s in cost["technique_microbatch_s"].items()
    )
    ratios = {r["scenario"]: r["ratio"] for r in m["rows"]}
    return (
        f"{m['model']}: exact micro-batch {1e3 * exact:.1f} ms; degraded {sets}; step ratio "
        f"NDB {ratios.get('ndb_naive', 0):.2f}, MeCeFO neighbour "
        f"{ratios.get('mecefo_neighbor', 0):.2f}"
    )


def _kernels(res: dict) -> str:
    checked = res.get("check", [])
    ok = sum(c["ok"] for c in checked)
    worst = max((c["rel_err"] / c["tolerance"] for c in checked), default=0.0)
    ratios = res["step_ratios"]
    fused = min(r["ratio_fused"] for r in ratios), max(r["ratio_fused"] for r in ratios)
    return (
        f"{res['meta']['note'].split(':')[0]}; check {ok}/{len(checked)} within tolerance "
        f"(worst {worst:.2f} of it); degraded/exact FFN-linear time fused "
        f"{fused[0]:.2f}-{fused[1]:.2f}"
    )


def _recovery(res: dict) -> str:
    model, m = next(iter(res["models"].items()))
    on = m["overhead"].get("1") or m["overhead"].get(1)
    c = m["copy"]
    return (
        f"{model}: snapshot copy {c['snapshot_copy_gbps']:.1f} GB/s ({c['bytes'] / 1e9:.2f} GB), "
        f"memcpy to shm {c['memcpy_shm_gbps']:.1f} GB/s; interval 1: step "
        f"{on['overhead_pct']:+.1f}%, blocked {on['blocked_ms_per_step']:.1f} ms/step"
    )


def _health(res: dict) -> str:
    return f"check_gpu: {res['reason'] or 'None (healthy)'}; nvidia-smi: {res['smi'].strip()}"


def _preset(model: str) -> tuple[str, ...]:
    return (
        "tools/bench/step_time.py",
        *("--models", model, "--micro-batch-size", "1", "--warmup", "1", "--steps", "2"),
        *("--out", "{json}"),
    )


PARTS: tuple[Part, ...] = (
    Part(
        "gpu_health",
        "health check (gpu_health.check_gpu) against the real nvidia-smi",
        20,
        ("nvidia-smi",),
        (("", ("tools/gpu/probe.py", "health", "--out", "{json}")),),
        _health,
    ),
    Part(
        "step_time",
        "megatron GPTModel, local spec, bf16: llama-350m step time, tokens/s, MFU",
        90,
        ("cuda", "megatron"),
        (
            (
                "",
                (
                    "tools/bench/step_time.py",
                    *("--models", "llama-350m", "--micro-batch-size", "4", "--seq-length", "1024"),
                    *("--warmup", "3", "--steps", "10", "--out", "{json}"),
                ),
            ),
        ),
        _step_time,
    ),
    Part(
        "degraded",
        "MeCeFO degraded mode: normal vs degraded micro-batches (each technique, all together)",
        150,
        ("cuda", "megatron"),
        (
            (
                "",
                (
                    "tools/bench/degraded.py",
                    *("--models", "llama-350m", "--mbs", "4", "--microbatches", "4"),
                    *("--reps", "3", "--replicas", "4", "8"),
                    *("--techniques", "skip", "recompute", "lowrank", "skip+lowrank"),
                    *("--set", "mecefo.recompute_ffn=true", "--out", "{json}"),
                ),
            ),
        ),
        _degraded,
    ),
    Part(
        "kernels",
        "Triton low-rank kernels compiled: error vs reference, time vs torch",
        60,
        ("cuda", "triton"),
        (
            (
                "",
                (
                    "tools/bench/kernels.py",
                    *("--models", "llama-350m,llama-1b,llama-7b", "--tokens", "4096"),
                    *("--ranks", "64,128,256", "--dtype", "bf16", "--check", "--out", "{json}"),
                ),
            ),
        ),
        _kernels,
    ),
    Part(
        "recovery",
        "snapshot path: GPU -> shared-memory copy bandwidth, step time at interval 1",
        90,
        ("cuda", "megatron"),
        (
            (
                "",
                (
                    "tools/bench/recovery.py",
                    *("--models", "llama-350m", "--intervals", "1", "--steps", "5"),
                    *("--rounds", "2", "--no-e2e", "--no-restore", "--encode-mb", "64"),
                    *("--threads", "8", "--out", "{json}"),
                ),
            ),
        ),
        _recovery,
    ),
    Part(
        "largest_preset",
        "the largest preset whose training step fits (micro-batch 1)",
        55,
        ("cuda", "megatron"),
        (("llama-1b", _preset("llama-1b")), ("llama-7b", _preset("llama-7b"))),
        _largest,
    ),
)


def total_bound_s() -> int:
    """Install + environment probe + every part: what one call can take at most."""
    return INSTALL_BOUND_S + ENV_BOUND_S + sum(p.bound_s for p in PARTS)
