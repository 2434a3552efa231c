"""`tools/memory_table.py` (docs/memory.md): the table and JSON come from the library's arithmetic
for the configs named, at the world size their names give; bad input is one error line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_mecefo.config.loader import load_config
from megatron_mecefo.config.run import RunConfig
from megatron_mecefo.errors import ExitCode
from megatron_mecefo.sim.layout import memory_per_gpu
from tools.memory_table import main

pytestmark = pytest.mark.timeout(60)
RUN = Path(__file__).resolve().parents[3] / "configs" / "run"


def test_the_table_is_the_library_arithmetic(tmp_path, capsys):
    out = tmp_path / "memory.json"
    paths = [RUN / "llama-70b-128n.yaml", RUN / "llama-405b-2048n.yaml"]
    assert main([*map(str, paths), f"{paths[0]}:2048", "--json", str(out)]) == ExitCode.OK
    rows = json.loads(out.read_text())["rows"]
    for r, path, world in zip(rows, [*paths, paths[0]], [1024, 16384, 2048], strict=True):
        mem = memory_per_gpu(load_config(RunConfig, path), world)
        gb = r["gb_per_gpu"]
        assert (r["world_size"], r["dp"], r["parameters_per_gpu"]) == (
            world,
            mem.dp,
            mem.parameters_per_gpu,
        )
        assert gb["total R=2"] == round(mem.total(mem.optimizer_sharded(2)) / 1e9, 2)
        assert gb["total replicated"] == pytest.approx(
            gb["weights"] + gb["grads"] + gb["opt replicated"], abs=0.011
        )
    assert rows[2]["gb_per_gpu"]["opt sharded R=1"] < rows[0]["gb_per_gpu"]["opt sharded R=1"]
    text = capsys.readouterr().out
    assert "| llama-70b-128n.yaml | 1024 (8 x 4 x 32) |" in text


def test_a_name_without_a_node_count_is_one_error_line(capsys):
    assert main([str(RUN / "demo_cpu.yaml")]) == ExitCode.CONFIG_ERROR
    err = capsys.readouterr().err.strip()
    assert "PATH:WORLD" in err and "\n" not in err
