"""`tools/bench/report.py`: the report builder on hand-made JSONs (trimmed from real `--quick`
runs of each tool), the plots' data, and the runner's handling of a failing or missing tool.
No benchmark runs here."""

import datetime as dt
import hashlib
import importlib.util
import json
import struct
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
NOW = dt.datetime(2026, 1, 2, 3, 4, 5)


def _load_tool():
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "tools/bench/report.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_report"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


report = _load_tool()

# mecefo-sim simulate --json (trimmed); TTT/T0 picked so the drops are round numbers.
SIM = {
    "num_groups": 8,
    "t0_h": 10.0,
    "failures_in_trace": 45,
    "elapsed_s": 0.002,
    "results": [
        {"strategy": "ckpt", "finished": True, "ttt_h": 12.5, "ttt_over_t0": 1.25,
         "restarts": 1, "masked_failures": 0, "mean_step_multiplier": 1.0},
        {"strategy": "snapshot", "finished": False, "ttt_h": float("inf"),
         "ttt_over_t0": float("inf"), "restarts": 1, "masked_failures": 0},
        {"strategy": "mecefo neighbor", "finished": True, "ttt_h": 10.4, "restarts": 0,
         "masked_failures": 1},  # no ttt_over_t0: taken from ttt_h / t0_h = 1.04
        {"strategy": "mecefo hybrid", "finished": True, "ttt_h": 10.1, "ttt_over_t0": 1.01,
         "restarts": 0, "masked_failures": 1},
    ],
}  # fmt: skip
REPRODUCE = {
    "level": "gpu",
    "rows": [
        {"N": 200, "rep_ckpt": 5.719772142640832, "rep_r": 3, "spare_ckpt": 3.017319015070476,
         "spare_r": 10, "paper_rep_ckpt": 6.07, "paper_spare_ckpt": 2.92},
        {"N": 600, "rep_ckpt": 4.55, "rep_r": 3, "spare_ckpt": 2.63, "spare_r": 6},
        {"N": 1000, "rep_ckpt": 4.17, "rep_r": 3, "spare_ckpt": 2.46, "spare_r": 7},
    ],
}  # fmt: skip
FAILOVER = {
    "machine": "vm",
    "cpus": 2,
    "failures": [
        {"kind": "kill", "detection_ms": 302.1, "regroup_ms": 385.3, "rejoin_ms": 551.3,
         "rejoin_state_mb": 2.017827, "rejoin_transfer_ms": 91.8, "steps_redone": 1,
         "samples_lost": 0, "steps_completed": 30},
        {"kind": "hang", "detection_ms": 3252.0, "regroup_ms": 3379.6, "rejoin_ms": None,
         "rejoin_state_mb": None, "rejoin_transfer_ms": None, "steps_redone": 1,
         "samples_lost": 0, "steps_completed": 30},
    ],
    "overhead": {"failover_step_s": [0.0700], "torchrun_step_s": [0.0680],
                 "overhead_fraction": 0.0294, "vote_ms_per_step": [0.65]},
    "sim_inputs": {"failover_s": 1.36},
}  # fmt: skip
RECOVERY = {
    "machine": "x86_64 2 cores, 3.11.7, CPU",
    "threads": 1,
    "models": {
        "tiny": {
            "overhead": {
                "0": {"median_step_s": 0.040, "overhead_pct": 0.0, "blocked_ms_per_step": 0.0,
                      "blocked_pct": 0.0},
                "1": {"median_step_s": 0.0406, "overhead_pct": 1.5, "blocked_ms_per_step": 0.3,
                      "blocked_pct": 0.75},
                "5": {"median_step_s": 0.0401, "overhead_pct": 0.25, "blocked_ms_per_step": 0.06,
                      "blocked_pct": 0.15},
            },
            "copy": {"bytes": 2017827, "snapshot_copy_gbps": 1.9, "memcpy_dram_gbps": 4.1,
                     "memcpy_shm_gbps": 2.2},
            "restore": {"state_mb": 2.0, "shm_s": 0.012, "parity_rebuild_s": 0.05,
                        "parity_total_s": 0.066, "disk_s": 0.41},
        }
    },
    "end_to_end": {
        "snapshot: every trainer killed": {"exit": 0, "wall_s": 30.0, "failure_step": 10,
                                           "recovery_ms": 2480.0, "resumed_step": 9,
                                           "source": "shared memory", "steps_recomputed": 1},
    },
    "encode_gbps": {"xor_k4": 3.5, "rs_k4_m2": 0.42},
    "memory_overhead": {"xor_n4": 0.25, "xor_n8": 0.125, "rs_n8_m2": 0.25, "replication_f2": 1.0},
}  # fmt: skip
CONVERGENCE = {
    "args": {"corpus": "demo", "model": "tiny", "steps": 60, "replicas": 4},
    "failure_free": {"val_loss": 3.0, "loss_curve": [6.2, 3.1]},
    "rows": [
        {"scenario": "moderate", "config": "hybrid", "policy": "hybrid", "val_loss": 3.015,
         "gap_loss_pct": 0.5, "gap_ppl_pct": 1.511, "step_time_ratio": 1.14},
    ],
}  # fmt: skip


