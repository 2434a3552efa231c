"""`mecefo-sim` subcommands: JSON output, plots, and one-line errors with CONFIG_ERROR."""

import json
from pathlib import Path

import matplotlib.image as plt_image
import numpy as np
import pytest

from megatron_mecefo.errors import ExitCode
from megatron_mecefo.sim import paper, plots
from megatron_mecefo.sim.cli import main
from megatron_mecefo.sim.failures import FailureTrace
from megatron_mecefo.sim.simulator import JobConfig, simulate, simulate_all, trace_for_job
from megatron_mecefo.sim.strategies import StrategyConfig

DATA = Path(__file__).parent / "data"
SMALL = ["--gpus", "4096", "--gpus-per-group", "64", "--steps", "500", "--system-mtbf-s", "600"]


@pytest.mark.timeout(60)
def test_spare_json(capsys):
    assert main(["spare", "-N", "200", "-r", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["r_star_closed"] == 8 and 1.8 < out["s_bar_closed"] <= 2.0


@pytest.mark.timeout(120)
def test_plan_recommends(capsys):
    argv = ["plan", *SMALL, "--seeds", "1", "--max-redundancy", "6", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    rec = out["recommendation"]
    ratios = [c["ttt_over_t0"] for c in out["candidates"]]
    assert rec["ttt_over_t0"] == min(ratios) >= 1.0
    assert rec["checkpoint_interval_s"] > 0 and 0 < rec["availability"] <= 1


@pytest.mark.timeout(60)
def test_simulate_plot_and_replay(tmp_path, capsys):
    png = tmp_path / "avail.png"
    argv = ["simulate", *SMALL, "--strategies", "ckpt,spare:3,mecefo:hybrid", "--plot", str(png)]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["strategy"] for r in out["results"]] == ["ckpt", "spare r=3", "mecefo hybrid"]
    assert out["plot"] == str(png) and plt_image.imread(png).shape[:2] == (480, 720)
    argv = [
        "replay",
        str(DATA / "events_example.jsonl"),
        "--gpus",
        "8",
        "--gpus-per-group",
        "1",
        "--steps",
        "100",
        "--step-time-s",
        "5",
        "--json",
    ]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["failures"] == 2


@pytest.mark.timeout(60)
def test_availability_plot_draws_the_simulated_uptime(tmp_path):
    """The plotted curve ends at the run's uptime fraction, computed here by hand, and the PNG
    decodes to the figure's size (6 x 4 in at 120 dpi) with more than a blank canvas."""
    job = JobConfig(
        num_gpus=64,
        gpus_per_group=8,
        num_steps=100,
        step_time_s=10.0,
        checkpoint_save_s=5.0,
        restart_s=100.0,
    )
    trace = FailureTrace(
        times_s=np.array([250.0]),
        groups=np.array([3]),
        repair_s=np.array([np.inf]),
        horizon_s=np.inf,
    )
    configs = [
        StrategyConfig(name="ckpt", checkpoint_interval_s=105.0),
        StrategyConfig(
            name="mecefo", takeover_policy="spread", failover_s=10.0, checkpoint_interval_s=1e9
        ),
    ]
    png = tmp_path / "avail.png"
    data = plots.plot_availability(simulate_all(job, configs, trace), png)
    # ckpt: 1185 s wall (test_sim_simulator), of which restart 100 s and 9 saves of 5 s
    assert data["ckpt"]["availability"][-1] == pytest.approx((1185 - 100 - 45) / 1185)
    # spread: 10 s failover pause; 1 + ceil(8/7)/8 = 1.25 -> 12.5 s steps for the last 75 steps
    assert data["mecefo spread"]["availability"][-1] == pytest.approx(1187.5 / 1197.5)
    img = plt_image.imread(png)
    assert img.shape[:2] == (480, 720)
    assert len(np.unique(img.reshape(-1, img.shape[-1]), axis=0)) > 10


@pytest.mark.timeout(60)
def test_reproduce_picks_the_best_simulated_r_and_states_its_failure_model(capsys):
    """`mecefo-sim reproduce` on N = 200 (r <= 4, one trace): each scheme's row is the fastest
    r simulated directly here on the same trace, gaps are ours / paper - 1, and the failure model
    decides the Rep+CKPT result: per-GPU renewal from age 0 lands within 10% of the paper's 6.07,
    one stationary cluster process (mean 5 min) lands far below it."""
    argv = ["reproduce", "--groups", "200", "--seeds", "1", "--max-redundancy", "4", "--json"]
    rows = {}
    for level in ("gpu", "system"):
        assert main([*argv, "--level", level]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["level"] == level and len(out["rows"]) == 1
        rows[level] = row = out["rows"][0]
        job = paper.paper_job(200)
        trace = trace_for_job(paper.paper_process(level), job, seed=0)
        for scheme, key in (("replication", "rep"), ("spare", "spare")):
            ratios = {
                r: simulate(
                    job, StrategyConfig(name=scheme, redundancy=r), trace, system_mtbf_s=300.0
                ).ratio
                for r in (2, 3, 4)
            }
            best = min(ratios, key=ratios.get)
            assert row[f"{key}_r"] == best and row[f"{key}_ckpt"] == pytest.approx(ratios[best])
        assert row["rep_gap"] == pytest.approx(row["rep_ckpt"] / 6.07 - 1)
        assert row["spare_gap"] == pytest.approx(row["spare_ckpt"] / 2.92 - 1)
    assert abs(rows["gpu"]["rep_gap"]) < 0.10
    assert rows["system"]["rep_gap"] < -0.25
    assert main(["reproduce", "--groups", "300"]) == ExitCode.CONFIG_ERROR
    assert "paper's table has N in" in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--strategies", "ckpt,raid5"],
        ["spare", "-N", "4", "-r", "6"],
        ["simulate", "--system-mtbf-s", "-1"],
        ["simulate", "--scenario", "/nonexistent.yaml"],
        ["frobnicate"],
        ["plan", "--gpus", "1000", "--gpus-per-group", "3"],
    ],
)
def test_user_errors_are_one_line(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    assert code == ExitCode.CONFIG_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
