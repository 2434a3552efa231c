"""Distributed optimizer benchmark (`training.use_distributed_optimizer=true`, our ZeRO-1
`optim/sharded.py`) against megatron's replicated optimizer: state memory, step time, and what
moving shards costs after a failure.

    python tools/bench/sharded_optimizer.py                     # CPU: tiny and small, DP 1 2 4
    python tools/bench/sharded_optimizer.py --quick --out bench_out/sharded_optimizer.json
    python tools/bench/sharded_optimizer.py --skip-failover     # memory and step time only

1. Memory. One job of spawned gloo processes per DP size (`--dps`); in it every rank builds,
   for each model, megatron's optimizer and the sharded one on the same parallel state, runs one
   step (torch's Adam allocates its moments lazily) and counts the optimizer state it holds:
   replicated = the state tensors of megatron's torch optimizer(s) (under its ChainedOptimizer;
   `exp_avg` + `exp_avg_sq`, the scalar `step` left out) plus the fp32 master copies where the
   params are not fp32 (none on CPU: there the fp32 param is its own master, 8 bytes/param);
   sharded = `ShardedOptimizer.nbytes()` (fp32 master + 2 moments of the held shards, 12/DP
   bytes/param). The column "x2 copies" builds a second sharded optimizer with 2 copies per
   shard, what failover holds (`failover.shard_copies=2`). The largest rank is reported.
2. Step time. A static DP job (`--step-dp`, torchrun, fp32, the same batch) per configuration:
   replicated, sharded, sharded with the every-step in-memory snapshot (`snapshot.interval=1`
   under a temporary folder of /dev/shm), interleaved round by round (`--repeats`); the median
   of `step_time_s` in metrics.jsonl after `--warmup` steps, the median over rounds (and the
   1-minute load average after each run).
3. Shard moves under failover (tiny model; `sharded_failover_bench.py`): `mecefo-launch` with 4
   ranks and `training.use_distributed_optimizer=true mecefo.takeover_policy=spread
   failover.audit=true`, (a) rank 2 SIGKILLed at step 5 and back 3 steps later (`--inject
   kill:2:5:3`), (b) 2 nodes x 2 ranks (`launch/local/run.sh`, `--standby` spare nodes) with node
   1's agent and its children SIGKILLed at once after `--kill-at` steps. From events.jsonl: each
   `shard_adopt` (bytes moved, `transfer_ms` of the shard exchange) next to the regroup of the same
   generation (`latency_ms`: from the failure to the new generation's state and shards in place)
   and the detection latency; from the audit (`audit/shards_rank*.jsonl`) whether every shard had a
   holder after every step and its holders agreed bit for bit.

On a 2-core machine the ranks time-share: read the ratios within one run, not absolute times.
Prints tables and writes JSON. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "bench"))  # bench_common, bench_engine, failover, ...
sys.path.insert(0, str(ROOT))

from bench_common import (  # noqa: E402 - after the path fix
    bench_parser,
    cell,
    demo_job_args,
    ensure_demo,
    free_port,
    machine,
    median_of,
    write_json,
)
from sharded_failover_bench import (  # noqa: E402
    SHARDED,
    print_failover,
    run_job,
    run_kill,
    run_node_loss,
)

STEP_CONFIGS = {
    "replicated": ("training.use_distributed_optimizer=false",),
    "sharded": SHARDED,
    "sharded+snapshot": (*SHARDED, "snapshot.interval=1"),
    "replicated+snapshot": ("training.use_distributed_optimizer=false", "snapshot.interval=1"),
}
DEFAULT_CONFIGS = ["replicated", "sharded", "sharded+snapshot"]


def parse_args(argv=None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--models", nargs="+", default=["tiny", "small"], help="model presets")
    p.add_argument("--dps", type=int, nargs="+", default=[1, 2, 4], help="DP sizes (memory)")
    p.add_argument("--step-dp", type=int, default=4, help="DP size of the step-time runs")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--num-microbatches", type=int, default=2)
    p.add_argument("--steps", type=int, default=40, help="steps of each step-time run")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps of each step-time run")
    p.add_argument("--repeats", type=int, default=1, help="rounds of step-time runs")
    p.add_argument(
        "--configs",
        nargs="+",
        choices=list(STEP_CONFIGS),
        default=DEFAULT_CONFIGS,
        help="step-time configurations (replicated is the baseline of the ratios)",
    )
    p.add_argument("--failover-steps", type=int, default=40, help="steps of each failover run")
    p.add_argument("--kill-at", type=int, default=5, help="node loss: kill after this many steps")
    p.add_argument("--standby", type=int, default=1, help="node loss: standby nodes (0: none)")
    p.add_argument("--quick", action="store_true", help="fewer steps, step-time at DP 2")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-step-time", action="store_true")
    p.add_argument("--skip-failover", action="store_true")
    p.add_argument("--timeout-s", type=float, default=600, help="bound of each job")
    p.add_argument("--demo-dir", default=".cache/demo_data")
    p.add_argument("--out", "--json", dest="out", default="bench_out/sharded_optimizer.json")
    args = p.parse_args(argv)
    if args.quick:
        args.step_dp, args.steps, args.warmup = 2, 25, 5
    if args.warmup >= args.steps:
        p.error("--warmup must be below --steps")
    return args


# ------------------------------------------------------------------------------------- memory
def replicated_state_bytes(optimizer) -> dict[str, int]:
    """Bytes of megatron's (replicated) optimizer state on this rank: the moments of its torch
    optimizer(s) and, for a mixed-precision one, the fp32 master copies of the params."""
    import torch

    moments = master = 0
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if inner is None:  # a stub: this rank has no parameters
            continue
        for state in inner.state.values():
            for key, t in state.items():
                if torch.is_tensor(t) and key != "step":
                    moments += t.numel() * t.element_size()
        for group in getattr(part, "fp32_from_float16_groups", []):
            master += sum(p.numel() * p.element_size() for p in group)
    return {"moments": moments, "master": master, "total": moments + master}


def sharded_state_bytes(optimizer) -> dict[str, int]:
    """The same split for a `ShardedOptimizer` (its total is `nbytes()`)."""
    master = sum(st.master.numel() * st.master.element_size() for st in optimizer.held.values())
    total = optimizer.nbytes()
    return {"moments": total - master, "master": master, "total": total}


def memory_worker(rank: int, models, demo_dir: str, mbs: int) -> dict:
    """One rank of a DP job: for each model both optimizers after one step, and a 2-copy sharded
    one built on the same parameters."""
    import torch
    from bench_engine import build_bench_engine

    from megatron_mecefo.mcore import stack
    from megatron_mecefo.mcore.config import ParallelConfig
    from megatron_mecefo.mcore.parallel import init_parallel
    from megatron_mecefo.optim.sharded import AdamHyper, ShardedOptimizer

    torch.set_num_threads(1)
    ctx = init_parallel(ParallelConfig(backend="gloo"))
    out, engine = {}, None
    for model in models:
        row = {}
        for sharded in (False, True):
            engine = build_bench_engine(
                ctx,
                model,
                demo_dir=demo_dir,
                micro_batch_size=mbs,
                num_microbatches=1,
                max_steps=1,
                overrides=[f"training.use_distributed_optimizer={str(sharded).lower()}"],
            )
            engine.train_step(0)
            params = sum(p.numel() for p in engine.model.parameters())
            if sharded:
                row["sharded"] = sharded_state_bytes(engine.optimizer)
                row["numel"] = engine.optimizer.layout.numel
                tc = engine.cfg.training
                two = ShardedOptimizer(
                    stack.optimizer_param_groups(engine.ddp),
                    {p: n for n, p in engine.model.named_parameters()},
                    engine.membership,
                    AdamHyper((tc.adam_beta1, tc.adam_beta2), tc.adam_eps, tc.clip_grad),
                    lr=tc.lr,
                    weight_decay=tc.weight_decay,
                    copies=2,
                )
                row["sharded_x2"] = sharded_state_bytes(two)
                row["copies_x2"] = two.copies
                del two
            else:
                row["replicated"] = replicated_state_bytes(engine.optimizer)
                row["params"] = params
        out[model] = row
    if engine is not None:
        engine.close()  # destroys the parallel state the engines shared
    return out


def _spawned(fn, rank, world, port, args, queue) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
    )  # fmt: skip
    import traceback
    import warnings

    warnings.filterwarnings("ignore")  # PYTHONWARNINGS is read at start-up: too late here
    try:
        queue.put((rank, True, fn(rank, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))


def spawn(fn, world: int, *args, limit_s: float = 600) -> list:
    """`fn(rank, *args)` in `world` spawned processes wired as a gloo job; results by rank. A
    rank that fails or a job past `limit_s` raises RuntimeError (the processes are killed)."""
    import multiprocessing as mp
    import queue as queue_mod

    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_spawned, args=(fn, r, world, port, args, queue), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + limit_s
    try:
        while len(results) < world:
            try:
                rank, ok, value = queue.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"job of {world} ranks failed or timed out: {dead}"
                    ) from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(10 if len(results) == world else 0.5)
            if p.is_alive():
                p.kill()
                p.join(5)
    return [results[r] for r in range(world)]


def memory_rows(ranks: list[dict], dp: int) -> list[dict]:
    """One row per model: the largest rank's bytes of each optimizer, and bytes/param."""
    rows = []
    for model in ranks[0]:
        per = [r[model] for r in ranks]
        params = per[0]["params"]
        row = {"model": model, "dp": dp, "params": params, "numel": per[0]["numel"]}
        for kind in ("replicated", "sharded", "sharded_x2"):
            worst = max(per, key=lambda r, k=kind: r[k]["total"])[kind]
            row[f"{kind}_bytes"] = worst["total"]
            row[f"{kind}_master_bytes"] = worst["master"]
            row[f"{kind}_bytes_per_param"] = worst["total"] / params
            row[f"{kind}_bytes_by_rank"] = [r[kind]["total"] for r in per]
        row["copies_x2"] = per[0]["copies_x2"]
        row["sharded_over_replicated"] = row["sharded_bytes"] / row["replicated_bytes"]
        rows.append(row)
    return rows


