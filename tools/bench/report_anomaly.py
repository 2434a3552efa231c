"""The sections of BENCHMARKS.md on silent faults: what the checks cost a normal step
(`tools/bench/anomaly_cost.py`), how far failure-free runs come to the spike limits
(`tools/bench/spike_threshold.py`), a straggler's step time (`tools/bench/straggler.py`), and one
NaN handled by megatron-core's `RerunStateMachine` and by the rerun on a peer
(`tools/bench/rerun_peer.py`)."""

from __future__ import annotations

from typing import Any

from report_context import tool_section
from report_markdown import _f, _table


@tool_section("anomaly_cost")
def section_anomaly_cost(ctx: Any, doc: dict) -> list[str]:
    """What the NaN/Inf checks and the state fingerprint cost a normal step."""
    out = [
        "One process, the real training step with the NaN/Inf checks on and off, and the state "
        "fingerprint of the commit vote alone (fastest of interleaved rounds; "
        "`docs/anomalies.md`).",
        "",
    ]
    rows = [
        [
            r.get("model", "?"),
            _f(r.get("params_m"), ".2f", "M"),
            _f(r.get("step_on_s") and 1000 * r["step_on_s"], ".1f", " ms"),
            _f(r.get("step_off_s") and 1000 * r["step_off_s"], ".1f", " ms"),
            _f(None if r.get("check_overhead") is None else 100 * r["check_overhead"], "+.1f", "%"),
            _f(r.get("fingerprint_s") and 1000 * r["fingerprint_s"], ".2f", " ms"),
            _f(r.get("fingerprint_vs_step") and 100 * r["fingerprint_vs_step"], ".1f", "%"),
        ]
        for r in doc.get("rows") or []
    ]
    out += _table(
        ["model", "params", "step, checks on", "checks off", "checks", "fingerprint", "vs step"],
        rows,
    )
    gbs = doc.get("fingerprint_gb_per_s")
    out += ["", f"Fingerprint throughput: {_f(gbs, '.2f', ' GB/s')} on one CPU thread."]
    return out + [""]


@tool_section("spike_threshold")
def section_spike_threshold(ctx: Any, doc: dict) -> list[str]:
    """The largest value / running median of each spike statistic on failure-free runs."""
    d = doc.get("defaults") or {}
    out = [
        f"Failure-free runs, one process each; each step's mean loss and local gradient norm over "
        f"the median of the previous {doc.get('window', '?')} steps (checked after "
        f"{doc.get('warmup', '?')}). The defaults: loss {d.get('loss', '?')}x, gradient norm "
        f"{d.get('grad', '?')}x (`docs/anomalies.md`).",
        "",
    ]
    rows = []
    for r in doc.get("runs") or []:
        for name in ("loss", "grad"):
            s = r.get(name) or {}
            peak, factor = s.get("peak"), d.get(name)
            rows.append(
                [
                    r.get("run", "?"),
                    name,
                    str(s.get("checked", "?")),
                    _f(peak, ".3f"),
                    str(s.get("peak_step", "?")),
                    _f(s.get("p999"), ".3f"),
                    _f(peak and factor and factor / peak, ".1f", "x"),
                    str(len(r.get("alarms") or [])),
                ]
            )
    out += _table(["run", "stat", "steps", "largest", "at step", "p99.9", "margin", "alarms"], rows)
    return out + [""]


@tool_section("straggler")
def section_straggler(ctx: Any, doc: dict) -> list[str]:
    """Median step time before, during and after a straggler's mitigation."""
    a = doc.get("args") or {}
    out = [
        f"{a.get('nproc', '?')} ranks under `mecefo-launch`, model {a.get('model', '?')}, rank 1 "
        f"{a.get('factor', '?')}x "
        f"slower from step {a.get('slow_from', '?')}; median step time of each phase "
        f"(`docs/anomalies.md`). Floor with uneven shares: {_f(doc.get('floor'), '.2f', 'x')}.",
        "",
    ]
    rows = doc.get("rows") or {}
    base = (rows.get("failure-free") or {}).get("before")
    table = [
        [
            name,
            _f(r.get("before") and 1000 * r["before"], ".1f", " ms"),
            _f(r.get("slowed") and 1000 * r["slowed"], ".1f", " ms"),
            _f(r.get("after") and 1000 * r["after"], ".1f", " ms"),
            _f(base and r.get("after") and r["after"] / base, ".2f", "x"),
        ]
        for name, r in rows.items()
    ]
    out += _table(["run", "before", "slowed", "after", "after / failure-free"], table)
    return out + [""]