def _vouched(value, run_id: str = "r1", **extra) -> dict:
    """A manifest entry of a successful run that wrote exactly `value` (as `_write` writes it)."""
    digest = hashlib.sha256(json.dumps(value).encode()).hexdigest()
    return {"status": "ok", "reason": None, "run_id": run_id, "json_sha256": digest, **extra}


def _write(directory: Path, **data) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in data.items():
        (directory / f"{name}.json").write_text(json.dumps(value))
    return directory


def _build(tmp_path, manifest=None, **data) -> str:
    json_dir = _write(tmp_path / "json", **data)
    return report.build_report(
        json_dir, tmp_path / "BENCH.md", tmp_path / "png", manifest=manifest, now=NOW
    )


def test_throughput_drop_is_one_minus_t0_over_ttt():
    rows = {r["strategy"]: r for r in report.throughput_drops(SIM)}
    assert rows["ckpt"]["drop_pct"] == pytest.approx(20.0)  # 1 - 1/1.25
    assert rows["mecefo neighbor"]["ttt_over_t0"] == pytest.approx(1.04)
    assert rows["mecefo neighbor"]["drop_pct"] == pytest.approx(100 * (1 - 1 / 1.04))
    assert rows["snapshot"]["drop_pct"] is None  # never finished: no throughput at all


def test_report_pins_numbers_from_the_inputs(tmp_path):
    md = _build(
        tmp_path,
        sim_mecefo_high_64=SIM,
        sim_reproduce=REPRODUCE,
        failover=FAILOVER,
        # the two halves of recovery.py as report.py runs them (the PNG test feeds one JSON)
        recovery={k: v for k, v in RECOVERY.items() if k != "end_to_end"},
        recovery_e2e={"models": {}, "end_to_end": RECOVERY["end_to_end"]},
        convergence=CONVERGENCE,
    )
    assert "2026-01-02T03:04:05" in md
    assert "| ckpt | 1.2500 | 20.00% | 1 | 0 |" in md
    assert "| mecefo neighbor | 1.0400 | 3.85% | 0 | 1 |" in md
    assert "| mecefo hybrid | 1.0100 | 0.99% | 0 | 1 |" in md
    assert "| snapshot | inf | did not finish |" in md
    assert "**1.07%** (350M), **2.98%** (1B), **4.18%** (7B)" in md
    # SPARe: gap = ours / paper - 1; the paper's values fall back to the built-in table.
    assert "| 200 | 5.72 | 6.07 | -5.8% | 3.02 | 2.92 | +3.3% | 3 / 10 |" in md
    assert "| 600 | 4.55 | 4.27 | +6.6% | 2.63 | 2.49 | +5.6% | 3 / 6 |" in md
    assert "| kill | 302 ms | 385 ms | 551 ms | 2.02 MB in 92 ms | 1 | 0 |" in md
    assert "| hang | 3252 ms | 3380 ms | - | - MB in - ms | 1 | 0 |" in md
    assert "+2.9%; commit vote median 0.65 ms" in md
    assert "| snapshot: every trainer killed | 2480 ms | shared memory | 1 | 0 |" in md
    assert "| tiny | 1 | 40.6 ms | +1.5% | 0.30 ms | 0.75% |" in md
    assert "| tiny | 2.0 MB | 1.90 / 2.20 / 4.10 | 12 ms | 66 ms | 410 ms |" in md
    assert "| moderate | hybrid | hybrid | 3.0150 | +0.500% | +1.511% | 1.14x |" in md
    # a JSON from an earlier run without a manifest entry says so instead of inventing a machine
    assert "unknown machine" in md


def test_missing_or_failed_tool_is_reported_not_measured(tmp_path):
    manifest = {
        "degraded": {"status": "failed", "reason": "exit 1: RuntimeError: boom", "wall_s": 2.0,
                     "command": "python tools/bench/degraded.py --out x.json"},
        "sim_mecefo_high_64": _vouched(SIM),
    }  # fmt: skip
    md = _build(tmp_path, manifest=manifest, sim_mecefo_high_64=SIM)
    line = "not measured: `tools/bench/failover.py` (failover latencies): no JSON at"
    assert f"> {line}" in md
    closing = md.split("## Not measured", 1)[1]
    assert f"- {line}" in closing and "`tools/bench/convergence.py`" in closing
    assert "not measured: `tools/bench/degraded.py` (degraded-mode step time): failed: exit 1: " \
           "RuntimeError: boom" in md  # fmt: skip
    assert "| degraded | failed | `unknown` | 2.0 s |" in md  # the runs table
    # a tool that ran is not in the closing list
    assert "mecefo_high, 64 GPUs" not in closing


def test_unexpected_json_shape_is_not_measured_not_a_crash(tmp_path):
    md = _build(tmp_path, failover={"failures": [{"kind": "kill", "detection_ms": "soon"}]})
    section = md.split("## Detection, regroup and recovery times", 1)[1].split("\n## ")[0]
    assert "not measured: the JSON for this section has an unexpected shape" in section


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_pngs_are_written_and_linked(tmp_path):
    md = _build(tmp_path, sim_mecefo_high_64=SIM, sim_reproduce=REPRODUCE, recovery=RECOVERY)
    written = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert written == ["latencies.png", "snapshot_overhead.png", "spare_ttt.png",
                       "throughput_drop.png"]  # fmt: skip
    for name in written:
        assert _png_size(tmp_path / "png" / name) == (800, 450)
        assert f"](png/{name})" in md


