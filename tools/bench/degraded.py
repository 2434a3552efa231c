"""Per-rank step time and peak activation memory of MeCeFO takeover modes, one process at a time.

    python tools/bench/degraded.py                                   # CPU: tiny and small
    python tools/bench/degraded.py --models small --microbatches 8 --reps 7
    python tools/bench/degraded.py --svd-shapes llama-350m llama-1b  # exact vs randomized SVD cost
    python tools/bench/degraded.py --models llama-350m --num-layers 8 --mbs 4   # GPU (unverified)
    python tools/bench/degraded.py --models small --skip-layers off first:1 last:1 all

With `--skip-layers` it runs only the skip-layer sweep instead: for each
`mecefo.skip_attention_layers` setting (`off` = `mecefo.skip_attention_backward=false`), a step of
M exact and a step of M degraded micro-batches on an engine built with it, settings interleaved
round by round (the time axis of an accuracy/time curve; default JSON
bench_out/degraded_skip_layers.json).

For each model: a normal rank (M exact micro-batches), naive Neighbor-Do-Both (2M exact), MeCeFO
neighbour (2M degraded), and the slowest rank of `spread` and `hybrid` for n = 4, 8, 32 (one dead
replica; hybrid planned with a cost model calibrated on held-out task lists on a separate engine,
or read from an earlier run with --calibration, so every "pred" is out of sample; the JSON
records the prediction error of each row and whether the fallback cost model was used). Each
scenario is one real training step (`Engine.train_step` with the scenario's task list as its
plan: megatron schedule, DDP `main_grad` accumulation, megatron AdamW) on a world-1 job over the
demo corpus; DP communication is not included (per-rank compute, as DESIGN.md section 4
prescribes on CPU). Peak activation memory: CPU = bytes autograd saves for one micro-batch
(saved-tensor hooks), GPU = torch.cuda.max_memory_allocated above the weights. Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "bench"))  # bench_common, bench_engine
sys.path.insert(0, str(ROOT))

from bench_common import (  # noqa: E402 - after the path fix
    bench_parser,
    fastest_of_rounds,
    init_torch,
    sync,
    timed_train_step,
    write_json,
)


def parse_args() -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--models", nargs="*", default=None, help="presets (default: tiny small on CPU)")
    p.add_argument("--num-layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--mbs", type=int, default=4, help="micro-batch size (sequences)")
    p.add_argument("--microbatches", type=int, default=8, help="M, micro-batches per replica")
    p.add_argument(
        "--replicas", type=int, nargs="+", default=[4, 8, 32], help="n for spread/hybrid"
    )
    p.add_argument("--target-ratio", type=float, default=1.15, help="hybrid's step-time bound")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per scenario (min)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--svd-shapes", nargs="*", default=[], help="presets whose FFN SVD cost to time")
    p.add_argument(
        "--grad-error-steps",
        type=int,
        default=0,
        help="also report the degraded gradient error after this many exact steps",
    )
    p.add_argument("--demo-dir", default=".cache/demo_data", help="embedded demo corpus location")
    p.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="run-config overrides for every engine, e.g. mecefo.recompute_ffn=true (so that the "
        "recompute technique can be calibrated)",
    )
    p.add_argument(
        "--calibration",
        default=None,
        help="degraded.json of an earlier run whose cost model the planner uses (default: "
        "calibrate here on held-out task lists)",
    )
    p.add_argument(
        "--techniques",
        nargs="*",
        default=["skip", "lowrank"],
        help="technique sets (DegradedTechniques keys) to calibrate besides the configured one: "
        "the candidates of the hybrid_auto rows (mecefo.hybrid_techniques=auto); sets that are "
        "not subsets of the configured switches are skipped",
    )
    p.add_argument(
        "--skip-layers",
        nargs="+",
        default=None,
        metavar="SETTING",
        help="run only the skip-layer sweep over these mecefo.skip_attention_layers settings "
        "(all, first:K, last:K, every:K, 0,2,5; off = skip_attention_backward=false)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="JSON output (default bench_out/degraded.json; with --skip-layers "
        "bench_out/degraded_skip_layers.json)",
    )
    args = p.parse_args()
    if args.out is None:
        args.out = f"bench_out/degraded{'_skip_layers' if args.skip_layers else ''}.json"
    return args


def load_model_cfg(name: str, num_layers: int | None):
    from megatron_mecefo.config.loader import load_config
    from megatron_mecefo.mcore.config import ModelConfig

    overrides = [f"num_layers={num_layers}"] if num_layers else []
    return load_config(ModelConfig, ROOT / "configs" / "model" / f"{name}.yaml", overrides)


class BareModel:
    """A GPTModel + torch AdamW without megatron DDP, for per-parameter `.grad` comparisons."""

    def __init__(self, model_cfg, args, device, hooked: bool = True):
        import torch
        from bench_engine import synthetic_batch

        from megatron_mecefo.mcore.model import build_gpt_model
        from megatron_mecefo.mcore.parallel import seed_everything
        from megatron_mecefo.mecefo import MecefoConfig, install_degraded_mode

        seed_everything(1234)
        self.model = build_gpt_model(model_cfg)[0].to(device)
        self.controller = install_degraded_mode(self.model, MecefoConfig(enabled=hooked))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.m = args.microbatches
        self.device = device
        self.batch = synthetic_batch(model_cfg, args.mbs, device)

    def micro_batch(self, degraded: bool) -> None:
        tokens, pos, labels = self.batch
        if self.controller.enabled:
            self.controller.set_degraded(degraded)
        loss = self.model(tokens, pos, attention_mask=None, labels=labels).float().mean()
        (loss / self.m).backward()

    def step(self, degraded_flags: list[bool], step: int = 0) -> float:
        """One step with these micro-batch modes; returns seconds."""
        sync()
        start = time.perf_counter()
        if self.controller.enabled:
            self.controller.on_step_start(step)
        for flag in degraded_flags:
            self.micro_batch(flag)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - start


class EngineRank:
    """One rank's real training step: `Engine.train_step` (megatron schedule, DDP main_grad
    accumulation, megatron AdamW) on a world-1 job, running a scenario's task list as its plan."""

    def __init__(self, name: str, args, ctx, hooked: bool = True, overrides: tuple = ()):
        from bench_engine import build_bench_engine

        overrides = [f"mecefo.enabled={str(hooked).lower()}", *args.set, *overrides]
        if args.num_layers:
            overrides.append(f"model.num_layers={args.num_layers}")
        self.engine = build_bench_engine(
            ctx,
            name,
            demo_dir=args.demo_dir,
            micro_batch_size=args.mbs,
            num_microbatches=args.microbatches,
            max_steps=100000,
            overrides=overrides,
        )
        self.model = self.engine.model
        self.controller = self.engine.controller
        self.m = args.microbatches
        self.model_cfg = self.engine.cfg.model

    def step(self, degraded_flags: list, step: int = 0) -> float:
        """One optimizer step running these micro-batch modes (False: exact, True: degraded with
        the configured techniques, a DegradedTechniques: degraded with it); returns seconds."""
        from megatron_mecefo.plan.step_plan import MicroBatchTask

        def task(i: int, flag) -> MicroBatchTask:
            # micro-batches beyond M are another replica's, as in a takeover
            techniques = None if isinstance(flag, bool) else flag
            return MicroBatchTask(i // self.m, i % self.m, bool(flag), techniques)

        tasks = [task(i, flag) for i, flag in enumerate(degraded_flags)]
        replicas = -(-len(tasks) // self.m)
        return timed_train_step(
            self.engine, tasks, step, num_replicas=replicas, microbatches_per_replica=self.m
        )

    def peak_activation_bytes(self, degraded) -> int:
        """CPU: bytes autograd saves for one micro-batch; GPU: peak allocation above weights."""
        import torch

        from megatron_mecefo.mecefo.memory import saved_bytes_per_layer

        batch = self.engine.train_sampler.get(0, 0, 0)
        dev = self.engine.ctx.device
        args = (batch["tokens"].to(dev), batch["position_ids"].to(dev))
        techniques = None if isinstance(degraded, bool) else degraded
        self.controller.set_degraded(bool(degraded), techniques)
        try:
            if torch.cuda.is_available():
                sync()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                out = self.model(*args, None, labels=batch["labels"].to(dev))
                sync()
                peak = torch.cuda.max_memory_allocated() - base
                del out
                return int(peak)
            layers = list(self.model.decoder.layers)
            with saved_bytes_per_layer(layers) as saved:
                self.model(*args, None, labels=batch["labels"].to(dev))
            return sum(saved.values())
        finally:
            self.controller.set_degraded(False)


def timed_round_robin(rank: EngineRank, scenarios: dict, reps: int) -> dict:
    """Fastest of `reps` steps of `rank` per scenario (label -> micro-batch flags), interleaved
    round by round after a warm-up step of each (and the V refresh of bucket 0)."""
    return fastest_of_rounds(lambda flags, step: rank.step(flags, step=step), scenarios, reps)


def timed(rank: EngineRank, flags: list[bool], reps: int) -> float:
    """Fastest of `reps` steps after a warm-up step: on a shared CPU, interference only ever
    adds time."""
    return timed_round_robin(rank, {"": flags}, reps)[""]


def bench_model(name: str, args, ctx) -> dict:
    from megatron_mecefo.plan import make_step_plans
    from megatron_mecefo.plan.takeover import plan_step_times

    m, reps = args.microbatches, args.reps
    rank = EngineRank(name, args, ctx)
    model_cfg = rank.model_cfg
    cost, calibration = load_or_calibrate(name, args, ctx)
    print(
        f"{name}: {model_cfg.num_layers} layers, d={model_cfg.hidden_size}, "
        f"f={model_cfg.ffn_hidden_size}, s={model_cfg.seq_length}, mbs={args.mbs}, M={m}"
    )
    # scenario label -> (flags, n, predicted seconds)
    scenarios = {
        "normal": ([False] * m, None, cost.step_time(m, 0)),
        "ndb_naive": ([False] * (2 * m), None, cost.step_time(2 * m, 0)),
        "mecefo_neighbor": ([True] * (2 * m), None, cost.step_time(0, 2 * m)),
    }
    for n in args.replicas:
        alive = list(range(1, n))  # replica 0 dead
        for policy in ("spread", "hybrid", "hybrid_auto"):
            plans = make_step_plans(
                alive=alive,
                num_replicas=n,
                num_microbatches=m,
                policy=policy.removesuffix("_auto"),
                cost=cost,
                target_ratio=args.target_ratio,
                choose_techniques=policy == "hybrid_auto",
                allowed_techniques=rank.engine.cfg.mecefo.techniques,
            )
            times = plan_step_times(plans, cost)
            slowest = max(times, key=times.get)
            flags = [t.techniques or t.degraded for t in plans[slowest].tasks]
            scenarios[f"{policy} n={n}"] = (flags, n, times[slowest])
    step_s = timed_round_robin(rank, {k: v[0] for k, v in scenarios.items()}, reps)
    rows = []
    for label, (flags, n, predicted) in scenarios.items():
        mem = max(rank.peak_activation_bytes(f) for f in set(flags))
        used = sorted({f.key for f in flags if not isinstance(f, bool)})
        rows.append(
            {
                "scenario": label.split()[0],
                "n": n,
                "microbatches": len(flags),
                "degraded": sum(map(bool, flags)),
                "techniques": used or None,
                "step_s": step_s[label],
                "predicted_s": predicted,
                "peak_activation_bytes": mem,
            }
        )
    normal = rows[0]["step_s"]
    for row in rows:
        row["ratio"] = row["step_s"] / normal
        row["predicted_ratio"] = row["predicted_s"] / cost.step_time(m, 0)
        row["prediction_error"] = row["predicted_s"] / row["step_s"] - 1.0  # out of sample
        row["memory_ratio"] = row["peak_activation_bytes"] / rows[0]["peak_activation_bytes"]
    # exact-mode overhead of the hooks: hooked vs un-hooked model, same task list
    plain = EngineRank(name, args, ctx, hooked=False)
    t_plain = t_hooked = float("inf")
    for _ in range(reps):  # interleaved A/B so drifting load hits both alike
        t_plain = min(t_plain, timed(plain, [False] * m, 1))
        t_hooked = min(t_hooked, timed(rank, [False] * m, 1))
    del plain
    svd_s = refresh_time(rank, rank.engine.cfg.mecefo.tau)
    return {
        **_result_head(name, model_cfg, args, ctx),
        "cost_model": {**vars(cost), "technique_microbatch_s": dict(cost.technique_microbatch_s)},
        "calibration": calibration,
        "rows": rows,
        "prediction_error_abs_mean": sum(abs(r["prediction_error"]) for r in rows) / len(rows),
        "exact_mode_overhead": t_hooked / t_plain - 1.0,
        "svd_refresh_s": svd_s,
    }


def skip_layer_overrides(setting: str) -> list[str]:
    """Config overrides of one `--skip-layers` setting (`off`: the skip switched off)."""
    if setting == "off":
        return ["mecefo.skip_attention_backward=false"]
    return [f"mecefo.skip_attention_layers={setting}"]


def bench_skip_layers(name: str, args, ctx) -> dict:
    """Step time of M degraded micro-batches (the configured techniques) per skip-layer setting,
    against M exact ones on the same engine; every setting has its own engine (same weights) and
    the settings are interleaved round by round, fastest of `--reps` kept. `ratio` is over the
    fastest exact step of all engines, `ratio_own_exact` over the setting's own."""
    m = args.microbatches
    ranks = {
        s: EngineRank(name, args, ctx, overrides=skip_layer_overrides(s)) for s in args.skip_layers
    }
    scenarios = {"exact": [False] * m, "degraded": [True] * m}
    best = fastest_of_rounds(  # every engine's every scenario, interleaved
        lambda rank_flags, step: rank_flags[0].step(rank_flags[1], step=step),
        {
            (s, label): (rank, flags)
            for s, rank in ranks.items()
            for label, flags in scenarios.items()
        },
        args.reps,
    )
    model_cfg = next(iter(ranks.values())).model_cfg
    # exact mode is the same computation whatever the setting: the fastest exact step of all
    # engines is the common baseline (less noise than each engine's own)
    exact_best = min(best[s, "exact"] for s in ranks)
    rows = []
    for setting, rank in ranks.items():
        skipped = sorted(rank.controller.skip_layer_indices)
        exact_s, degraded_s = best[setting, "exact"], best[setting, "degraded"]
        rows.append(
            {
                "setting": setting,
                "skipped_layers": skipped,
                "skip_fraction": len(skipped) / model_cfg.num_layers,
                "techniques": rank.engine.cfg.mecefo.techniques.key,
                "exact_step_s": exact_s,
                "degraded_step_s": degraded_s,
                "ratio": degraded_s / exact_best,
                "ratio_own_exact": degraded_s / exact_s,
                "peak_activation_bytes": rank.peak_activation_bytes(True),
                "exact_activation_bytes": rank.peak_activation_bytes(False),
            }
        )
    return {**_result_head(name, model_cfg, args, ctx), "reps": args.reps, "rows": rows}


def _result_head(name: str, model_cfg, args, ctx) -> dict:
    """The fields a model's result starts with, in both benches."""
    return {
        "model": name,
        "config": vars(model_cfg),
        "device": str(ctx.device),
        "mbs": args.mbs,
        "microbatches": args.microbatches,
    }


def print_skip_layers_table(result: dict) -> None:
    print(
        f"\n{result['model']} ({result['device']}), {result['config']['num_layers']} layers, "
        f"M={result['microbatches']}: M degraded micro-batches vs M exact (ratio: over the "
        "fastest exact step of all settings), per skip-layer setting"
    )
    print(
        f"{'setting':<12}{'skipped':>12}{'exact ms':>10}{'degr ms':>10}{'ratio':>8}"
        f"{'act ratio':>10}  techniques"
    )
    for r in result["rows"]:
        skipped = ",".join(map(str, r["skipped_layers"])) or "-"
        print(
            f"{r['setting']:<12}{skipped:>12}{r['exact_step_s'] * 1e3:>10.1f}"
            f"{r['degraded_step_s'] * 1e3:>10.1f}{r['ratio']:>8.3f}"
            f"{r['peak_activation_bytes'] / r['exact_activation_bytes']:>10.2f}  {r['techniques']}"
        )


def load_or_calibrate(name: str, args, ctx):
    """The planner's cost model, never fitted on the steps it predicts.

    With `--calibration FILE` (a degraded.json of an earlier run) it is read from there. Otherwise
    it is calibrated here on a separate engine, on held-out task lists that are not among the
    table's scenarios: M/2 and 3M/2 exact micro-batches (exact marginal cost: the chord), and M/2
    exact + M degraded (degraded marginal cost). Every table row is then a prediction out of
    sample. Each technique set of `--techniques` (and the configured one) gets its own degraded
    marginal cost from M/2 exact + M degraded with that set: the candidates of `hybrid_auto`.
    Returns (CostModel, JSON-able record incl. whether the fallback model was used).
    """
    from megatron_mecefo.plan import CostModel, DegradedTechniques

    if args.calibration:
        data = json.loads(Path(args.calibration).read_text())
        entry = next((r for r in data["models"] if r["model"] == name), None)
        if entry is None:
            raise SystemExit(f"error: {args.calibration} has no cost model for {name}")
        cost = CostModel.from_measured(**entry["cost_model"])
        return cost, {"source": str(args.calibration), "fallback": False}
    m = args.microbatches
    lo, hi = max(1, m // 2), m + max(1, m // 2)
    calib_rank = EngineRank(name, args, ctx)
    configured = calib_rank.engine.cfg.mecefo.techniques
    sets = [DegradedTechniques.from_key(k) for k in args.techniques]
    skipped = [t.key for t in sets if not t.issubset(configured)]
    if skipped:
        print(f"  not calibrated (switched off in mecefo config {configured.key}): {skipped}")
    sets = [configured] + [
        t for t in dict.fromkeys(sets) if t != configured and t.issubset(configured)
    ]
    lists = {"lo": [False] * lo, "hi": [False] * hi}
    lists |= {f"lo_degraded {t.key}": [False] * lo + [t] * m for t in sets}
    calib = timed_round_robin(calib_rank, lists, args.reps)
    calib["lo_degraded"] = calib[f"lo_degraded {configured.key}"]
    del calib_rank
    exact_mb = max(1e-9, (calib["hi"] - calib["lo"]) / (hi - lo))
    degraded_mb = max(1e-9, (calib["lo_degraded"] - calib["lo"]) / m)
    intercept = calib["lo"] - lo * exact_mb
    fallback = intercept + exact_mb <= 0  # noise made the chord absurdly steep
    if fallback:
        print(
            f"  warning: noisy calibration (intercept {intercept * 1e3:.1f} ms); using the "
            "proportional fallback model T = k x per-micro-batch time instead; raise --reps"
        )
        exact_mb, intercept = calib["lo"] / lo, 0.0
        degraded_mb = min(degraded_mb, exact_mb)
    per_set = {t.key: max(1e-9, (calib[f"lo_degraded {t.key}"] - calib["lo"]) / m) for t in sets}
    if fallback:
        per_set = {k: min(v, exact_mb) for k, v in per_set.items()}
    cost = CostModel.from_measured(
        exact_microbatch_s=exact_mb,
        degraded_microbatch_s=degraded_mb,
        step_overhead_s=intercept,
        technique_microbatch_s=per_set,
    )
    record = {
        "source": "held-out task lists on a separate engine",
        "task_lists": {"lo": lo, "hi": hi, "lo_degraded <techniques>": [lo, m]},
        "step_s": calib,
        "fallback": fallback,
    }
    return cost, record


def refresh_time(rank: EngineRank, tau: int) -> float:
    """Seconds to recompute V of every layer (paid by the first degraded step of each tau window):
    a degraded step that crosses into a new window minus the same step inside it."""
    rank.controller.clear_caches()
    with_svd = rank.step([True], step=tau)
    without = min(rank.step([True], step=tau + 1) for _ in range(2))
    return max(0.0, with_svd - without)


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


def grad_error(name: str, args, device, steps: int) -> list[dict]:
    """Relative error of the degraded gradient vs exact, at init and after `steps` exact steps."""
    import torch

    from megatron_mecefo.mecefo import MecefoConfig, install_degraded_mode

    model_cfg = load_model_cfg(name, args.num_layers)
    rank = BareModel(model_cfg, args, device, hooked=False)
    gen = torch.Generator().manual_seed(1)
    s = model_cfg.seq_length
    results = []

    def grads():
        rank.optimizer.zero_grad(set_to_none=True)
        rank.micro_batch(True)
        return {n: p.grad.clone() for n, p in rank.model.named_parameters() if p.grad is not None}

    def rel(got, ref, names):
        diff = torch.cat([(got[n] - ref[n]).flatten() for n in names]).norm()
        return float(diff / torch.cat([ref[n].flatten() for n in names]).norm())

    for trained in (0, steps):
        for _ in range(trained):  # exact AdamW steps on fresh random batches
            tokens = torch.randint(0, model_cfg.vocab_size, (args.mbs, s), generator=gen).to(device)
            rank.batch = (tokens, rank.batch[1], tokens.roll(-1, 1))
            rank.step([False])
        ref = grads()  # the un-hooked controller runs everything exact
        ffn = [n for n in ref if ".mlp.linear_fc" in n]
        for frac in (1 / 16, 1 / 8, 1 / 4, 1 / 2):
            plain = rank.controller
            rank.controller = install_degraded_mode(rank.model, MecefoConfig(rank=frac))
            got = grads()
            rank.controller.uninstall()
            rank.controller = plain
            row = {
                "after_steps": trained,
                "rank_fraction": frac,
                "ffn_weight_grad_rel_error": rel(got, ref, ffn),
                "computed_grads_rel_error": rel(got, ref, list(got)),
            }
            results.append(row)
            print(
                f"  grad error {name} after {trained} steps, r=n/{round(1 / frac)}: FFN weights "
                f"{row['ffn_weight_grad_rel_error']:.3f}, all computed grads "
                f"{row['computed_grads_rel_error']:.3f}",
                flush=True,
            )
    return results


def print_table(result: dict) -> None:
    print(
        f"\n{result['model']} ({result['device']}), M={result['microbatches']}; cost model "
        f"exact {result['cost_model']['exact_microbatch_s'] * 1e3:.1f} ms, degraded "
        f"{result['cost_model']['degraded_microbatch_s'] * 1e3:.1f} ms, overhead "
        f"{result['cost_model']['step_overhead_s'] * 1e3:.1f} ms"
    )
    print(
        f"{'scenario':<18}{'n':>4}{'mb':>5}{'degr':>6}{'step ms':>10}{'ratio':>8}"
        f"{'pred (err)':>14}{'act MiB':>10}{'act ratio':>10}  techniques"
    )
    for r in result["rows"]:
        pred = f"{r['predicted_ratio']:.2f} ({r['prediction_error']:+.0%})"
        print(
            f"{r['scenario']:<18}{r['n'] or '-':>4}{r['microbatches']:>5}{r['degraded']:>6}"
            f"{r['step_s'] * 1e3:>10.1f}{r['ratio']:>8.2f}{pred:>14}"
            f"{r['peak_activation_bytes'] / 2**20:>10.2f}{r['memory_ratio']:>10.2f}"
            f"  {','.join(r['techniques'] or []) or '-'}"
        )
    print(
        f"planner's prediction (cost model: {result['calibration']['source']}, fallback "
        f"{result['calibration']['fallback']}): mean |error| "
        f"{result['prediction_error_abs_mean']:.1%} out of sample"
    )
    print(
        f"exact-mode hook overhead: {result['exact_mode_overhead'] * 100:+.1f}% ; "
        f"V refresh of all layers: {result['svd_refresh_s'] * 1e3:.1f} ms every tau steps"
    )


def main() -> int:
    args = parse_args()
    ctx = init_torch(args.threads)
    device = ctx.device
    models = (
        args.models
        if args.models is not None
        else (["tiny", "small"] if ctx.on_cpu else ["llama-350m"])
    )
    if args.skip_layers:
        report = {"skip_layers": []}
        for name in models:
            result = bench_skip_layers(name, args, ctx)
            print_skip_layers_table(result)
            report["skip_layers"].append(result)
        return write_json(report, args.out)
    report = {"models": [], "svd": [], "grad_error": []}
    for name in models:
        result = bench_model(name, args, ctx)
        print_table(result)
        report["models"].append(result)
        if args.grad_error_steps:
            report["grad_error"] += grad_error(name, args, device, args.grad_error_steps)
    for name in args.svd_shapes:
        report["svd"] += bench_svd(name, device)
    return write_json(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
