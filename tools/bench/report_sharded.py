"""The distributed optimizer's section of BENCHMARKS.md (`report.py` renders it from
`tools/bench/sharded_optimizer.py`'s JSON)."""

from __future__ import annotations

import math
import re
from typing import Any

from report_context import tool_section
from report_markdown import _f, _scale, _table

# ---------------------------------------------------------------------------- distributed optimizer
SHARDED_CONFIGS = {
    "sharded+snapshot": "sharded + snapshot every step",
    "replicated+snapshot": "replicated + snapshot every step",
}
"""sharded_optimizer.py's step-time configurations as the table names them (others as they are)."""
_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def _word(n) -> str:
    """A count in words up to ten ('?' when absent)."""
    if n is None:
        return "?"
    return _WORDS[n] if isinstance(n, int) and 0 <= n < len(_WORDS) else str(n)


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@tool_section("sharded_optimizer")
def section_sharded_optimizer(ctx: Any, doc: dict) -> list[str]:
    """`tools/bench/sharded_optimizer.py`: state memory, step time and shard moves under
    failover, then a reading whose every claim is decided from the JSON."""
    args, cores = doc.get("args") or {}, (doc.get("machine") or {}).get("cpus", "?")
    out = [
        "`training.use_distributed_optimizer=true` (our `optim/sharded.py`, "
        "`docs/sharded_optimizer.md`) against megatron's replicated optimizer, on the "
        f"{cores}-core CPU, fp32, gloo.",
        "",
    ]
    parts = (
        ("memory", "Optimizer state per rank", _sharded_memory),
        ("step_time", "Step time", _sharded_step_time),
        ("failover", "Shard moves under failover", _sharded_failover),
    )
    for key, title, render in parts:
        if doc.get(key) is None:
            skip = "--skip-" + key.replace("_", "-")
            out += [f"**{title}**: not measured in this run (`{skip}`).", ""]
        else:
            out += render(doc[key], args, cores)
    reading = _sharded_reading(doc)
    out += [f"**Reading.** {reading}", ""] if reading else []
    return out


def _sharded_memory(rows: list[dict], args: dict, cores) -> list[str]:
    def state(r: dict, kind: str) -> str:
        mb = _f(_scale(r.get(f"{kind}_bytes"), 1e-6), ".3f", " MB")
        return f"{mb} ({_f(r.get(f'{kind}_bytes_per_param'))})"

    out = [
        "**Optimizer state per rank** (the largest rank after one step; one spawned gloo job per "
        'DP size builds both optimizers; "x2 copies" is a second sharded optimizer with '
        "`copies=2`, what failover keeps with `failover.shard_copies=2`). Bytes per parameter in "
        "brackets.",
        "",
    ]
    return out + _table(
        ["model", "params", "DP", "replicated", "sharded", "sharded, x2 copies",
         "sharded / replicated"],
        [
            [r.get("model"), _f(r.get("params"), ",d"), r.get("dp"), state(r, "replicated"),
             state(r, "sharded"), state(r, "sharded_x2"),
             _f(r.get("sharded_over_replicated"), ".2f")]
            for r in rows
        ],
    )  # fmt: skip


def _sharded_step_time(rows: list[dict], args: dict, cores) -> list[str]:
    dp, steps = args.get("step_dp", "?"), args.get("steps")
    repeats = args.get("repeats")
    out = [
        f"**Step time**, static DP {dp} (torchrun, {dp} ranks on the {cores} cores), micro-batch "
        f"{args.get('micro_batch_size', '?')} x {args.get('num_microbatches', '?')} per replica, "
        f"median of steps {args.get('warmup', '?')}-{steps - 1 if _num(steps) else '?'}, median "
        f"of {repeats} interleaved round{'' if repeats == 1 else 's'} (each round's median in "
        "brackets). The snapshot columns are rank 0's last snapshot: its size (parameters + held "
        "shards) and its background copy time.",
        "",
    ]
    table = []
    for r in rows:
        snap, rounds = r.get("snapshot") or {}, r.get("step_s_by_round") or []
        step = _f(_scale(r.get("step_s"), 1e3), ".1f", " ms")
        if len(rounds) > 1:
            step += " (" + ", ".join(_f(_scale(x, 1e3), ".0f") for x in rounds) + ")"
        if r.get("error"):
            step += f", a run failed ({str(r['error']).split(':', 1)[0]})"
        table.append(
            [
                r.get("model"),
                SHARDED_CONFIGS.get(r.get("config"), r.get("config")),
                step,
                _f(r.get("vs_replicated"), ".3f"),
                _f(r.get("vs_sharded"), ".3f"),
                _f(_scale(snap.get("bytes"), 1e-6), ".2f", " MB"),
                _f(snap.get("mean_copy_ms"), ".1f", " ms"),
            ]
        )
    return out + _table(
        ["model", "optimizer", "step", "vs replicated", "vs sharded", "snapshot per rank",
         "snapshot copy"],
        table,
    )  # fmt: skip