def _bar_heights(fig) -> list[float]:
    return [round(p.get_height(), 6) for p in fig.axes[0].patches]


def test_throughput_plot_bars_and_paper_markers():
    rows = report.throughput_drops(SIM)
    fig = report.plot_throughput_drop({"a": rows, "b": rows[:1]})
    # scenario a: 3 finished strategies (snapshot has no bar); scenario b: ckpt only
    assert sorted(_bar_heights(fig)) == sorted(
        [20.0, round(100 * (1 - 1 / 1.04), 6), round(100 * (1 - 1 / 1.01), 6), 20.0]
    )
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts.count("did not finish") == 1  # a's snapshot; b never ran it
    markers = sorted(line.get_ydata()[0] for line in fig.axes[0].lines)
    assert markers == [1.07, 2.98, 4.18]
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == [
        "ckpt", "snapshot", "mecefo neighbor", "mecefo hybrid"
    ]  # fmt: skip


def test_spare_plot_ours_next_to_paper():
    fig = report.plot_spare(report.spare_rows(REPRODUCE))
    heights = _bar_heights(fig)
    assert len(heights) == 12  # 3 N x (Rep ours, Rep paper, SPARe ours, SPARe paper)
    assert heights[3:6] == [6.07, 4.27, 3.88]  # the Rep+CKPT paper series, one bar per N
    assert heights[9:12] == [2.92, 2.49, 2.34]


def test_latency_and_snapshot_plot_data():
    rows = report.latency_rows(FAILOVER, RECOVERY)
    assert [r["label"] for r in rows] == ["kill", "hang", "snapshot: every trainer killed"]
    fig = report.plot_latencies(rows)
    # detection 2 + regroup 2 + rejoin 1 (the hang's is None) + recovery 1
    assert sorted(_bar_heights(fig)) == sorted([302.1, 3252.0, 385.3, 3379.6, 551.3, 2480.0])
    snap = report.snapshot_rows(RECOVERY)
    assert [(r["interval"], r["overhead_pct"]) for r in snap] == [(0, 0.0), (1, 1.5), (5, 0.25)]
    fig = report.plot_snapshot_overhead(snap)
    lines = fig.axes[0].lines
    assert len(lines) == 3  # median step, blocked, the 2% target
    assert list(lines[0].get_xdata()) == [1, 5] and list(lines[1].get_ydata()) == [0.75, 0.15]


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "fake_tool.py"
    path.write_text(
        "import argparse, json, sys\n"
        "p = argparse.ArgumentParser(); p.add_argument('--out'); a = p.parse_args()\n"
        + textwrap.dedent(body)
    )
    return str(path)


@pytest.mark.timeout(60)
def test_runner_records_failure_and_success(tmp_path):
    failing = report.Tool("x", "fake", _script(tmp_path, "print('boom'); sys.exit(3)\n"))
    entry = report.run_tool(failing, tmp_path, quick=True, timeout_s=30)
    assert entry["status"] == "failed" and entry["reason"] == "exit 3: boom"
    missing = report.Tool("y", "fake", str(tmp_path / "nope.py"))
    entry = report.run_tool(missing, tmp_path, quick=True, timeout_s=30)
    assert entry["status"] == "missing" and "does not exist" in entry["reason"]
    ok = report.Tool("z", "fake", _script(tmp_path, "open(a.out, 'w').write('{\"rows\": []}')\n"))
    entry = report.run_tool(ok, tmp_path, quick=True, timeout_s=30)
    assert entry["status"] == "ok" and json.loads((tmp_path / "z.json").read_text()) == {"rows": []}
    assert entry["wall_s"] > 0 and entry["command"].endswith("--out " + str(tmp_path / "z.json"))
    assert len(entry["loadavg_1m"]) == 2  # the machine's load at start and end, for the reader


def test_cli_skip_run_rebuilds_only_from_recorded_runs(tmp_path):
    """A JSON dropped into the folder by hand is not measured; once a recorded run vouches for
    it (its SHA-256 in the manifest), --skip-run rebuilds the report from it."""
    _write(tmp_path / "out", sim_mecefo_high_64=SIM)
    argv = ["--skip-run", "--out-dir", str(tmp_path / "out"), "--md", str(tmp_path / "B.md")]
    argv += ["--png-dir", str(tmp_path / "png")]
    assert report.main(argv) == 0
    md = (tmp_path / "B.md").read_text()
    assert "| ckpt | 1.2500 |" not in md, md
    assert "was not produced by a report run (no manifest entry)" in md
    assert not (tmp_path / "out" / "manifest.json").exists()  # nothing ran, nothing recorded
    manifest = {report.REPORT_KEY: {"run_id": "r1"}, "sim_mecefo_high_64": _vouched(SIM)}
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    assert report.main(argv) == 0
    md = (tmp_path / "B.md").read_text()
    assert "| ckpt | 1.2500 | 20.00% |" in md and "not measured: `tools/bench/step_time.py`" in md
    assert "from report run `r1`" in md and "From another run" not in md


