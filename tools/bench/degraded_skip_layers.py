"""The skip-layer sweep: for each `mecefo.skip_attention_layers` setting, a step of M exact and a
step of M degraded micro-batches on an engine built with it, settings interleaved round by round
(the time axis of an accuracy/time curve).

Imported by `degraded.py`, which puts `tools/bench` and the repository on `sys.path`."""

from __future__ import annotations

from bench_common import fastest_of_rounds
from degraded_rank import EngineRank, result_head


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
    return {**result_head(name, model_cfg, args, ctx), "reps": args.reps, "rows": rows}


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