def run_memory(args) -> list[dict]:
    rows = []
    for dp in args.dps:
        print(f"[bench] memory: DP {dp}, models {' '.join(args.models)}", flush=True)
        ranks = spawn(
            memory_worker,
            dp,
            args.models,
            args.demo_dir,
            args.micro_batch_size,
            limit_s=args.timeout_s,
        )
        rows += memory_rows(ranks, dp)
    return sorted(rows, key=lambda r: (args.models.index(r["model"]), r["dp"]))


# ---------------------------------------------------------------------------------- step time
def median_step_s(metrics: list[dict], warmup: int) -> float | None:
    return median_of(m.get("step_time_s") for m in metrics if m["step"] >= warmup)


def step_time_cmd(args, model: str, config: str, run_dir: Path, shm: Path) -> list[str]:
    extra = [
        f"model={model}",
        f"training.micro_batch_size={args.micro_batch_size}",
        f"training.num_microbatches={args.num_microbatches}",
        "training.precision=fp32",
        *STEP_CONFIGS[config],
    ]
    if "snapshot" in config:
        extra.append(f"snapshot.dir={shm}")
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(args.step_dp), "-m", "megatron_mecefo.train",
        *demo_job_args(args.steps, run_dir, args.demo_dir, *extra),
    ]  # fmt: skip


