"""End-to-end: the real CLI through launch/local/run.sh (failover agent and plain torchrun), and
one clear error line per kind of bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


def _train(args, timeout=240, python_flags=(), **env):
    cmd = [
        sys.executable,
        *python_flags,
        "-m",
        "megatron_mecefo.train",
        "--config",
        "configs/run/demo_cpu.yaml",
        *args,
    ]
    return subprocess.run(
        cmd, cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def demo_dir(demo_data_dir):
    return demo_data_dir


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["failover", "torchrun"])
def test_two_ranks_write_run_dir(tmp_path, demo_dir, launcher):
    run_dir = tmp_path / "run"
    cmd = [
        "bash",
        "launch/local/run.sh",
        "--config",
        "configs/run/demo_cpu.yaml",
        "--run-dir",
        str(run_dir),
        "--max-steps",
        "12",
        f"data.demo_dir={demo_dir}",
        "training.eval_interval=6",
        "training.warmup_steps=2",
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env=_env(NPROC="2", MECEFO_LAUNCHER=launcher),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "done: 12 steps" in proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(12))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
        assert all(isinstance(r[key], float) for r in rows), key
    assert [r["step"] for r in rows if "val_loss" in r] == [5, 11]
    env = json.loads((run_dir / "env.json").read_text())
    assert env["world_size"] == 2 and env["dp_size"] == 2 and env["versions"]["megatron-core"]
    assert "model:" in (run_dir / "config.yaml").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["final_val_loss"] is not None


def _assert_clean_error(proc, code, needle, run_dir):
    err_lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == code, proc.stderr[-3000:]
    assert len(err_lines) == 1 and needle in err_lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (Path(run_dir) / "summary.json").exists()
    assert not Path(run_dir).exists(), "a failed set-up left a run dir behind"


@pytest.mark.timeout(120)
def test_unknown_key(tmp_path):
    proc = _train([f"--run-dir={tmp_path / 'r'}", "training.bogus=1"])
    _assert_clean_error(proc, 2, "unknown config key 'training.bogus'", tmp_path / "r")


def _without_importtime(proc):
    """`proc` with `-X importtime`'s lines taken out of its stderr, and the modules it imported."""
    lines = proc.stderr.splitlines()
    timed = [ln for ln in lines if ln.startswith("import time:")]
    proc.stderr = "\n".join(ln for ln in lines if not ln.startswith("import time:"))
    return proc, {ln.rsplit("|", 1)[-1].strip() for ln in timed}


@pytest.mark.timeout(120)
def test_missing_data_path(tmp_path, demo_dir):
    """The data files are checked before torch and megatron are imported (4-8 s saved on a
    mistake): the process that reports it never imports torch."""
    args = [
        f"--run-dir={tmp_path / 'r'}",
        f"data.path={tmp_path / 'nope' / 'corpus'}",
        f"data.tokenizer_model={demo_dir}/tokenizer.model",
    ]
    proc, imported = _without_importtime(_train(args, python_flags=("-X", "importtime")))
    _assert_clean_error(proc, 3, "nope", tmp_path / "r")
    assert "megatron_mecefo" in imported and "torch" not in imported, sorted(imported)


@pytest.mark.timeout(120)
def test_world_not_divisible_by_tp(tmp_path):
    """The layout too is checked before torch is imported."""
    args = [f"--run-dir={tmp_path / 'r'}", "parallel.tensor_model_parallel_size=2"]
    proc, imported = _without_importtime(_train(args, python_flags=("-X", "importtime")))
    _assert_clean_error(proc, 4, "not divisible by TP x PP", tmp_path / "r")
    assert "megatron_mecefo" in imported and "torch" not in imported, sorted(imported)


@pytest.mark.timeout(120)
def test_vocab_mismatch(tmp_path, demo_dir):
    proc = _train(
        [f"--run-dir={tmp_path / 'r'}", f"data.demo_dir={demo_dir}", "model.vocab_size=64"]
    )
    _assert_clean_error(proc, 3, "vocab", tmp_path / "r")


@pytest.mark.timeout(120)
def test_corrupt_idx(tmp_path, demo_dir):
    prefix = tmp_path / "corpus"
    (tmp_path / "corpus.bin").write_bytes(b"\0" * 64)
    (tmp_path / "corpus.idx").write_bytes(b"not an index file")
    proc = _train(
        [
            f"--run-dir={tmp_path / 'r'}",
            f"data.path={prefix}",
            f"data.tokenizer_model={demo_dir}/tokenizer.model",
        ]
    )
    _assert_clean_error(proc, 3, "corpus.idx", tmp_path / "r")


@pytest.mark.timeout(180)
def test_preprocess_user_jsonl_then_train(tmp_path):
    """The documented user path: tools/preprocess_data.py on a JSONL corpus, then train on it."""
    import random

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(3, 8))) for _ in range(300)]
    with open(tmp_path / "corpus.jsonl", "w") as fh:
        for _ in range(400):
            doc = " ".join(rng.choice(words) for _ in range(rng.randint(20, 60)))
            fh.write(json.dumps({"text": doc}) + "\n")
    prefix = tmp_path / "my"
    proc = subprocess.run(
        [
            sys.executable,
            "tools/preprocess_data.py",
            "--input",
            str(tmp_path / "corpus.jsonl"),
            "--output-prefix",
            str(prefix),
            "--vocab-size",
            "128",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for suffix in (".bin", ".idx", ".model"):
        assert (tmp_path / f"my{suffix}").is_file()
    run_dir = tmp_path / "run"
    proc = _train(
        [
            f"--run-dir={run_dir}",
            "--max-steps=4",
            f"data.path={prefix}",
            f"data.tokenizer_model={prefix}.model",
            "training.eval_interval=4",
            "training.warmup_steps=1",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_val_loss"] is not None
    assert summary["entropy_floor_nats_per_token"] is None  # only the demo corpus has a floor


@pytest.mark.timeout(120)
def test_bad_injection_is_one_error_line(tmp_path):
    proc = _train([f"--run-dir={tmp_path / 'r'}", "--dry-run", "--inject", "explode:1:2"])
    _assert_clean_error(proc, 2, "expected KIND:RANK:STEP", tmp_path / "r")


@pytest.mark.timeout(120)
def test_scenario_with_a_kind_real_runs_cannot_inject(tmp_path):
    bad = tmp_path / "s.yaml"
    bad.write_text("injections:\n  - {step: 3, dp_rank: 0, kind: network}\n")
    proc = _train([f"--run-dir={tmp_path / 'r'}", "--dry-run", "--failures", str(bad)])
    _assert_clean_error(proc, 2, "cannot be injected into a real run", tmp_path / "r")


@pytest.mark.timeout(120)
def test_injection_needs_the_failover_launcher(tmp_path):
    proc = _train([f"--run-dir={tmp_path / 'r'}", "--inject", "kill:0:3"])
    _assert_clean_error(proc, 2, "need failover", tmp_path / "r")
