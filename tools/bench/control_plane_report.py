"""The control-plane benchmark's tables: the load and latency columns and their legend.

Imported by `control_plane.py`, which puts `tools/bench` and the repository on `sys.path`."""

from __future__ import annotations

from bench_common import (
    cell,
)


# ------------------------------------------------------------------------------------ reporting
def _fmt(value, scale: float = 1.0, digits: int = 2) -> str:
    return cell(value, f",.{digits}f", scale=scale)


def _row_values(r: dict) -> dict[str, object]:
    """One synthetic configuration's table cells (None: not measured)."""
    steady, proj = r.get("steady", {}), r.get("projected", {})
    coord = r.get("coordinator", {}).get("steady", {})
    beat = "beat" if r["mode"][0] == "a" else "agent"  # the client that carries heartbeats
    props = [r.get(k, {}).get("propagation", {}) for k in ("silent", "exit", "rejoin")]
    gens = [p["gen_s"] for p in props if p.get("gen_s") is not None]
    records = [p["record_s"] for p in props if p.get("record_s") is not None]
    return {
        "offered": proj.get("offered_requests_per_s", {}).get("total"),
        "served": steady.get("served_requests_per_s"),
        "srv_cpu": steady.get("server_cpu_fraction"),
        "us_req": r.get("calibration", {}).get("protocol", {}).get("server_us_per_request"),
        "cores": proj.get("server_cores_needed"),
        "tick": coord.get("hb_tick_s", {}).get("p50"),
        "tick_cpu": coord.get("hb_tick_cpu_s", {}).get("p50"),
        "req_tick": coord.get("requests_per_hb_tick"),
        "read_period": coord.get("hb_read_period_s", {}).get("p50"),
        "silent": r.get("silent", {}).get("detection_s"),
        "exit": r.get("exit", {}).get("detection_s"),
        "rejoin": r.get("rejoin", {}).get("rejoin_s"),
        "gen_all": max(gens, default=None),
        "record": max(records, default=None),
        "storm": proj.get("record_storm_s"),
        "period_p99": r.get("client_periods_s", {}).get(beat, {}).get("p99"),
    }


LOAD_COLUMNS = (  # (header, key, scale, digits, width)
    ("offered/s", "offered", 1, 0, 10),
    ("served/s", "served", 1, 0, 9),
    ("srv%", "srv_cpu", 100, 0, 5),
    ("us/req", "us_req", 1, 1, 7),
    ("cores@N", "cores", 1, 2, 8),
    ("tick ms", "tick", 1000, 0, 8),
    ("cpu ms", "tick_cpu", 1000, 0, 7),
    ("req/tick", "req_tick", 1, 0, 9),
    ("read s", "read_period", 1, 2, 7),
)
LATENCY_COLUMNS = (
    ("silent s", "silent", 1, 2, 9),
    ("exit s", "exit", 1, 2, 7),
    ("rejoin s", "rejoin", 1, 2, 9),
    ("gen all", "gen_all", 1, 2, 8),
    ("record", "record", 1, 2, 7),
    ("storm@N", "storm", 1, 2, 8),
    ("period", "period_p99", 1, 2, 7),
)


def format_tables(rows: list[dict]) -> str:
    """The load table and the latency table of the synthetic runs."""
    out = []
    for columns in (LOAD_COLUMNS, LATENCY_COLUMNS):
        lines = [
            f"{'mode':<5}{'ranks':>6}{'live':>6}" + "".join(f"{h:>{w}}" for h, *_, w in columns)
        ]
        for r in rows:
            cells = _row_values(r)
            line = f"{r['mode']:<5}{r['ranks']:>6}{r.get('live_ranks', 0):>6}"
            line += "".join(f"{_fmt(cells[k], sc, d):>{w}}" for _, k, sc, d, w in columns)
            note = r.get("error") or r.get("skipped_failures")
            if columns is LATENCY_COLUMNS and (note or r.get("false_removals")):
                line += f"  {note or ''} {len(r.get('false_removals', []))} false removals"
            lines.append(line)
        out.append("\n".join(lines))
    return "\n\n".join(out)


LEGEND = """\
modes:   a = per-rank heartbeats to the store (a trainer without an agent channel);
         b = the product's protocol under mecefo-launch: heartbeats aggregated per node (one
         writer per node); the product's coordinator in both
load:    offered/s = store requests/s of all N ranks by the protocol (computed); served/s =
         measured (live clients + bulk multi_sets + coordinator); srv% = store process CPU in the
         steady window; us/req = store CPU per protocol request (calibration, measured);
         cores@N = offered x us/req (projected; the libuv store serves on ONE thread, so above
         ~0.7 it cannot hold); tick ms / cpu ms = coordinator ticks that read heartbeats, wall /
         the coordinator's own CPU (p50, at full N); req/tick = its store requests per such tick
         (serial round trips); read s = period between heartbeat reads (target 0.1 s)
latency: silent = a rank's heartbeat and its agent stop -> generation without it (includes the
         3 s soft timeout); exit = the rank exits, its agent reports it -> generation; rejoin =
         re-registration -> generation with it; gen all / record = publication -> the last live
         client read GEN / the generation record (max over the three generations); storm@N =
         store CPU to send the record to every reader at N (projected: N ranks in a, N/8 agents
         in b); period = p99 of the live clients' heartbeat period (0.2 s in a, 0.1 s in b)
"""


def format_real(rows: list[dict]) -> str:
    head = ("ranks", "exit", "start s", "wall s", "detect ms", "regroup ms")
    lines = ["".join(f"{h:>11}" for h in head) + "  note"]
    for r in rows:
        cells = (r["nproc"], r.get("exit_code", "-"), _fmt(r.get("first_step_s"), 1, 0))
        cells += (_fmt(r.get("wall_s"), 1, 0), _fmt(r.get("detection_ms"), 1, 0))
        cells += (_fmt(r.get("regroup_ms"), 1, 0),)
        note = r.get("skipped") or r.get("note", "")
        lines.append("".join(f"{str(c):>11}" for c in cells) + f"  {note}")
    return "\n".join(lines)