def test_an_edited_json_is_not_measured(tmp_path):
    edited = {**SIM, "t0_h": 99.0}  # a hand edit after the run
    manifest = {report.REPORT_KEY: {"run_id": "r1"}, "sim_mecefo_high_64": _vouched(SIM)}
    md = _build(tmp_path, manifest=manifest, sim_mecefo_high_64=edited)
    assert "SHA-256 does not match the manifest" in md and "| ckpt | 1.2500 |" not in md


def test_sections_from_another_run_name_it(tmp_path):
    manifest = {
        report.REPORT_KEY: {"run_id": "r2"},
        "sim_mecefo_high_64": _vouched(SIM, run_id="r1", quick=True),
        "sim_reproduce": _vouched(REPRODUCE, run_id="r2"),
    }
    md = _build(tmp_path, manifest=manifest, sim_mecefo_high_64=SIM, sim_reproduce=REPRODUCE)
    throughput = md.split("## Throughput drop", 1)[1].split("## Loss gap", 1)[0]
    spare = md.split("## SPARe table", 1)[1].split("## Step time", 1)[0]
    assert "From another run: `r1` (--quick), not this report's run `r2`" in throughput
    assert "From another run" not in spare
    assert "| sim_reproduce | ok | this |" in md and "| sim_mecefo_high_64 | ok | `r1` |" in md


def test_hybrid_verdict_is_computed_not_claimed():
    rows = [
        {"scenario": "hybrid", "n": 4, "ratio": 1.1712},
        {"scenario": "hybrid", "n": 8, "ratio": 1.1503},
        {"scenario": "spread", "n": 4, "ratio": 1.40},
    ]
    assert report.hybrid_verdicts(rows) == [
        "n = 4: 1.17x, above the target",
        "n = 8: 1.15x, meets it",
    ]


# tools/bench/node_loss.py (trimmed): one round with a standby node, one without.
NODE_LOSS = {
    "args": {"nnodes": 2, "nproc": 2, "standby": 1, "steps": 120, "kill_at": 10, "rounds": 2},
    "rounds": [
        {"exit_code": 0, "killed": True, "detection_ms": 3250.0, "node_lost": True,
         "full_strength_s": 5.4, "degraded_steps": 9, "final_replicas": 4,
         "rejoin_bytes": 4000000, "steps_logged": 120},
        {"exit_code": 0, "killed": True, "detection_ms": 3350.0, "node_lost": True,
         "full_strength_s": 6.0, "degraded_steps": 11, "final_replicas": 4,
         "rejoin_bytes": 4000000, "steps_logged": 120},
    ],
}  # fmt: skip
NODE_LOSS_NOSPARE = {
    "args": {**NODE_LOSS["args"], "standby": 0, "rounds": 1},
    "rounds": [
        {"exit_code": 0, "killed": True, "detection_ms": 3100.0, "node_lost": True,
         "full_strength_s": None, "degraded_steps": 110, "final_replicas": 2,
         "rejoin_bytes": 0, "steps_logged": 120},
    ],
}  # fmt: skip
# tools/bench/control_plane.py (trimmed): one synthetic configuration, one real job.
CONTROL_PLANE = {
    "args": {"heartbeat_timeout_s": 3.0, "step_s": 2.0},
    "synthetic": [
        {"mode": "b", "ranks": 16384, "live_ranks": 512,
         "calibration": {"protocol": {"server_us_per_request": 11.2}},
         "coordinator": {"steady": {"hb_tick_s": {"p50": 0.145}, "hb_tick_cpu_s": {"p50": 0.063},
                                    "requests_per_hb_tick": 10}},
         "projected": {"offered_requests_per_s": {"total": 40960.0},
                       "server_cores_needed": 0.4587},
         "silent": {"detection_s": 3.25, "propagation": {"gen_s": 0.35, "record_s": 0.4}},
         "exit": {"detection_s": 0.38, "propagation": {"gen_s": 0.21}},
         "rejoin": {"rejoin_s": 0.64, "propagation": {"gen_s": 0.3}}},
        {"mode": "a", "ranks": 16384,
         "skipped_failures": "the coordinator completed 0 ticks in 5 s",
         "projected": {"offered_requests_per_s": {"total": 671744.0}}},
    ],
}  # fmt: skip
CONTROL_PLANE_REAL = {
    "args": {"real_kill_step": 4},
    "real": [
        {"nproc": 8, "exit_code": 0, "first_step_s": 21.3, "detection_ms": 454.2,
         "regroup_ms": 837.0, "rejoined": True},
        {"nproc": 32, "skipped": "needs ~14 GB, 9.0 GB available"},
    ],
}  # fmt: skip
# tools/bench/granularity.py (trimmed): one model, n = 4.
GRANULARITY = {
    "args": {"models": ["small"], "reps": 3},
    "models": [
        {"model": "small", "shape": "2 layers, d=128, s=128", "device": "cpu", "mbs": 4,
         "microbatches": 8, "normal_step_s": 0.8, "cut_step_s": 1.1,
         "slice_overhead_s": 0.0115, "slice_overhead_fraction": 0.115,
         "rows": [
             {"granularity": "microbatch", "n": 4, "tasks": 11, "slices": 0, "samples": 44,
              "ratio": 1.378, "predicted_ratio": 1.375},
             {"granularity": "sample", "n": 4, "tasks": 10, "slices": 2, "samples": 43,
              "ratio": 1.347, "predicted_ratio": 1.344},
         ]},
    ],
}  # fmt: skip
ALL_SECTIONS = [
    "Throughput drop under failures",
    "Loss gap vs failure-free",
    "Convergence with error bars (multi-seed studies)",
    "Detection, regroup and recovery times",
    "Node loss and standby nodes",
    "Control plane at 16k ranks",
    "Snapshot overhead and restore times",
    "SPARe table (time to train at 600k GPUs)",
    "Step time",
    "Degraded-mode step time per rank",
    "Takeover granularity per rank",
    "Covering pipeline step time (PP 2)",
    "Distributed optimizer (ZeRO-1) vs replicated",
    "Control plane on etcd vs tcp",
    "Side by side with the peers (torchft, checkpoint-restart)",
    "Silent-fault checks: what a normal step pays",
    "Spike thresholds against failure-free runs",
    "A straggler's step time, mitigated",
    "One NaN beside megatron-core's RerunStateMachine",
]
"""Every section BENCHMARKS.md holds: none of it may be typed in by hand after a run."""


