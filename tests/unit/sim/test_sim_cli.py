"""`mecefo-sim` subcommands: JSON output, plots, and one-line errors with CONFIG_ERROR."""

import json
from pathlib import Path

import pytest

from megatron_mecefo.errors import ExitCode
from megatron_mecefo.sim.cli import main

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
    assert png.stat().st_size > 1000
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