def _sharded_failover(rows: list[dict], args: dict, cores) -> list[str]:
    standby = args.get("standby")
    spares = "no standby node" if standby == 0 else f"{standby} standby node"
    spares += "" if standby in (0, 1) else "s"
    out = [
        "**Shard moves under failover** (tiny, 4 ranks, `failover.shard_copies=2`, "
        "`mecefo.takeover_policy=spread`, `failover.audit=true`, "
        f"{args.get('failover_steps', '?')} steps). Kill: `--inject kill:2:5:3`. Node loss: 2 "
        f"nodes x 2 ranks and {spares} (`launch/local/run.sh`), node 1's agent and its children "
        f"SIGKILLed together after {args.get('kill_at', '?')} steps. MB moved and shard exchange "
        "come from the `shard_adopt` event; failure -> regroup is the `latency_ms` of the regroup "
        "of the same generation (failure to new group, with state and shards in place); rejoin is "
        "the `rejoin` event of that generation.",
        "",
    ]
    table = []
    for r in rows:
        failed = "" if r.get("ok") else f" (failed, exit {r.get('exit_code')})"
        lead = [f"{r.get('scenario')}{failed}", _f(r.get("detection_ms"), ".0f", " ms")]
        for i, m in enumerate(r.get("moves") or [{}]):
            table.append(
                [
                    *(lead if i == 0 else ["", ""]),
                    _regroup_label(r, m),
                    _f(m.get("step"), "d"),
                    _f(_scale(m.get("bytes"), 1e-6), ".3f"),
                    _f(m.get("transfer_ms"), ".0f", " ms"),
                    _f(m.get("regroup_ms"), ".0f", " ms"),
                    _rejoin_cell(r, m),
                ]
            )
    out += _table(
        ["scenario", "detection", "regroup", "step", "MB moved", "shard exchange",
         "failure -> regroup", "rejoin"],
        table,
    )  # fmt: skip
    return out + [" ".join(_failover_outcome(rows, args.get("failover_steps"))), ""]


def _regroup_label(run: dict, move: dict) -> str:
    """'gen 2: rank 2 removed', 'gen 3: standby takes ranks 2, 3' from the regroup's detail."""
    gen, detail = move.get("generation"), move.get("regroup_detail") or ""
    if gen is None:
        return "-"
    lists = dict(re.findall(r"(removed|added) \[([\d, ]*)\]", detail))
    ranks = {k: [x.strip() for x in v.split(",") if x.strip()] for k, v in lists.items()}
    parts = []
    for key, ids in ranks.items():
        if not ids:
            continue
        who = f"rank{'s' if len(ids) > 1 else ''} {', '.join(ids)}"
        if key == "removed":
            parts.append(f"{who} removed")
        elif "node_replaced" in (run.get("event_types") or []):
            parts.append(f"standby takes {who}")
        else:
            parts.append(f"{who} rejoin{'' if len(ids) > 1 else 's'}")
    return f"gen {gen}: {'; '.join(parts) or detail or '?'}"


def _rejoin_cell(run: dict, move: dict) -> str:
    """'650 ms (0.69 MB of state)', or '2 x 0.69 MB' when several ranks rejoined alike."""
    if move.get("rejoin_ms") is None:
        return "-"
    gen = move.get("generation")
    sizes = [
        e["bytes"]
        for e in run.get("events") or []
        if e.get("type") == "rejoin" and e.get("generation") == gen and _num(e.get("bytes"))
    ]
    if len(sizes) > 1 and len(set(sizes)) == 1:
        state = f"{len(sizes)} x {_f(sizes[0] * 1e-6, '.2f', ' MB')}"
    else:
        state = _f(_scale(move.get("rejoin_state_bytes"), 1e-6), ".2f", " MB")
    return f"{_f(move['rejoin_ms'], '.0f', ' ms')} ({state} of state)"