def test_node_loss_control_plane_and_granularity_sections(tmp_path):
    md = _build(
        tmp_path,
        node_loss=NODE_LOSS,
        node_loss_nospare=NODE_LOSS_NOSPARE,
        control_plane=CONTROL_PLANE,
        control_plane_real=CONTROL_PLANE_REAL,
        granularity=GRANULARITY,
    )
    node = md.split("## Node loss and standby nodes", 1)[1].split("\n## ")[0]
    assert "| with a standby node (2 round(s)) | without a standby node (1 round(s)) |" in node
    assert "| detection of the node's ranks | 3.30 s | 3.10 s |" in node  # medians
    assert "| failure -> full data-parallel width again | 5.7 s | never |" in node
    assert "| steps run with degraded micro-batches | 10 | 110 |" in node
    assert "| state sent to the replacement ranks | 4.0 MB | 0.0 MB |" in node
    assert "| exit code per round | 0/0 | 0 |" in node
    cp = md.split("## Control plane at 16k ranks", 1)[1].split("\n## ")[0]
    assert "| b | 16,384 | 40,960 | 11.2 | 0.46 | 145 / 63 | 10 | 3.25 s | 0.38 s | 0.64 s | " \
           "0.35 s | - |" in cp  # fmt: skip
    assert "| a | 16,384 | 671,744 | - | - | - / - | - | - | - | - | - | the coordinator " \
           "completed 0 ticks in 5 s |" in cp  # fmt: skip
    assert "| 8 | 0 | 21.3 s | 454 ms | 837 ms | yes | - |" in cp
    assert "| 32 | - | - | - | - | - | needs ~14 GB, 9.0 GB available |" in cp
    gran = md.split("## Takeover granularity per rank", 1)[1].split("\n## ")[0]
    assert "normal step 800.0 ms; fixed cost of a slice 11.50 ms = 12% of a micro-batch" in gran
    assert "| 4 | 1.378x | 1.347x | 1.375 / 1.344 | 2 | +2.2% |" in gran


def test_every_section_is_generated_and_reads_its_tools(tmp_path):
    """Dropping a section, or a tool no section reads, fails here: with nothing measured, every
    tool's "not measured" line stands inside a generated section, before the closing list."""
    assert [title for title, _ in report.SECTIONS] == ALL_SECTIONS
    manifest = {report.REPORT_KEY: {"run_id": "r1"}}
    manifest.update({t.name: {"status": "failed", "reason": "boom"} for t in report.TOOLS})
    md = _build(tmp_path, manifest=manifest)
    body, closing = md.split("## Not measured", 1)
    for title in ALL_SECTIONS:
        assert f"\n## {title}\n" in body
    for tool in report.TOOLS:
        line = f"({tool.title}): failed: boom"
        assert line in body and line in closing, tool.name
    for name in ("node_loss", "node_loss_nospare", "control_plane", "control_plane_real",
                 "granularity", "sim_llama3_16k_spares"):  # fmt: skip
        assert name in {t.name for t in report.TOOLS}


def test_skip_run_rebuild_describes_the_run_it_reads(tmp_path):
    out = _write(tmp_path / "out", sim_mecefo_high_64=SIM)
    manifest = {
        report.REPORT_KEY: {"run_id": "r1", "started": "2026-01-01T00:00:00", "quick": True},
        "sim_mecefo_high_64": _vouched(SIM),
    }
    (out / "manifest.json").write_text(json.dumps(manifest))
    argv = ["--skip-run", "--out-dir", str(out), "--md", str(tmp_path / "B.md")]
    assert report.main([*argv, "--png-dir", str(tmp_path / "png")]) == 0
    md = (tmp_path / "B.md").read_text()
    assert "Generated by `python tools/bench/report.py --quick`" in md
    assert "from report run `r1` (started 2026-01-01T00:00:00)" in md