def run_step_time(args, tmp: Path) -> list[dict]:
    shm_root = Path(tempfile.mkdtemp(prefix="mecefo-bench-shm-", dir="/dev/shm"))
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    failed: dict[tuple[str, str], str] = {}
    snap: dict[tuple[str, str], dict] = {}
    loads: dict[tuple[str, str], list[float]] = defaultdict(list)  # 1-min load after each run
    try:
        for i in range(args.repeats):
            for model in args.models:
                for config in args.configs:
                    print(
                        f"[bench] step time {i + 1}/{args.repeats}: {model} {config}, "
                        f"DP {args.step_dp}, {args.steps} steps",
                        flush=True,
                    )
                    run_dir = tmp / f"step_{model}_{config}_{i}"
                    res = run_job(
                        step_time_cmd(args, model, config, run_dir, shm_root),
                        run_dir,
                        args.timeout_s,
                    )
                    loads[(model, config)].append(os.getloadavg()[0])
                    step_s = median_step_s(res["metrics"], args.warmup)
                    if res["exit_code"] != 0 or step_s is None:
                        failed[(model, config)] = f"exit {res['exit_code']}: {res['tail'][-800:]}"
                        print(f"[bench]   failed: {failed[(model, config)]}", flush=True)
                    else:
                        times[(model, config)].append(step_s)
                    if (res["summary"] or {}).get("snapshot"):  # rank 0's
                        snap[(model, config)] = res["summary"]["snapshot"]
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
    rows = []
    for model in args.models:
        base = median_of(times[(model, "replicated")])
        shard = median_of(times[(model, "sharded")])
        for config in args.configs:
            step_s = median_of(times[(model, config)])
            rows.append(
                {
                    "model": model,
                    "config": config,
                    "dp": args.step_dp,
                    "step_s": step_s,
                    "step_s_by_round": times[(model, config)],
                    "vs_replicated": step_s / base if step_s and base else None,
                    "vs_sharded": step_s / shard if step_s and shard else None,
                    "snapshot": snap.get((model, config)),
                    "loadavg_1m_by_round": loads[(model, config)],
                    "error": failed.get((model, config)),
                }
            )
    return rows


