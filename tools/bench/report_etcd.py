"""The etcd store's section of BENCHMARKS.md (`report.py` renders it from
`tools/bench/etcd_store.py`'s JSON)."""

from __future__ import annotations

from typing import Any

from bench_common import median_of
from report_context import tool_section
from report_markdown import _f, _table


@tool_section("etcd_store")
def section_etcd_store(ctx: Any, doc: dict) -> list[str]:
    """`tools/bench/etcd_store.py`: tcp against etcd on real jobs, the election, etcd's load."""
    out = [
        "`--store tcp` (the TCPStore on node 0) against `--store etcd` (a 3-member etcd cluster "
        "on this machine), in one run. Real jobs of the tiny model: a SIGKILL at step 10 "
        "(4 ranks), a node lost (2 nodes of 2 ranks), and the failure-free step time (2 ranks, "
        "the stores interleaved). A step's store traffic is the commit vote: each rank adds its "
        "vote, the last sets the decision, the others read it.",
        "",
    ]
    rows = []
    steps = {}
    for store in ("tcp", "etcd"):
        d = doc[store]
        steps[store] = median_of(r.get("step_s") for r in d["overhead"])
        rows.append(
            [
                store,
                _f(d["kill"]["detection_ms"], ".0f"),
                _f(d["kill"]["regroup_ms"], ".0f"),
                _f(d["node_loss"]["ranks_detected_ms"], ".0f"),
                _f(d["node_loss"]["node_lost_ms"], ".0f"),
                _f(steps[store] and 1000 * steps[store], ".1f"),
                _f(median_of(r.get("vote_ms") for r in d["overhead"]), ".2f"),
            ]
        )
    out += _table(
        [
            "store",
            "kill detected (ms)",
            "regroup (ms)",
            "node loss: ranks detected (ms)",
            "node declared lost (ms)",
            "step (ms)",
            "commit vote (ms)",
        ],
        rows,
    )
    if steps.get("tcp") and steps.get("etcd"):
        out.append(
            f"Step time on etcd is {100 * (steps['etcd'] / steps['tcp'] - 1):+.1f}% against tcp "
            "here (single runs drift by 10-15% on this machine; read it as the vote's cost, "
            "not a precise ratio)."
        )
        out.append("")
    elect = doc.get("election_s") or {}
    for ttl, xs in elect.items():
        out.append(
            f"- Election after the coordinator's SIGKILL, lease TTL {ttl} s: "
            + ", ".join(f"{x:.2f} s" for x in xs)
            + " (bounded by the TTL plus one 0.5 s poll; a clean exit hands over at once)."
        )
    s = doc.get("scale")
    if s:
        out += [
            "",
            f"etcd at scale. The agents' request mix, flat out from {s['workers']} client "
            f"processes: **{s['capacity_rps']:.0f} requests/s** (p50 {s['latency_ms_p50']:.2f} ms, "
            f"p99 {s['latency_ms_p99']:.2f} ms). One training step of the 2-rank job made "
            f"{s['requests_per_step_2_ranks']:.1f} requests (etcd's own counters; the commit vote "
            "is most of it). Offered = every agent's tick (2 requests per 0.1 s, plus its lease) "
            f"+ {s['per_rank_step']:.1f} requests per rank per step at one step per "
            f"{s['step_s']:.0f} s (8 ranks per node; the per-rank figure carries the agent's and "
            "coordinator's share too, so it is an upper bound):",
            "",
        ]
        out += _table(
            [
                "ranks",
                "nodes",
                "agents (req/s)",
                "steps (req/s)",
                "offered (req/s)",
                "of measured capacity",
                "coordinator's read of every node report (ms)",
            ],
            [
                [
                    r["ranks"],
                    r["nodes"],
                    _f(r["agents_rps"], ".0f"),
                    _f(r["steps_rps"], ".0f"),
                    _f(r["offered_rps"], ".0f"),
                    f"{r['utilization']:.0%}",
                    _f(r["coordinator_read_ms"], ".1f"),
                ]
                for r in s["rows"]
            ],
        )
        out.append(
            "Above 100% this cluster could not keep up. Clients, three members and their fsyncs "
            "share two cores here. A site cluster on its own machines and SSDs serves perhaps "
            "10-30k such requests/s. Even then, the agents' 0.1 s tick and a vote per rank per "
            "step are too chatty for a consensus store beyond a few thousand ranks. At 16k ranks "
            "they offer ~100k requests/s. That needs votes aggregated per node and a slower tick "
            "on etcd, which are not built. Choosing a store: `docs/failover.md`."
        )
        out.append("")
    return out