def test_convergence_study_section_renders_committed_studies(tmp_path, monkeypatch):
    study = tmp_path / "study"
    study.mkdir()
    row = {"scenario": "moderate", "config": "neighbor", "policy": "neighbor", "techniques": "x",
           "step_time_ratio": 1.3, "predicted_step_ratio": 1.44,
           "mean_predicted_step_ratio": 1.44, "degraded_fraction": 0.123}  # fmt: skip
    rows = [{**row, "seed": s, "gap_ppl_pct": g} for s, g in ((1, 1.0), (2, 1.2), (3, 0.8))]
    args = {"corpus": "kjv", "num_layers": 8, "microbatches": 2}
    (study / "study_kjv.json").write_text(
        json.dumps(
            {
                "args": args,
                "rows": rows,
                "command": "python c.py --seeds 1 2 3",
                "date": "2026-11-25",
            }
        )  # fmt: skip
    )
    monkeypatch.setattr(sys.modules["report_sections"], "STUDY_DIR", study)
    md = "\n".join(report.section_convergence_study(None))
    row = "| kjv | 8 | all | 2 | moderate | neighbor | 3 | +1.00 +- 0.20 | [+0.50, +1.50] | yes "
    assert row in md
    assert "`python c.py --seeds 1 2 3` (2026-11-25)" in md
    assert "| skip+lowrank |" in md  # the planner's shipped table


def _mem_row(model: str, dp: int, params: int) -> dict:
    """A sharded_optimizer.py memory row of fp32 on CPU: 8 bytes/param replicated, 12/DP."""
    row = {"model": model, "dp": dp, "params": params, "numel": params, "copies_x2": min(dp, 2)}
    for kind, per_param in (("replicated", 8), ("sharded", 12 / dp), ("sharded_x2", 24 / dp)):
        per_param = 12 if kind == "sharded_x2" and dp == 1 else per_param
        row[f"{kind}_bytes"] = int(per_param * params)
        row[f"{kind}_bytes_per_param"] = per_param
        row[f"{kind}_master_bytes"] = 0 if kind == "replicated" else int(per_param * params / 3)
    row["sharded_over_replicated"] = row["sharded_bytes"] / row["replicated_bytes"]
    return row


def _step_row(config: str, step_s: float, rounds: list, vs_rep: float, vs_sh: float, snap=None):
    return {"model": "small", "config": config, "dp": 4, "step_s": step_s,
            "step_s_by_round": rounds, "vs_replicated": vs_rep, "vs_sharded": vs_sh,
            "snapshot": snap, "error": None}  # fmt: skip


def _failover_run(scenario: str, detail: str, replaced: bool) -> dict:
    events = [{"type": "rejoin", "generation": 3, "bytes": 690000, "latency_ms": 320.0}] * (
        2 if replaced else 1
    )
    moves = [
        {"generation": 2, "step": 5, "bytes": 988032, "transfer_ms": 5.8, "regroup_ms": 588.6,
         "regroup_detail": f"failure: members [0, 1], removed [{detail}], added []",
         "rejoin_ms": None, "rejoin_state_bytes": None},
        {"generation": 3, "step": 15, "bytes": 988032, "transfer_ms": 20.7, "regroup_ms": None,
         "regroup_detail": f"join: members [0, 1, 2, 3], removed [], added [{detail}]",
         "rejoin_ms": 320.0, "rejoin_state_bytes": 690000 * len(events)},
    ]  # fmt: skip
    types = ["regroup", "rejoin", "shard_adopt"] + (["node_replaced"] if replaced else [])
    audit = {"audited_steps": 40, "always_held": True, "max_holders": 2, "holders_agree": True,
             "own_held_at_end": True}  # fmt: skip
    return {"scenario": scenario, "exit_code": 0, "ok": True, "steps_logged": 40,
            "detection_ms": 369.5, "moves": moves, "regroups_without_shard_adopt": [],
            "event_types": types, "steps_redone": 1, "final_replicas": 4, "audit": audit,
            "events": events}  # fmt: skip


SHARDED_OPTIMIZER = {
    "args": {"step_dp": 4, "micro_batch_size": 8, "num_microbatches": 2, "steps": 40,
             "warmup": 10, "repeats": 2, "failover_steps": 40, "kill_at": 5, "standby": 1},
    "machine": {"cpus": 2},
    "loadavg_1m": [10.5, 11.3],
    "memory": [_mem_row("small", 1, 3426560), _mem_row("small", 4, 3426560)],
    "step_time": [
        _step_row("replicated", 2.144, [1.957, 2.331], 1.0, 1.128),
        _step_row("sharded", 1.9006, [1.940, 1.862], 0.886, 1.0),
        _step_row("sharded+snapshot", 1.7956, [1.732, 1.860], 0.837, 0.945,
                  {"bytes": 24010090, "mean_copy_ms": 49.16, "blocked_s": 0.0028}),
    ],
    "failover": [_failover_run("kill rank 2", "2", False),
                 _failover_run("lose node 1", "2, 3", True)],
}  # fmt: skip


