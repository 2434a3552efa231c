"""The sections of BENCHMARKS.md on silent faults: what the checks cost a normal step
(`tools/bench/anomaly_cost.py`), how far failure-free runs come to the spike limits
(`tools/bench/spike_threshold.py`), and a straggler's step time (`tools/bench/straggler.py`)."""

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
