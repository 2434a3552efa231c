"""Per-GPU memory of real run configs: weights, gradients and the optimizer replicated or sharded.

    python tools/memory_table.py configs/run/llama-70b-128n.yaml configs/run/llama-405b-2048n.yaml \
        --json bench_out/memory.json

One GPU of the largest pipeline stage, GB = 1e9 bytes: bf16 weights (2 bytes a parameter), fp32
gradient buffer (4), Adam state (12: fp32 master, exp_avg, exp_avg_sq) replicated, sharded over DP
(12 / DP) or sharded with each shard on R = 2 replicas (24 / DP). Activations excluded. The world
size is N nodes x --gpus-per-node from a `-<N>n.yaml` name, or `PATH:WORLD`. The arithmetic is
`megatron_mecefo.sim.layout` (`memory_per_gpu`); this prints and writes JSON only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from megatron_mecefo.config.loader import load_config
from megatron_mecefo.config.run import RunConfig
from megatron_mecefo.errors import ConfigError, ExitCode
from megatron_mecefo.sim.layout import GpuMemory, memory_per_gpu

GB = 1e9
COLUMNS = (
    "weights",
    "grads",
    "opt replicated",
    "opt sharded R=1",
    "opt sharded R=2",
    "total replicated",
    "total R=1",
    "total R=2",
)


def world_size(spec: str, gpus_per_node: int) -> tuple[Path, int]:
    """'PATH:WORLD' or a 'name-<N>n.yaml' path -> (path, world size)."""
    path, _, world = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if world:
        return Path(path), int(world)
    m = re.search(r"-(\d+)n\.ya?ml$", spec)
    if not m:
        raise ConfigError(f"{spec}: no '-<N>n.yaml' node count in the name; pass PATH:WORLD")
    return Path(spec), int(m.group(1)) * gpus_per_node


def row(config: Path, mem: GpuMemory, world: int) -> dict:
    """One table row: the layout, then GB per GPU."""
    opt = {
        "replicated": mem.optimizer_replicated,
        "R=1": mem.optimizer_sharded(1),
        "R=2": mem.optimizer_sharded(2),
    }
    gb = [mem.weights, mem.grads, *opt.values(), *(mem.total(v) for v in opt.values())]
    return {
        "config": str(config),
        "model": mem.name,
        "world_size": world,
        "tp": mem.tp,
        "pp": mem.pp,
        "dp": mem.dp,
        "parameters_per_gpu": mem.parameters_per_gpu,
        "gb_per_gpu": {c: round(v / GB, 2) for c, v in zip(COLUMNS, gb, strict=True)},
    }


def markdown(rows: list[dict]) -> str:
    head = ["run config", "GPUs (TP x PP x DP)", "params/GPU", *COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        layout = f"{r['world_size']} ({r['tp']} x {r['pp']} x {r['dp']})"
        cells = [Path(r["config"]).name, layout, f"{r['parameters_per_gpu'] / 1e9:.3f} B"]
        cells += [f"{r['gb_per_gpu'][c]:.2f}" for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("configs", nargs="+", help="run configs: name-<N>n.yaml, or PATH:WORLD")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)
    try:
        rows = []
        for spec in args.configs:
            path, world = world_size(spec, args.gpus_per_node)
            rows.append(row(path, memory_per_gpu(load_config(RunConfig, path), world), world))
    except (ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    print(markdown(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"gb": GB, "rows": rows}, indent=2) + "\n")
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