@tool_section("rerun_peer")
def section_rerun_peer(ctx: Any, doc: dict) -> list[str]:
    """One NaN at one step: megatron-core's state machine (restart on another device) and the
    rerun on a healthy peer, seconds from the fault step's start."""
    a = doc.get("args") or {}
    out = [
        f"The tiny demo model; every micro-batch loss of step {a.get('step', '?')} multiplied by "
        "NaN. megatron-core 0.16.1's `RerunStateMachine` around a Megatron-LM-style loop on 1 "
        'rank (a restart is a fresh process on "another GPU"); megatron-mecefo under '
        "`mecefo-launch` with 2 replicas (`--inject nan:1:S[:persistent|:data]`). Seconds from "
        "the fault step's start; resume ends when that step is committed. megatron-mecefo's "
        "detection is its normal step time: events.jsonl stamps no step start, and the vote "
        "that posts the anomaly ends each attempt (`docs/anomalies.md`).",
        "",
    ]
    rows = [
        [
            r.get("kind", "?"),
            r.get("system", "?"),
            r.get("verdict", "?"),
            _f(r.get("detection_s"), ".3f", " s"),
            _f(r.get("judgement_s"), ".2f", " s"),
            _f(r.get("resume_s"), ".2f", " s"),
            _f(r.get("total_s"), ".2f", " s"),
            str(r.get("ranks_stopped", "?")),
            _f(r.get("ckpt_bytes") and r["ckpt_bytes"] / 1e6, ".2f", " MB") if r.get("ckpt_bytes")
            else "0",
        ]
        for r in doc.get("rows") or []
    ]  # fmt: skip
    out += _table(
        ["kind", "system", "verdict", "detection", "judgement", "resume", "total",
         "ranks stopped", "checkpoint written"],
        rows,
    )  # fmt: skip
    parts = [
        ("in-place rerun", "in_place_rerun_s"), ("checkpoint save", "ckpt_save_s"),
        ("process teardown", "exit_s"), ("new process (python, torch, megatron)",
        "process_start_s"), ("build", "build_s"), ("load", "load_s"), ("rerun", "rerun_s"),
    ]  # fmt: skip
    for r in doc.get("rows") or []:
        if r.get("second_exit") is None:
            continue
        spent = ", ".join(f"{name} {_f(r.get(key), '.2f', ' s')}" for name, key in parts)
        out.append(
            f"- megatron-core, {r.get('kind')}: exit {r.get('first_exit')} then "
            f"{r.get('second_exit')}; {spent} (a process's first save: "
            f"{_f(r.get('first_save_s'), '.2f', ' s')})."
        )
    if doc.get("verdicts"):
        out += [
            "",
            "The machine's verdicts, both processes' parts run in one (`fatal` of "
            "`validate_result`: as timed = False for the transient, True before the restart and "
            "False after it for the others; True throughout is Megatron-LM's NaN check, False its "
            "spiky-loss check):",
            "",
        ]
    for label, kinds in (doc.get("verdicts") or {}).items():
        if label == "reference":
            continue
        said = "; ".join(
            f"{kind}: exit {r.get('first_exit')}"
            + (f" then {r['second_exit']}" if "second_exit" in r else "")
            + f" ({r.get('verdict', '?')})"
            for kind, r in kinds.items()
        )
        out.append(f"- `validate_result` {label}: {said}.")
    return out + [""]
