"""The one-process precheck as a new user meets it (issue 32, items 9, 11, 12): the README's
"Training" commands on a machine where `scripts/demo.sh` already ran, the rerun of a run that was
interrupted before it saved anything, and a run directory no folder can be created in. In one
process (`precheck.main`, `train.main --dry-run`), in a working directory of the test's own: the
checkout's `runs/` is never read or written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_mecefo import precheck, train
from megatron_mecefo.config.batch import dp_size
from megatron_mecefo.config.loader import load_config
from megatron_mecefo.config.run import RunConfig
from megatron_mecefo.errors import ExitCode
from megatron_mecefo.training import identity
from tests.helpers.readme import readme_commands

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
DEMO = "configs/run/demo_cpu.yaml"


def _finished_run(run_dir: Path, world: int, *overrides: str, steps: int | None = None) -> None:
    """What a run of `DEMO` leaves in `run_dir`: identity, metrics and, if it finished
    (`steps` given), the summary saying it trained that many steps."""
    cfg = load_config(RunConfig, ROOT / DEMO, [f"run_dir={run_dir}", *overrides])
    run_dir.mkdir(parents=True)
    ident = identity.StateIdentity.fresh(identity.config_hash(cfg, dp_size(cfg, world)))
    identity.write_file(run_dir, ident)
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "loss": 6.25}\n')
    if steps is not None:
        summary = {"start_step": 0, "steps": steps, "stopped_at": None}
        (run_dir / "summary.json").write_text(json.dumps(summary))


def _precheck(world: int, *args: str) -> int:
    return precheck.main(["--world-size", str(world), "--", *args])


def test_the_readme_training_commands_do_what_they_say_after_the_demo(
    tmp_path, monkeypatch, capsys
):
    """`bash scripts/demo.sh` left a finished run in the config's run_dir (`runs/demo_cpu`, 1000
    steps, 2 ranks). Every README training command then starts its own run: none is refused as
    "already holds a run", none is "already complete" (exit 10)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(ROOT / "configs")  # the README's relative paths
    _finished_run(tmp_path / "runs" / "demo_cpu", 2, steps=1000)
    assert _precheck(2, "--config", DEMO, "overwrite=true") == ExitCode.OK  # demo.sh's own
    assert _precheck(2, "--config", DEMO) == precheck.COMPLETE  # the demo did finish
    commands = readme_commands("Training")
    assert len(commands) >= 5, commands
    run_dirs = set()
    for env, argv in commands:
        capsys.readouterr()
        if argv[0].endswith("mecefo-train"):
            world, args = 1, argv[1:]
        else:
            assert argv[:2] == ["bash", "launch/local/run.sh"], argv
            world, args = int(env.get("NPROC", 2)), argv[2:]
        assert "--run-dir" in args, f"{argv}: a run of its own, not the demo's"
        run_dirs.add(args[args.index("--run-dir") + 1])
        if "--dry-run" in args:
            monkeypatch.delenv("WORLD_SIZE", raising=False)
            code = train.main(args)
        else:
            code = _precheck(world, *args)
        out = capsys.readouterr()
        assert code == ExitCode.OK, (argv, out.out[-500:], out.err)
    assert len(run_dirs) == len(commands) and "runs/demo_cpu" not in run_dirs, run_dirs


def test_a_run_interrupted_before_it_saved_anything_is_rerun_by_the_same_command(tmp_path, capsys):
    """Metrics and identity, no summary and nothing saved: the same command (same config, same
    DP size) starts it over. Anything else stays refused, with the line naming the fix."""
    run_dir = tmp_path / "run"
    _finished_run(run_dir, 2)
    same = ["--config", str(ROOT / DEMO), "--run-dir", str(run_dir)]
    assert _precheck(2, *same) == ExitCode.OK
    assert precheck.interrupted_rerun(
        load_config(RunConfig, ROOT / DEMO, [f"run_dir={run_dir}"]), 2
    )
    capsys.readouterr()
    for world, extra in ((2, ["training.lr=0.001"]), (4, [])):  # another trajectory
        assert _precheck(world, *same, *extra) == ExitCode.CONFIG_ERROR
        err = capsys.readouterr().err
        assert "already holds a run" in err and "overwrite=true" in err, err
    (run_dir / "summary.json").write_text('{"start_step": 0, "steps": 3, "stopped_at": 3}')
    assert _precheck(2, *same) == ExitCode.CONFIG_ERROR  # a run that ended: not replaced
    (run_dir / "summary.json").unlink()
    folder = run_dir / "checkpoints" / "step_00000010"
    folder.mkdir(parents=True)
    (folder / "commit.json").write_text("{}")
    never = [*same, "checkpoint.resume=never"]
    assert _precheck(2, *never) == ExitCode.CONFIG_ERROR  # saved state is never started over


def test_a_run_dir_no_folder_can_be_created_in_is_one_line(tmp_path, capsys):
    """`/proc/x`: writable to root by `os.access`, yet nothing can be created there."""
    code = _precheck(2, "--config", str(ROOT / DEMO), "--run-dir", "/proc/mecefo-x")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == ExitCode.CONFIG_ERROR and len(err) == 1, err
    assert err[0].startswith("error: run_dir /proc/mecefo-x") and "not writable" in err[0]
    assert _precheck(2, "--config", str(ROOT / DEMO), "--run-dir", str(tmp_path / "a" / "b")) == 0
    assert not (tmp_path / "a").exists() and list(tmp_path.iterdir()) == []  # nothing left


def test_a_layout_that_does_not_divide_is_exit_4(capsys, tmp_path):
    """launch/README.md: a world size not divisible by TP x PP is DISTRIBUTED_ERROR (4)."""
    args = ["--config", str(ROOT / DEMO), "--run-dir", str(tmp_path / "r")]
    code = _precheck(4, *args, "parallel.tensor_model_parallel_size=3")
    err = capsys.readouterr().err
    assert code == ExitCode.DISTRIBUTED_ERROR == 4 and "not divisible by TP x PP" in err, err