def _failover_outcome(rows: list[dict], steps) -> list[str]:
    """How the runs ended, and what the shard audit says of them."""
    out = []
    ends = {(r.get("ok"), r.get("steps_logged"), r.get("final_replicas"), r.get("steps_redone"))
            for r in rows}  # fmt: skip
    if len(ends) == 1 and rows[0].get("ok"):
        _, logged, replicas, redone = ends.pop()
        who = {1: "The run", 2: "Both runs"}.get(len(rows), f"All {len(rows)} runs")
        done = f"finished all {steps} steps" if logged == steps else f"logged {logged} of {steps}"
        each = " each" if len(rows) > 1 else ""
        redo = f"{_word(redone)} step{'' if redone == 1 else 's'} redone{each}"
        out.append(f"{who} {done} at {replicas} replicas, with {redo}.")
    else:
        out += [
            f"{r.get('scenario')}: exit {r.get('exit_code')}, {r.get('steps_logged')} of {steps} "
            f"steps logged, {r.get('final_replicas')} replicas at the end, "
            f"{r.get('steps_redone')} step(s) redone."
            for r in rows
        ]
    audits = [r.get("audit") or {} for r in rows]
    checks = ("always_held", "holders_agree", "own_held_at_end")
    if audits and all(a.get("audited_steps") and all(a.get(k) for k in checks) for a in audits):
        every = all(a["audited_steps"] == r.get("steps_logged") for a, r in zip(audits, rows))
        out.append(
            "The shard audit (`audit/shards_rank*.jsonl`) says that after every "
            f"{'' if every else 'audited '}step every shard had a holder, at most "
            f"{max(a.get('max_holders') or 0 for a in audits)}, and its holders agreed bit for "
            "bit. After the last step each replica held its own shard again."
        )
        return out
    problems = {
        "always_held": "a shard had no holder after some step",
        "holders_agree": "the holders of a shard disagreed",
        "own_held_at_end": "after the last step a replica did not hold its own shard",
    }
    for r, a in zip(rows, audits):
        found = [why for k, why in problems.items() if not a.get(k)]
        found = found if a.get("audited_steps") else ["no audit rows"]
        out.append(f"Shard audit of {r.get('scenario')}: {'; '.join(found) or 'clean'}.")
    return out


def _sharded_reading(doc: dict) -> str:
    """The reading of the section: each sentence holds only where the JSON says so."""
    mem = doc.get("memory") or []
    out = _reading_memory(mem)
    if mem or doc.get("step_time"):
        out.append(
            "Each step, the sharded path all-reduces the gradients and then all-gathers the "
            "parameters. That is 1.5x the traffic of megatron's reduce-scatter + all-gather, and "
            "1.5x the replicated optimizer's all-reduce. In exchange, each rank runs AdamW on "
            "1/DP of the elements."
        )
    out += _reading_step_time(doc, mem)
    out += _reading_failover(doc.get("failover") or [], mem)
    return " ".join(s for s in out if s)


def _reading_memory(mem: list[dict]) -> list[str]:
    if not mem:
        return []

    def near(v, want) -> bool:
        return _num(v) and abs(v - want) <= 1e-3 * want

    if not all(
        isinstance(r.get("dp"), int)
        and r["dp"] > 0
        and r.get("replicated_master_bytes") == 0
        and near(r.get("replicated_bytes_per_param"), 8)
        and near(r.get("sharded_bytes_per_param"), 12 / r["dp"])
        for r in mem
    ):
        return [
            "Memory does not follow the fp32 arithmetic (8 bytes/param replicated, 12/DP sharded) "
            "in every row: read the table."
        ]
    top = max(mem, key=lambda r: r["dp"])
    out = [
        "Memory follows the arithmetic. On CPU in fp32, megatron's replicated optimizer holds "
        "only `exp_avg` + `exp_avg_sq` (8 bytes/param), because the fp32 parameter is its own "
        "master. Ours always keeps a separate fp32 master (12/DP bytes/param). So it costs 1.5x "
        f"at DP 1, breaks even at DP 1.5, and holds {top.get('sharded_over_replicated'):.3g}x at "
        f"DP {top['dp']}. Against megatron in bf16 on a GPU (12 bytes/param replicated) the ratio "
        "would be 1/DP; that case was not measured here."
    ]
    x2, rep = top.get("sharded_x2_bytes_per_param"), top.get("replicated_bytes")
    if top.get("copies_x2") == 2 and _num(x2) and _num(rep) and rep > 0:
        ratio = top["sharded_x2_bytes"] / rep
        out.append(
            f"Failover's two copies double the sharded state ({x2 * top['dp']:.3g}/DP: "
            f"{x2:.3g} bytes/param at DP {top['dp']}, {'still ' if ratio < 1 else ''}"
            f"{ratio:.3g}x of replicated fp32)."
        )
    return out