# -------------------------------------------------------------------------------------- output
def print_memory(rows: list[dict]) -> None:
    print("\noptimizer state per rank (largest rank), fp32 on CPU; bytes/param in brackets")
    print(
        f"{'model':<7}{'params':>10}{'DP':>4}{'replicated':>20}{'sharded':>20}"
        f"{'sharded x2 copies':>22}{'sh/rep':>8}"
    )
    for r in rows:

        def b(kind, r=r):
            return f"{r[kind + '_bytes'] / 1e6:.3f} MB ({r[kind + '_bytes_per_param']:.2f})"

        print(
            f"{r['model']:<7}{r['params']:>10,}{r['dp']:>4}{b('replicated'):>20}{b('sharded'):>20}"
            f"{b('sharded_x2'):>22}{r['sharded_over_replicated']:>8.2f}"
        )


def print_step_time(rows: list[dict], args) -> None:
    print(
        f"\nstep time, static DP {args.step_dp} (torchrun, fp32, micro-batch "
        f"{args.micro_batch_size} x {args.num_microbatches}), median of steps "
        f"{args.warmup}..{args.steps - 1}, median of {args.repeats} round(s)"
    )
    print(
        f"{'model':<7}{'optimizer':<21}{'step ms':>9}{'vs replicated':>15}{'vs sharded':>12}"
        f"{'snap MB/rank':>14}{'copy ms':>9}"
    )
    for r in rows:
        snap = r["snapshot"] or {}  # rank 0's last snapshot
        print(
            f"{r['model']:<7}{r['config']:<21}{cell(r['step_s'], '9.1f', scale=1000):>9}"
            f"{cell(r['vs_replicated'], '.3f'):>15}{cell(r['vs_sharded'], '.3f'):>12}"
            f"{cell(snap.get('bytes'), '.2f', scale=1e-6, missing='-'):>14}"
            f"{cell(snap.get('mean_copy_ms'), '.1f', missing='-'):>9}"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    ensure_demo(args.demo_dir)
    load_start, t0 = os.getloadavg()[0], time.monotonic()
    doc: dict = {"args": vars(args), "machine": machine(), "command": " ".join(sys.argv)}
    tmp = Path(tempfile.mkdtemp(prefix="mecefo-bench-sharded-"))
    ok = True
    try:
        if not args.skip_memory:
            doc["memory"] = run_memory(args)
            print_memory(doc["memory"])
        if not args.skip_step_time:
            doc["step_time"] = run_step_time(args, tmp)
            print_step_time(doc["step_time"], args)
            ok &= all(r["error"] is None for r in doc["step_time"])
        if not args.skip_failover:
            doc["failover"] = [run_kill(args, tmp), run_node_loss(args, tmp)]
            print_failover(doc["failover"])
            ok &= all(r["ok"] for r in doc["failover"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc["wall_s"] = time.monotonic() - t0
    doc["loadavg_1m"] = [load_start, os.getloadavg()[0]]
    write_json(doc, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