def _sharded_section(tmp_path, data=SHARDED_OPTIMIZER) -> str:
    md = _build(tmp_path, sharded_optimizer=data)
    return md.split("## Distributed optimizer (ZeRO-1) vs replicated", 1)[1].split("\n## ")[0]


def test_sharded_optimizer_section_tables_and_reading(tmp_path):
    sec = _sharded_section(tmp_path)
    assert "| small | 3,426,560 | 4 | 27.412 MB (8.00) | 10.280 MB (3.00) | 20.559 MB (6.00) " \
           "| 0.38 |" in sec  # fmt: skip
    assert "static DP 4 (torchrun, 4 ranks on the 2 cores), micro-batch 8 x 2 per replica, " \
           "median of steps 10-39, median of 2 interleaved rounds" in sec  # fmt: skip
    assert "| small | replicated | 2144.0 ms (1957, 2331) | 1.000 | 1.128 | - | - |" in sec
    assert "| small | sharded + snapshot every step | 1795.6 ms (1732, 1860) | 0.837 | 0.945 " \
           "| 24.01 MB | 49.2 ms |" in sec  # fmt: skip
    assert "| kill rank 2 | 370 ms | gen 2: rank 2 removed | 5 | 0.988 | 6 ms | 589 ms | - |" in sec
    assert "|  |  | gen 3: rank 2 rejoins | 15 | 0.988 | 21 ms | - | 320 ms (0.69 MB of state) |" \
        in sec  # fmt: skip
    assert "gen 3: standby takes ranks 2, 3 | 15 | 0.988 | 21 ms | - | 320 ms (2 x 0.69 MB " in sec
    assert "Both runs finished all 40 steps at 4 replicas, with one step redone each." in sec
    assert "at most 2, and its holders agreed bit for bit" in sec
    reading = sec.split("**Reading.** ", 1)[1]
    assert "So it costs 1.5x at DP 1, breaks even at DP 1.5, and holds 0.375x at DP 4." in reading
    assert "(24/DP: 6 bytes/param at DP 4, still 0.75x of replicated fp32)" in reading
    assert "Four ranks time-share 2 cores." in reading
    assert "differ by up to 19% (small replicated: 1957 vs 2331 ms)" in reading
    assert 'So "sharded is 11% faster" is noise, not a result' in reading
    assert "(small: 24.0 MB per rank; the replicated state alone would be 27.4 MB on top of " \
           "the 13.7 MB of parameters)" in reading  # fmt: skip
    assert "49 ms per copy, and 3 ms of waiting in total over 40 steps" in reading
    assert "takes 6-21 ms. That is at most 1% of failure -> regroup" in reading
    assert "A rejoining rank receives 0.69 MB of state, then its shards." in reading  # no tiny row
    assert "Every regroup of these runs wrote a `shard_adopt` event." in reading
    assert "sharded_optimizer.py --repeats 2 --out" in sec  # the Tool's command


def test_sharded_optimizer_reading_follows_the_numbers(tmp_path):
    """Rounds that agree make the step-time ratios a result; a failed audit and a regroup
    without shard_adopt are said, not the clean-run sentences."""
    data = json.loads(json.dumps(SHARDED_OPTIMIZER))
    for row in data["step_time"]:
        row["step_s_by_round"] = [row["step_s"], row["step_s"] * 1.01]
    run = data["failover"][1]
    run["audit"]["holders_agree"] = False
    run["regroups_without_shard_adopt"] = [3]
    sec = _sharded_section(tmp_path, data)
    assert "Sharded over replicated step: 0.886, beyond the 1% between rounds" in sec
    assert "is noise" not in sec
    assert "Shard audit of lose node 1: the holders of a shard disagreed." in sec
    assert "Shard audit of kill rank 2: clean." in sec
    assert "Regroups that wrote no `shard_adopt` event: lose node 1: generation(s) 3." in sec


ETCD_STORE = {
    "machine": "vm",
    "cpus": 2,
    "tcp": {
        "kill": {"detection_ms": 300.0, "regroup_ms": 550.0},
        "node_loss": {"ranks_detected_ms": 3200.0, "node_lost_ms": 5000.0},
        "overhead": [{"step_s": 0.050, "vote_ms": 0.5}, {"step_s": 0.048, "vote_ms": 0.6}],
    },
    "etcd": {
        "kill": {"detection_ms": 400.0, "regroup_ms": 850.0},
        "node_loss": {"ranks_detected_ms": 3300.0, "node_lost_ms": 5100.0},
        "overhead": [{"step_s": 0.066, "vote_ms": 5.0}, {"step_s": 0.064, "vote_ms": 5.2}],
    },
    "election_s": {"5": [4.6, 5.1]},
    "scale": {
        "capacity_rps": 1000.0,
        "latency_ms_p50": 3.0,
        "latency_ms_p99": 5.5,
        "workers": 3,
        "requests_per_step_2_ranks": 13.4,
        "per_rank_step": 6.7,
        "step_s": 2.0,
        "rows": [
            {
                "ranks": 1024,
                "nodes": 128,
                "agents_rps": 2714.0,
                "steps_rps": 3430.4,
                "offered_rps": 6144.4,
                "utilization": 6.1444,
                "coordinator_read_ms": 7.4,
            },
        ],
    },
}