def _pct_change(ratios: list[float]) -> str:
    """'4-11% faster' for step ratios 0.96 and 0.89 (slower above 1)."""
    if all(x <= 1 for x in ratios) or all(x >= 1 for x in ratios):
        pcts = sorted(abs(1 - x) * 100 for x in ratios)
        span = f"{pcts[0]:.0f}" if f"{pcts[0]:.0f}" == f"{pcts[-1]:.0f}" else f"{pcts[0]:.0f}-"
        span += "" if span.isdigit() else f"{pcts[-1]:.0f}"
        return f"{span}% {'faster' if ratios[0] <= 1 else 'slower'}"
    return "between " + " and ".join(f"{x:.3f}x" for x in (min(ratios), max(ratios)))


def _reading_step_time(doc: dict, mem: list[dict]) -> list[str]:
    rows = [r for r in doc.get("step_time") or [] if _num(r.get("step_s"))]
    if not rows:
        return []
    args, cores = doc.get("args") or {}, (doc.get("machine") or {}).get("cpus")
    dp = args.get("step_dp")
    spreads = []
    for r in rows:
        rounds = [x for x in r.get("step_s_by_round") or [] if _num(x) and x > 0]
        if len(rounds) > 1:
            spreads.append((max(rounds) / min(rounds) - 1, r, rounds))
    diffs = [abs(r["vs_replicated"] - 1) for r in rows if _num(r.get("vs_replicated"))]
    sharded = [r["vs_replicated"] for r in rows if r.get("config") == "sharded"]
    sharded = [x for x in sharded if _num(x)]
    shared = ""
    if isinstance(dp, int) and isinstance(cores, int) and dp > cores:
        shared = f"{_word(dp).capitalize()} ranks time-share {cores} cores."
    load = _load_sentence(doc, rows, cores)
    gpu = "the GPU/NCCL cost of the extra all-gather was not measured."
    noise = max(spreads, key=lambda t: t[0]) if spreads else None
    noisy = noise is not None and noise[0] > max(diffs, default=0.0)
    if noise is None:
        out = [
            "The step-time table has one round per configuration, so it cannot tell its "
            "differences from noise.",
            shared,
            load,
            gpu[0].upper() + gpu[1:],
        ]
    elif noisy:
        spread, r, rounds = noise
        no_cost = sharded and all(x <= 1 for x in sharded)
        out = [
            "The step-time table shows no cost from this on this machine, but it cannot resolve "
            "one."
            if no_cost
            else "The step-time table cannot resolve this cost on this machine.",
            shared,
            load,
            f"The {_word(len(rounds))} rounds of one configuration differ by up to {spread:.0%} "
            f"({r.get('model')} {r.get('config')}: {min(rounds) * 1e3:.0f} vs "
            f"{max(rounds) * 1e3:.0f} ms), more than any difference between configurations.",
            f'So "sharded is {_pct_change(sharded)}" is noise, not a result; {gpu}'
            if sharded
            else gpu[0].upper() + gpu[1:],
        ]
    else:
        out = [
            f"Sharded over replicated step: {', '.join(f'{x:.3f}' for x in sharded) or '-'}, "
            f"beyond the {noise[0]:.0%} between rounds of one configuration.",
            shared,
            load,
            gpu[0].upper() + gpu[1:],
        ]
    return out + _reading_snapshot(rows, mem, args, noise[0] if noise else None, noisy)


def _load_sentence(doc: dict, rows: list[dict], cores) -> str:
    """The machine's 1-minute load: after each step-time run where recorded, else at the
    benchmark's start and end."""
    loads = [x for r in rows for x in r.get("loadavg_1m_by_round") or [] if _num(x)]
    ends = [x for x in doc.get("loadavg_1m") or [] if _num(x)]
    if loads:
        text = (
            f"The 1-minute load average was {min(loads):.0f}-{max(loads):.0f} after the "
            "step-time runs"
        )
    elif len(ends) == 2:
        text = (
            f"The 1-minute load average was {ends[0]:.1f} at the start of the benchmark and "
            f"{ends[1]:.1f} at its end"
        )
    else:
        return ""
    if isinstance(cores, int) and max(loads or ends) > cores:
        text += f", above the {cores} cores: other work shared the machine"
    return text + "."


