"""Bad input: a one-line DataError/ConfigError that says what to do, and no partial output."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mecefo.config.loader import from_dict
from megatron_mecefo.data import DataConfig, check_vocab, prepare_data
from megatron_mecefo.data.demo import DemoCorpus
from megatron_mecefo.data.preprocess import preprocess
from megatron_mecefo.errors import ConfigError, DataError, ExitCode

from .conftest import no_barrier

ROOT = Path(__file__).resolve().parents[3]


def _prepare(cfg: DataConfig, seq_length: int = 32):
    return prepare_data(
        cfg,
        seq_length=seq_length,
        num_train_samples=10,
        num_valid_samples=0,
        seed=0,
        rank=0,
        barrier=no_barrier,
    )


@pytest.fixture
def user_data(tmp_path, demo_cfg, bundle):
    """A copy of the demo .bin/.idx/.model as if a user had preprocessed it."""
    corpus = DemoCorpus(demo_cfg.demo_dir, {})
    for suffix in (".bin", ".idx"):
        shutil.copy(corpus.prefix + suffix, tmp_path / f"corpus{suffix}")
    shutil.copy(corpus.tokenizer_model, tmp_path / "corpus.model")
    return DataConfig(path=str(tmp_path / "corpus"), tokenizer_model=str(tmp_path / "corpus.model"))


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_user_data_loads(user_data):
    b = _prepare(user_data)
    assert len(b.train) >= 10 and b.entropy_floor_nats_per_token is None


def test_missing_data_path(tmp_path):
    cfg = DataConfig(path=str(tmp_path / "nope"), tokenizer_model=str(tmp_path / "t.model"))
    with pytest.raises(DataError) as exc:
        _prepare(cfg)
    assert "data file not found" in _one_line(exc) and "preprocess_data.py" in str(exc.value)


def test_missing_tokenizer_model(user_data, tmp_path):
    cfg = DataConfig(path=user_data.path, tokenizer_model=str(tmp_path / "missing.model"))
    with pytest.raises(DataError) as exc:
        _prepare(cfg)
    assert "tokenizer model not found" in _one_line(exc)


def test_not_a_tokenizer_model(user_data):
    Path(user_data.tokenizer_model).write_bytes(b"this is not a protobuf")
    with pytest.raises(DataError) as exc:
        _prepare(user_data)
    assert "cannot read tokenizer model" in _one_line(exc)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b[: len(b) - 8], "truncated"),
        (lambda b: b[:20], "shorter than the 34-byte header"),
        (lambda b: b"XXIDIDX\x00\x00" + b[9:], "wrong magic"),
        (lambda b: b[:17] + bytes([99]) + b[18:], "unknown token dtype code 99"),
    ],
)
def test_corrupt_idx(user_data, damage, message):
    idx = Path(user_data.path + ".idx")
    idx.write_bytes(damage(idx.read_bytes()))
    with pytest.raises(DataError) as exc:
        _prepare(user_data)
    msg = _one_line(exc)
    assert msg.startswith(f"corrupt index file {idx}") and message in msg
    assert "re-run tools/preprocess_data.py" in msg


def test_bin_does_not_match_idx(user_data):
    data = Path(user_data.path + ".bin")
    data.write_bytes(data.read_bytes()[:-2])
    with pytest.raises(DataError) as exc:
        _prepare(user_data)
    assert "does not belong together or was truncated" in _one_line(exc)


def test_data_made_with_a_bigger_tokenizer(user_data, tmp_path):
    small = tmp_path / "small"
    (tmp_path / "t.txt").write_text("\n".join(f"ab ba abba {i}" for i in range(200)))
    preprocess([str(tmp_path / "t.txt")], str(small), vocab_size=24)
    cfg = DataConfig(path=user_data.path, tokenizer_model=str(small) + ".model")
    with pytest.raises(DataError) as exc:
        _prepare(cfg)
    assert "different tokenizer" in _one_line(exc)


def test_check_vocab():
    check_vocab(512, 512)
    check_vocab(500, 512)
    with pytest.raises(DataError) as exc:
        check_vocab(513, 512)
    msg = _one_line(exc)
    assert "513" in msg and "512" in msg and "640" in msg  # 513 rounded up to a multiple of 128


def test_split_too_small_for_one_sample(tmp_path):
    (tmp_path / "few.txt").write_text("\n".join(f"doc {i} is short" for i in range(20)))
    res = preprocess([str(tmp_path / "few.txt")], str(tmp_path / "few"), vocab_size=24)
    cfg = DataConfig(path=res.output_prefix, tokenizer_model=res.tokenizer_model)
    with pytest.raises(DataError) as exc:
        _prepare(cfg, seq_length=64)
    assert "split" in _one_line(exc) and "fewer than one sample" in str(exc.value)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"path": "data/x"}, "tokenizer_model is required"),
        ({"tokenizer_model": "t.model"}, "only used with path"),
        ({"path": "data/x.bin", "tokenizer_model": "t"}, "drop the '.bin' suffix"),
        ({"split": "98"}, "must look like"),
        ({"split": "100,0"}, "positive train and validation"),
        ({"demo_vocab_size": 10}, "demo_vocab_size"),
        ({"splitt": "98,2"}, "unknown config key"),
    ],
)
def test_config_errors(data, message):
    with pytest.raises(ConfigError) as exc:
        from_dict(DataConfig, data, prefix="data.")
    assert message in _one_line(exc)


def test_bad_jsonl_leaves_no_output(tmp_path):
    good = [json.dumps({"text": f"document {i} text"}) for i in range(50)]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(good[:30] + ["{not json"] + good[30:]) + "\n")
    prefix = tmp_path / "out"
    with pytest.raises(DataError) as exc:
        preprocess([str(src)], str(prefix), vocab_size=32)
    assert f"{src}:31: invalid JSON" in _one_line(exc)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]

    src.write_text("\n".join(good[:10] + [json.dumps({"body": "x"})]) + "\n")
    with pytest.raises(DataError) as exc:
        preprocess([str(src)], str(prefix), vocab_size=32)
    assert "no key 'text'" in _one_line(exc) and "--json-key" in str(exc.value)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_failed_rerun_removes_stale_outputs(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(f"line {i} of text" for i in range(100)))
    preprocess([str(src)], str(tmp_path / "out"), vocab_size=32)
    with pytest.raises(DataError):  # vocabulary far too large for this corpus
        preprocess([str(src)], str(tmp_path / "out"), vocab_size=5000)
    # The old .idx/.model are gone, so no pair of old data and a new tokenizer looks valid.
    assert not (tmp_path / "out.idx").exists() and not (tmp_path / "out.model").exists()
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]


def _load_tool():
    spec = importlib.util.spec_from_file_location(
        "preprocess_tool", ROOT / "tools/preprocess_data.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cli_prints_one_error_line_and_exit_code(tmp_path, capsys):
    tool = _load_tool()
    rc = tool.main(
        ["--input", str(tmp_path / "missing.txt"), "--output-prefix", str(tmp_path / "o")]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == ExitCode.DATA_ERROR and len(err) == 1 and err[0].startswith("error: input file")
    rc = tool.main([])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == ExitCode.CONFIG_ERROR and len(err) == 1 and "nothing to do" in err[0]


def test_cli_demo_corpus_and_help(tmp_path, capsys):
    tool = _load_tool()
    txt, prefix = tmp_path / "demo.txt", tmp_path / "demo"
    rc = tool.main(
        [
            "--make-demo-corpus",
            str(txt),
            "--demo-num-documents",
            "60",
            "--output-prefix",
            str(prefix),
            "--vocab-size",
            "128",
            "--quiet",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "nats/word" in out and f"data.path={prefix}" in out
    assert len(txt.read_text().splitlines()) == 60
    assert all((tmp_path / f"demo{s}").is_file() for s in (".bin", ".idx", ".model"))
    with pytest.raises(SystemExit) as exc:
        tool.main(["--help"])
    assert exc.value.code == 0
    assert "--json-key" in capsys.readouterr().out


def test_data_package_does_not_import_megatron():
    code = (
        "import sys, megatron_mecefo.data as d; "
        "assert not [m for m in sys.modules if m.startswith('megatron.')], 'megatron imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