def test_etcd_store_section(tmp_path):
    md = _build(tmp_path, etcd_store=ETCD_STORE)
    sec = md.split("## Control plane on etcd vs tcp", 1)[1].split("\n## ")[0]
    assert "| tcp | 300 | 550 | 3200 | 5000 | 49.0 | 0.55 |" in sec  # medians of the A/B runs
    assert "| etcd | 400 | 850 | 3300 | 5100 | 65.0 | 5.10 |" in sec
    assert "Step time on etcd is +32.7% against tcp" in sec
    assert "lease TTL 5 s: 4.60 s, 5.10 s" in sec
    assert "| 1024 | 128 | 2714 | 3430 | 6144 | 614% | 7.4 |" in sec
    assert "etcd_store.py --out" in sec  # the Tool's command


def test_peers_and_anomaly_cost_sections(tmp_path):
    peers = {
        "schedule": {"replicas": 4, "steps": 400, "kill_replica": 1, "kill_steps": [50, 175, 300],
                     "down_s": 2.0},  # the keys peers.py writes
        "columns": {
            "torchrun": {"step_s": 0.0845, "step_vs_torchrun": 1.0, "wall_s": 44.4,
                         "goodput_samples_per_s": 576.3, "kill_to_next_commit_s": [],
                         "steps_redone": 0, "samples_dropped": 0, "heal_bytes": None,
                         "val_loss": 2.4473, "max_loss_dev": None},
            "torchft": {"step_s": 0.0779, "step_vs_torchrun": 0.92, "wall_s": 62.3,
                        "goodput_samples_per_s": 410.3, "kill_to_next_commit_s": [5.1, 5.02],
                        "steps_redone": 0, "samples_dropped": 48, "heal_bytes": None,
                        "val_loss": 2.4432, "max_loss_dev": 0.0169},
        },
    }  # fmt: skip
    cost = {
        "rows": [{"model": "tiny", "params_m": 0.16, "step_on_s": 0.0246, "step_off_s": 0.0244,
                  "check_overhead": 0.011, "fingerprint_s": 0.00074,
                  "fingerprint_vs_step": 0.030}],
        "fingerprint_gb_per_s": 1.1,
    }  # fmt: skip
    md = _build(tmp_path, peers=peers, anomaly_cost=cost)
    sec = md.split("## Side by side with the peers", 1)[1].split("\n## ")[0]
    assert "replica 1 SIGKILLed at steps [50, 175, 300], back 2.0 s later" in sec
    assert "| torchrun | 84.5 | 1.00 | 44.4 | 576.3 | n/a | 0 | 0 | - | 2.4473 | - |" in sec
    assert "| torchft | 77.9 | 0.92 | 62.3 | 410.3 | 5.10, 5.02 | 0 | 48 | - | 2.4432 | 0.0169 |" \
        in sec  # fmt: skip
    assert "peers.py --out" in sec  # the Tool's command
    sec = md.split("## Silent-fault checks", 1)[1].split("\n## ")[0]
    assert "| tiny | 0.16M | 24.6 ms | 24.4 ms | +1.1% | 0.74 ms | 3.0% |" in sec
    assert "1.10 GB/s" in sec


def test_spike_threshold_and_straggler_sections(tmp_path):
    spikes = {
        "defaults": {"loss": 3.0, "grad": 10.0}, "window": 100, "warmup": 20,
        "runs": [{"run": "tiny:8:2:1234", "alarms": [],
                  "loss": {"checked": 980, "peak": 1.084, "peak_step": 31, "p999": 1.05},
                  "grad": {"checked": 980, "peak": 2.5, "peak_step": 40, "p999": 2.1}}],
    }  # fmt: skip
    straggler = {
        "args": {"nproc": 2, "factor": 2.0, "slow_from": 20}, "floor": 1.333,
        "rows": {"failure-free": {"before": 0.1, "slowed": 0.1, "after": 0.1},
                 "slowed, watch on": {"before": 0.1, "slowed": 0.2, "after": 0.14}},
    }  # fmt: skip
    md = _build(tmp_path, spike_threshold=spikes, straggler=straggler)
    sec = md.split("## Spike thresholds", 1)[1].split("\n## ")[0]
    assert "| tiny:8:2:1234 | loss | 980 | 1.084 | 31 | 1.050 | 2.8x | 0 |" in sec
    assert "| tiny:8:2:1234 | grad | 980 | 2.500 | 40 | 2.100 | 4.0x | 0 |" in sec
    sec = md.split("## A straggler's step time", 1)[1].split("\n## ")[0]
    assert "Floor with uneven shares: 1.33x" in sec
    assert "| slowed, watch on | 100.0 ms | 200.0 ms | 140.0 ms | 1.40x |" in sec