def _reading_snapshot(rows, mem, args: dict, noise, noisy: bool) -> list[str]:
    snaps = [
        r
        for r in rows
        if r.get("config") == "sharded+snapshot" and _num((r.get("snapshot") or {}).get("bytes"))
    ]
    if not snaps:
        return []
    r = max(snaps, key=lambda r: r["snapshot"]["bytes"])
    snap, model = r["snapshot"], r.get("model")
    m = next((x for x in mem if x.get("model") == model and x.get("dp") == r.get("dp")), {})
    params_b = 4 * m["params"] if _num(m.get("params")) else None  # fp32
    held = m.get("sharded_bytes")
    if params_b and _num(held) and abs(snap["bytes"] - params_b - held) < 0.05 * snap["bytes"]:
        first = (
            "The every-step snapshot copies only the parameters and the held shards "
            f"({model}: {snap['bytes'] / 1e6:.1f} MB per rank; the replicated state alone would "
            f"be {_f(_scale(m.get('replicated_bytes'), 1e-6), '.1f')} MB on top of the "
            f"{params_b / 1e6:.1f} MB of parameters)."
        )
    else:
        first = f"The every-step snapshot holds {snap['bytes'] / 1e6:.1f} MB per rank ({model})."
    out = [first]
    copy, blocked = snap.get("mean_copy_ms"), snap.get("blocked_s")
    if _num(copy) and _num(blocked):
        out.append(
            "It copies in the background while the next step computes: "
            f"{copy:.0f} ms per copy, and {blocked * 1e3:.0f} ms of waiting in total over "
            f"{args.get('steps', '?')} steps."
        )
    vs = r.get("vs_sharded")
    if _num(vs) and noise is not None:
        out.append(
            f"Its step-time cost is below the noise here{' too' if noisy else ''}."
            if abs(vs - 1) < noise
            else f"It changed the sharded step by {vs - 1:+.0%}."
        )
    return out


def _reading_failover(runs: list[dict], mem: list[dict]) -> list[str]:
    moves = [(r, m) for r in runs for m in r.get("moves") or []]
    xfer = [m["transfer_ms"] for _, m in moves if _num(m.get("transfer_ms"))]
    if not xfer:
        return []
    shares = [
        m["transfer_ms"] / m["regroup_ms"]
        for _, m in moves
        if _num(m.get("transfer_ms")) and _num(m.get("regroup_ms")) and m["regroup_ms"] > 0
    ]
    sizes = "; ".join(
        f"{r.get('scenario')}: {_f(_scale(max(b), 1e-6), '.2f', ' MB')}"
        for r in runs
        if (b := [m["bytes"] for m in r.get("moves") or [] if _num(m.get("bytes"))])
    )
    back = all(len({m.get("bytes") for m in r.get("moves") or []}) == 1 for r in runs)
    span = f"{min(xfer):.0f}-{max(xfer):.0f}" if f"{min(xfer):.0f}" != f"{max(xfer):.0f}" else ""
    move = (
        f"moving the lost replicas' shards ({sizes}"
        f"{'; the same bytes back again at the rejoin' if back and len(moves) > len(runs) else ''}"
        f") takes {span or f'{max(xfer):.0f}'} ms."
    )
    cheap = shares and max(shares) < 0.1
    out = [
        f"Shard adoption is cheap next to failure handling: {move}"
        if cheap
        else move[0].upper() + move[1:]
    ]
    firsts = [(r, m) for r in runs for m in (r.get("moves") or [])[:1] if _num(m.get("regroup_ms"))]
    dets = [(r.get("scenario"), r["detection_ms"], m["regroup_ms"]) for r, m in firsts
            if _num(r.get("detection_ms"))]  # fmt: skip
    if shares:
        said = f"That is at most {max(shares):.0%} of failure -> regroup"
        if dets and all(d > g / 2 for _, d, g in dets):
            said += ", which detection dominates: " + ", ".join(
                f"{d / 1e3:.1f} s ({s})" for s, d, _ in dets
            )
        out.append(said + ".")
    rejoins = [
        e["bytes"]
        for r in runs
        for e in r.get("events") or []
        if e.get("type") == "rejoin" and _num(e.get("bytes"))
    ]
    if rejoins:
        got = max(rejoins)
        params = [4 * x["params"] for x in mem if _num(x.get("params"))]  # fp32
        out.append(
            f"A rejoining rank receives only the parameters ({got / 1e6:.2f} MB) and then its "
            "shards, not the full optimizer state."
            if any(abs(got - p) < 0.1 * p for p in params)
            else f"A rejoining rank receives {got / 1e6:.2f} MB of state, then its shards."
        )
    out.append(
        "This is tiny-model data on gloo over loopback: bytes scale as 12 x shard elements per "
        "moved shard, time has not been measured at any real size."
    )
    missing = [
        f"{r.get('scenario')}: generation(s) {', '.join(map(str, g))}"
        for r in runs
        if (g := r.get("regroups_without_shard_adopt"))
    ]
    if missing:
        out.append(f"Regroups that wrote no `shard_adopt` event: {'; '.join(missing)}.")
    elif all("regroups_without_shard_adopt" in r for r in runs):
        out.append("Every regroup of these runs wrote a `shard_adopt` event.")
    return out
