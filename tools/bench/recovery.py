"""Recovery-state benchmark: what in-memory snapshots cost and how fast each source restores.

    python tools/bench/recovery.py                       # tiny + small on CPU
    python tools/bench/recovery.py --quick --out bench_out/recovery.json

Per model (one process, the real Engine and SnapshotHook):
1. Snapshot overhead: median step time (train step + save point) with snapshots every 1, 2 and 5
   steps vs off, interleaved A/B rounds; plus the time the step itself was blocked (save point +
   wait before the next update), which is the part the snapshot adds to the critical path.
2. Copy bandwidth of the snapshot (tensors into the shared-memory slot) vs a plain memcpy of the
   same bytes into a preallocated buffer and into the same shared-memory file.
3. Restore time of the same state from: the node's shared-memory slot; a parity rebuild (3 nodes,
   XOR, parity services over localhost TCP, then the slot load); a dist_checkpointing folder.
Then XOR and Reed-Solomon encode GB/s, and parity memory overhead vs full replication.

Prints tables and writes JSON. A benchmark, not a test: on the 2-core machine read ratios from one
run, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", nargs="*", default=["tiny", "small"], help="none: only e2e")
    p.add_argument("--steps", type=int, default=12, help="timed steps per config and round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of all intervals")
    p.add_argument("--intervals", type=int, nargs="+", default=[1, 2, 5])
    p.add_argument("--encode-mb", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--e2e-steps", type=int, default=20, help="steps of each end-to-end job")
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end recovery jobs")
    p.add_argument(
        "--no-restore", action="store_true", help="skip the restore times (shm, parity, disk)"
    )
    p.add_argument("--quick", action="store_true", help="fewer steps/rounds, tiny model only")
    p.add_argument("--out", default=str(ROOT / "bench_out" / "recovery.json"))
    return p.parse_args()


def _engine(ctx, model: str, demo_dir: str, shm: Path):
    from tools.bench.bench_engine import build_bench_engine

    return build_bench_engine(
        ctx, model, demo_dir=demo_dir, micro_batch_size=4, num_microbatches=2, max_steps=100000
    )


def overhead(engine, shm: Path, args, say) -> dict:
    """Median step time per snapshot interval (0 = off), rounds interleaved."""
    from megatron_mecefo.config.snapshot import SnapshotConfig
    from megatron_mecefo.snapshot.hook import SnapshotHook

    times: dict[int, list[float]] = {i: [] for i in [0, *args.intervals]}
    blocked: dict[int, list[float]] = {i: [] for i in times}
    step = 0
    for rnd in range(args.rounds):
        for interval in times:
            cfg = SnapshotConfig(interval=interval)
            hook = SnapshotHook(cfg, shm / f"i{interval}", 0, max_steps=10**9, log=say)
            engine.before_update.clear()
            hook.attach(engine)
            for i in range(args.steps + 1):
                t0 = time.perf_counter()
                result = engine.train_step(step)
                t1 = time.perf_counter()
                hook.after_step(engine, result, {})
                t2 = time.perf_counter()
                if i > 0:  # the first step of a block pays one-off costs (slot files created)
                    times[interval].append(t2 - t0)
                    blocked[interval].append(t2 - t1)
                step += 1
            blocked_wait = hook.stats["blocked_s"]
            hook.wait_done()
            blocked[interval][-args.steps :] = [
                b + blocked_wait / args.steps for b in blocked[interval][-args.steps :]
            ]
            engine.before_update.clear()
            hook.pair.close() if hook.pair else None
        say(f"  round {rnd + 1}/{args.rounds} done")
    base = statistics.median(times[0])
    rows = {}
    for interval, ts in times.items():
        med = statistics.median(ts)
        rows[interval] = {
            "median_step_s": med,
            "overhead_pct": 100 * (med - base) / base,
            "blocked_ms_per_step": 1000 * statistics.mean(blocked[interval]),
            "blocked_pct": 100 * statistics.mean(blocked[interval]) / base,
        }
    return rows


def copy_bandwidth(engine, shm: Path) -> dict:
    """Snapshot copy vs plain memcpy of the same bytes (GB/s, best of 5)."""
    import mmap

    import torch

    from megatron_mecefo.snapshot.slots import HEADER, SlotPair, plan_layout
    from megatron_mecefo.training import state as train_state

    state = train_state.state_dict(engine, 0)
    skeleton, refs, tensors, payload = plan_layout(state)
    nbytes = sum(r.nbytes for r in refs)
    pair = SlotPair(shm / "bw", 0)
    slot = pair.slots[0]
    slot.begin(0, skeleton, refs, payload)
    base = HEADER + len(skeleton)

    def snapshot_copy() -> None:
        for ref, t in zip(refs, tensors):
            slot.copy_tensor(base + ref.offset, t)

    flat = [t.reshape(-1).view(torch.uint8) for t in tensors]
    dram = torch.empty(nbytes, dtype=torch.uint8)
    path = shm / "bw" / "plain.bin"
    with open(path, "wb") as fh:
        fh.truncate(nbytes)
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, nbytes)
    os.close(fd)
    shm_view = torch.frombuffer(mm, dtype=torch.uint8)

    def memcpy_into(dst) -> None:
        off = 0
        for f in flat:
            dst[off : off + f.numel()].copy_(f)
            off += f.numel()

    def best(fn) -> float:
        """Best of 5, in a plain thread as the snapshot hook copies (outside the main thread's
        CPU-compatibility torch-function mode)."""
        out: list[float] = []

        def run() -> None:
            fn()
            for _ in range(5):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        return min(out)

    t_snap, t_dram, t_shm = (
        best(snapshot_copy),
        best(lambda: memcpy_into(dram)),
        best(lambda: memcpy_into(shm_view)),
    )
    shm_view = None  # release the buffer export before closing the map
    mm.close()
    pair.close()
    gb = nbytes / 1e9
    return {
        "bytes": nbytes,
        "snapshot_copy_gbps": gb / t_snap,
        "memcpy_dram_gbps": gb / t_dram,
        "memcpy_shm_gbps": gb / t_shm,
        "snapshot_vs_memcpy_shm": t_shm / t_snap,
        "snapshot_vs_memcpy_dram": t_dram / t_snap,
    }


def restore_times(engine, shm: Path, ckpt_dir: Path, say) -> dict:
    """Time to get the state back from shared memory, from parity, and from disk."""
    from megatron_mecefo.checkpoint import layout
    from megatron_mecefo.checkpoint.manager import CheckpointManager
    from megatron_mecefo.config.checkpoint import CheckpointConfig
    from megatron_mecefo.config.snapshot import SnapshotConfig
    from megatron_mecefo.mcore import checkpointing
    from megatron_mecefo.snapshot import codec, smp
    from megatron_mecefo.snapshot.hook import SnapshotHook
    from megatron_mecefo.snapshot.parity import ParityService
    from megatron_mecefo.snapshot.slots import SlotPair
    from megatron_mecefo.training import state as train_state

    nodes = [shm / f"node{i}" for i in range(3)]
    for directory in nodes:  # three "nodes", each with this rank's snapshot
        hook = SnapshotHook(SnapshotConfig(interval=1), directory, 0, max_steps=10**9, log=say)
        hook.save(engine, 7)
        hook.wait_done()
        hook.pair.close()

    t0 = time.perf_counter()
    state = SlotPair(nodes[0], 0).read_at(7)
    train_state.load_state_dict(engine, state)
    t_shm = time.perf_counter() - t0

    services = []
    for i, directory in enumerate(nodes):
        svc = ParityService(
            i,
            codec.StripeLayout(3, 1),
            codec.XorCode(),
            directory / "parity",
            lambda: {j: s.address for j, s in enumerate(services)},
            lambda step, d=directory: smp.node_blob(d, [0], step),
            log=lambda m: None,
        )
        services.append(svc)
    for svc in services:
        svc.start()
    for i, svc in enumerate(services):
        svc.publish(7, memoryview(smp.node_blob(nodes[i], [0], 7)))
    for svc in services:
        svc.flush(60)
    deadline = time.monotonic() + 30
    while any(s.parity_step() != 7 for s in services) and time.monotonic() < deadline:
        time.sleep(0.01)
    lost = shm / "node1-rebuilt"
    t0 = time.perf_counter()
    step, blob = services[1].rebuild(lost_node=1)
    smp.restore_blob(lost, blob)
    t_rebuild = time.perf_counter() - t0
    train_state.load_state_dict(engine, SlotPair(lost, 0).read_at(step))
    t_parity = time.perf_counter() - t0
    for svc in services:
        svc.close()

    folder = layout.step_dir(ckpt_dir, 7)
    folder.mkdir(parents=True)
    checkpointing.save(engine, str(folder), 7, async_save=False)
    layout.write_marker(folder, 7, {"tp": 1})
    mgr = CheckpointManager(
        CheckpointConfig(dir=str(ckpt_dir)),
        str(ckpt_dir),
        max_steps=8,
        tp_size=1,
        log=lambda m: None,
    )
    t0 = time.perf_counter()
    mgr.resume(engine, (folder, layout.validate(folder)))
    t_disk = time.perf_counter() - t0  # includes the SHA-256 validation of every file
    return {
        "state_mb": len(blob) / 1e6,
        "shm_s": t_shm,
        "parity_rebuild_s": t_rebuild,
        "parity_total_s": t_parity,
        "disk_s": t_disk,
    }


E2E_CASES = {
    # name: (overrides, injections)
    "snapshot: every trainer killed": (
        ["snapshot.interval=1"],
        ["kill:0:10", "kill:1:10"],
    ),
    "checkpoint-restart from disk (interval 5)": (
        ["recovery.mode=restart", "checkpoint.interval=5", "checkpoint.async_save=false"],
        ["kill:1:12"],
    ),
    "checkpoint-restart from snapshot": (
        ["recovery.mode=restart", "snapshot.interval=1"],
        ["kill:1:12"],
    ),
}


def end_to_end(demo_dir: str, work: Path, steps: int, say) -> dict:
    """Real jobs (mecefo-launch, 2 ranks): time from the failure until the job trains again on
    recovered state, the source used, and the steps recomputed."""
    import subprocess

    out = {}
    for name, (overrides, injections) in E2E_CASES.items():
        run_dir = work / f"e2e-{len(out)}"
        from megatron_mecefo.failover.node.agent_cli import launch_command

        train = [
            "--config",
            str(ROOT / "configs" / "run" / "demo_cpu.yaml"),
            "--run-dir",
            str(run_dir),
            "--max-steps",
            str(steps),
            f"data.demo_dir={demo_dir}",
            "training.eval_interval=0",
            "logging.print_interval=0",
            *overrides,
        ]
        cmd = launch_command(train, nproc_per_node=2, flags=["--restart-delay-s", "0.5"])
        for spec in injections:
            cmd += ["--inject", spec]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        wall = time.perf_counter() - t0
        events_path = run_dir / "events.jsonl"
        events = (
            [json.loads(x) for x in events_path.read_text().splitlines() if x.strip()]
            if events_path.exists()
            else []
        )
        failures = [e for e in events if e["type"] == "failure"]
        recover = [
            e for e in events if e["type"] == "regroup" and "recover" in (e.get("detail") or "")
        ]
        loaded = [e for e in events if e["type"] == "recovery"]
        lines = [ln for ln in proc.stdout.splitlines() if "recovered the state of step" in ln]
        row = {
            "exit": proc.returncode,
            "wall_s": wall,
            "failure_step": failures[0]["step"] if failures else None,
            "recovery_ms": recover[0].get("latency_ms") if recover else None,
            "resumed_step": max((e["step"] for e in loaded), default=None),
            "source": lines[0].split(" from ", 1)[1].split(" (")[0] if lines else None,
        }
        if row["failure_step"] is not None and row["resumed_step"] is not None:
            row["steps_recomputed"] = row["failure_step"] - row["resumed_step"]
        out[name] = row
        say(f"  {name}: exit {proc.returncode}, recovery {row['recovery_ms']} ms")
    return out


def main() -> int:
    args = parse_args()
    if args.quick:
        args.models, args.steps, args.rounds, args.encode_mb = ["tiny"], 6, 2, 16
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import torch

    torch.set_num_threads(args.threads)
    from megatron_mecefo.data.config import DataConfig
    from megatron_mecefo.data.demo import ensure_demo_corpus
    from megatron_mecefo.mcore.config import ParallelConfig
    from megatron_mecefo.mcore.parallel import init_parallel
    from megatron_mecefo.snapshot import codec

    say = lambda m: print(m, flush=True)  # noqa: E731
    work = Path(tempfile.mkdtemp(prefix="mecefo-bench-"))
    shm_base = Path("/dev/shm") if Path("/dev/shm").is_dir() else work
    shm = Path(tempfile.mkdtemp(prefix="mecefo-bench-", dir=shm_base))
    demo = work / "demo"
    data_cfg = DataConfig()
    ensure_demo_corpus(
        str(demo),
        num_documents=data_cfg.demo_num_documents,
        seed=data_cfg.demo_seed,
        vocab_size=data_cfg.demo_vocab_size,
    )
    ctx = init_parallel(ParallelConfig())
    out: dict = {"machine": _machine(), "threads": args.threads, "models": {}}
    try:
        for model in args.models:
            say(f"[{model}] building")
            engine = _engine(ctx, model, str(demo), shm)
            res = {"overhead": overhead(engine, shm / model, args, say)}
            res["copy"] = copy_bandwidth(engine, shm / model)
            if not args.no_restore:
                res["restore"] = restore_times(
                    engine, shm / f"{model}-r", work / f"{model}-ckpt", say
                )
            out["models"][model] = res
            _print_model(model, res)
        if not args.no_e2e:
            say("[end-to-end] real jobs under mecefo-launch, 2 ranks")
            out["end_to_end"] = end_to_end(str(demo), work, args.e2e_steps, say)
            _print_e2e(out["end_to_end"])
        mb = args.encode_mb << 20
        out["encode_gbps"] = {
            "xor_k4": codec.encode_gbps(codec.XorCode(), mb, repeats=3),
            "rs_k4_m2": codec.encode_gbps(codec.ReedSolomonCode(2), mb, repeats=3),
        }
        out["memory_overhead"] = {
            "xor_n4": codec.memory_overhead(4, 1),
            "xor_n8": codec.memory_overhead(8, 1),
            "rs_n8_m2": codec.memory_overhead(8, 2),
            "replication_f2": codec.replication_overhead(2),
        }
        print(
            f"\nencode ({args.encode_mb} MB, k=4): XOR {out['encode_gbps']['xor_k4']:.2f} GB/s, "
            f"RS(m=2) {out['encode_gbps']['rs_k4_m2']:.2f} GB/s"
        )
        mo = out["memory_overhead"]
        print(
            f"extra memory per node: XOR n=4 {mo['xor_n4']:.2f}, n=8 {mo['xor_n8']:.2f}, "
            f"RS n=8 m=2 {mo['rs_n8_m2']:.2f}; full replication F=2: {mo['replication_f2']:.2f}"
        )
    finally:
        import shutil

        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


def _print_model(model: str, res: dict) -> None:
    print(f"\n== {model}: snapshot overhead (median step, blocked = save point + wait)")
    print(f"{'interval':>9} {'step ms':>9} {'overhead':>9} {'blocked ms':>11} {'blocked %':>10}")
    for interval, row in res["overhead"].items():
        print(
            f"{interval or 'off':>9} {1000 * row['median_step_s']:9.2f} "
            f"{row['overhead_pct']:8.1f}% {row['blocked_ms_per_step']:11.3f} "
            f"{row['blocked_pct']:9.2f}%"
        )
    c = res["copy"]
    print(
        f"copy {c['bytes'] / 1e6:.1f} MB: snapshot {c['snapshot_copy_gbps']:.2f} GB/s, memcpy to "
        f"shm {c['memcpy_shm_gbps']:.2f} GB/s ({100 * c['snapshot_vs_memcpy_shm']:.0f}%), to DRAM "
        f"{c['memcpy_dram_gbps']:.2f} GB/s"
    )
    r = res.get("restore")
    if r is None:
        return
    print(
        f"restore {r['state_mb']:.1f} MB: shared memory {1000 * r['shm_s']:.0f} ms, parity "
        f"rebuild {1000 * r['parity_rebuild_s']:.0f} ms "
        f"(with load {1000 * r['parity_total_s']:.0f} ms), disk {1000 * r['disk_s']:.0f} ms"
    )


def _print_e2e(rows: dict) -> None:
    print("\n== end to end (2 ranks, tiny): failure -> training again on recovered state")
    print(f"{'case':<44} {'recovery ms':>12} {'source':<40} {'recomputed':>10}")
    for name, r in rows.items():
        ms = f"{r['recovery_ms']:.0f}" if r.get("recovery_ms") is not None else "-"
        print(
            f"{name:<44} {ms:>12} {str(r.get('source'))[:40]:<40} "
            f"{str(r.get('steps_recomputed', '-')):>10}"
        )


def _machine() -> str:
    import platform

    return f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}, CPU"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
