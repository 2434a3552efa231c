"""The peers benchmark (`tools/bench/peers.py`) cannot rot: a short version (one kill, then a
group kill, 12 steps, the tiny model, 2 replicas) of every runner runs its schedule and produces
its row. No timing assertions: what is checked is that each system trained every step, that the
kill and the group kill (the replica's launcher or agent SIGKILLed with its trainer, then a new
launch in its place) happened and were survived, and that the columns are there. Our three live
modes share one runner (`run_mecefo`, which only adds each mode's overrides): spread-sample runs
here, and the neighbour's and hybrid's overrides are checked to make a valid run config without
a launch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "tools" / "bench" / "peers.py"
STEPS, KILL, GROUP = 12, 3, 10
COLUMNS = {
    "step_s",
    "step_vs_torchrun",
    "wall_s",
    "steps_committed",
    "goodput_samples_per_s",
    "kill_to_next_commit_s",
    "kills",
    "restarts",
    "steps_redone",
    "samples_dropped",
    "samples_counted_twice",
    "heal_bytes",
    "val_loss",
    "max_loss_dev",
    "group_kill_step",
    "group_kill_held",
    "group_kill_to_commit_s",
    "group_samples_dropped",
    "group_steps_redone",
}
RUN = ("torchrun", "checkpoint-restart", "spread-sample", "snapshot-restart", "torchft")
"""One system per runner (`peers.SYSTEMS` has all 7)."""
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_every_live_mode_is_a_valid_run_config(demo_data_dir):
    """The modes the test does not launch: their overrides load on the demo config (a bad key or
    value would fail the benchmark's run), and each sets the policy it is named for."""
    sys.path.insert(0, str(ROOT / "tools" / "bench"))
    import peers

    from megatron_mecefo.config.loader import load_config
    from megatron_mecefo.config.run import RunConfig

    assert set(peers.SYSTEMS) == {*RUN, "neighbour", "hybrid"}
    for name, overrides in peers.MECEFO.items():
        cfg = load_config(RunConfig, ROOT / "configs/run/demo_cpu.yaml", overrides)
        policy = {"neighbour": "neighbor", "hybrid": "hybrid", "spread-sample": "spread"}
        if name in policy:
            assert cfg.mecefo.takeover_policy == policy[name], name
        else:
            assert cfg.recovery.mode == "restart", name


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--kills", "4,x"], "--kills"),
        (["--kills", "4", "--steps", "12", "--group-kill", "3"], "--group-kill '3'"),
        (["--group-kill", "x"], "--group-kill 'x'"),
    ],
)
def test_bad_flag_is_one_line(flags, says):
    proc = subprocess.run(
        [sys.executable, str(PEERS), *flags], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"peers.py: error: {says}")
    assert "Traceback" not in proc.stderr


def test_every_system_runs_its_schedule(tmp_path, demo_data_dir):
    pytest.importorskip("torchft", reason="the peers extra: pip install -e '.[peers]'")
    out = tmp_path / "peers.json"
    cmd = [
        sys.executable,
        str(PEERS),
        "--steps",
        str(STEPS),
        "--kills",
        str(KILL),
        "--group-kill",
        str(GROUP),
        "--down-s",
        "0.5",
        "--replicas",
        "2",
        "--timeout-s",
        "240",
        "--demo-dir",
        demo_data_dir,
        "--work-dir",
        str(tmp_path / "runs"),
        "--out",
        str(out),
        "--figure",
        str(tmp_path / "loss.png"),
        "--systems",
        ",".join(RUN),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    table, traces = doc["columns"], doc["traces"]
    assert set(table) == set(RUN)
    assert (tmp_path / "loss.png").stat().st_size > 0
    for name, row in table.items():
        assert set(row) == COLUMNS, name
        assert row["steps_committed"] == STEPS, name
        assert row["val_loss"] is not None, name
        assert sorted({r["step"] for r in traces[name]["rows"]}) == list(range(STEPS)), name
        if name == "torchrun":
            assert row["kills"] == 0 and row["steps_redone"] == 0
            assert traces[name]["group_kill"] is None and row["group_kill_step"] is None
            continue
        # the kill and the group kill fired once each, and after each a step at or after its
        # step committed
        assert row["kills"] == 2, name
        assert traces[name]["kill_steps"] == [KILL, GROUP], name
        assert None not in row["kill_to_next_commit_s"], name
        assert row["group_kill_step"] == GROUP, name
        assert row["group_kill_to_commit_s"] == row["kill_to_next_commit_s"][1], name
        # the whole group died: its top process (torchrun, or our node's agent) was SIGKILLed
        # itself with what it started, and a new launch in its place ended well
        group = traces[name]["group_kill"]
        assert group["victim_rc"] == -9 and group["processes"] >= 2, (name, group)
        assert group["relaunched"] is True, (name, group)
        # ours too when the replacement's rank was still starting as the job ended (it had
        # exited 6, COORDINATOR_LOST, after 10 s of retries)
        assert group["new_launch_rc"] == 0, (name, group)
        assert row["max_loss_dev"] is not None, name
        assert row["samples_counted_twice"] == 0, name
        if name == "torchft":  # torchft trains on without the dead replica's samples
            assert row["samples_dropped"] > 0
            # the restarted replica healed from a peer: its HTTP transport's state dict
            assert row["heal_bytes"] > 100_000, row["heal_bytes"]
        else:  # every other system keeps the global batch
            assert row["samples_dropped"] == 0, name
    # torchrun restarted the job once, then the benchmark launched it again
    assert table["checkpoint-restart"]["restarts"] == 2
    assert traces["checkpoint-restart"]["group_kill"]["rejoined"] is True
    assert doc["checkpoint"]["checkpoint_interval"] >= 1
