"""Strict config loading: every shipped file loads; bad keys/values are one-line ConfigErrors."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import pytest

from megatron_mecefo.config.loader import from_dict, load_config, to_dict
from megatron_mecefo.config.run import RunConfig
from megatron_mecefo.errors import ConfigError
from megatron_mecefo.mcore.config import ModelConfig

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


@pytest.mark.parametrize("path", sorted((CONFIGS / "model").glob("*.yaml")), ids=lambda p: p.name)
def test_every_model_config_loads(path):
    cfg = load_config(ModelConfig, path)
    assert cfg.hidden_size % cfg.num_attention_heads == 0
    assert cfg.num_parameters() > 0


@pytest.mark.parametrize("path", sorted((CONFIGS / "run").glob("*.yaml")), ids=lambda p: p.name)
def test_every_run_config_loads(path):
    cfg = load_config(RunConfig, path)
    assert isinstance(cfg.model, ModelConfig)
    assert cfg.model.name != "custom"  # run files name a model preset


def test_paper_shapes():
    for name, shape in {
        "llama-350m": (1024, 2736, 24, 16),
        "llama-1b": (2048, 5461, 24, 32),
        "llama-7b": (4096, 11008, 32, 32),
    }.items():
        m = load_config(ModelConfig, CONFIGS / "model" / f"{name}.yaml")
        assert (m.hidden_size, m.ffn_hidden_size, m.num_layers, m.num_attention_heads) == shape
        assert m.vocab_size == 32000


def test_unknown_key_names_key_and_allowed(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("training:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError) as exc:
        load_config(RunConfig, f, config_root=CONFIGS)
    msg = str(exc.value)
    assert "training.lrr" in msg and "lr" in msg and "\n" not in msg


def test_bad_literal_lists_allowed_values():
    with pytest.raises(
        ConfigError, match=r"mecefo.takeover_policy: 'ring' is not allowed .*'neighbor'"
    ):
        load_config(RunConfig, CONFIGS / "run" / "demo_cpu.yaml", ["mecefo.takeover_policy=ring"])


def test_bad_type_and_cross_field_check():
    with pytest.raises(ConfigError, match="training.max_steps: expected an integer"):
        load_config(RunConfig, CONFIGS / "run" / "demo_cpu.yaml", ["training.max_steps=abc"])
    with pytest.raises(ConfigError, match="divisible by num_attention_heads"):
        load_config(RunConfig, CONFIGS / "run" / "demo_cpu.yaml", ["model.num_attention_heads=5"])
    with pytest.raises(ConfigError, match=r"num_layers \(2\) does not split over 4 pipeline"):
        load_config(
            RunConfig,
            CONFIGS / "run" / "demo_cpu.yaml",
            ["parallel.pipeline_model_parallel_size=4"],
        )
    with pytest.raises(ConfigError, match="interleaved schedule\\) is not supported"):
        load_config(
            RunConfig,
            CONFIGS / "run" / "demo_cpu.yaml",
            ["parallel.virtual_pipeline_model_parallel_size=2"],
        )


def test_overrides_preset_and_nested_merge():
    cfg = load_config(
        RunConfig,
        CONFIGS / "run" / "demo_cpu.yaml",
        ["model=llama-350m", "training.lr=1e-3", "model.num_layers=3"],
    )
    assert cfg.model.name == "llama-350m" and cfg.model.num_layers == 3
    assert cfg.model.hidden_size == 1024 and cfg.training.lr == 1e-3
    cfg2 = load_config(RunConfig, CONFIGS / "run" / "demo_cpu.yaml", ["model.num_layers=3"])
    assert cfg2.model.name == "tiny" and cfg2.model.num_layers == 3  # preset kept, one key changed


def test_unknown_preset_lists_available():
    with pytest.raises(ConfigError, match="available presets: .*tiny"):
        load_config(RunConfig, CONFIGS / "run" / "demo_cpu.yaml", ["model=nope"])


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="key=value"):
        load_config(RunConfig, CONFIGS / "run" / "demo_cpu.yaml", ["training.lr"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(RunConfig, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(RunConfig, bad)


def test_round_trip_to_dict():
    cfg = load_config(RunConfig, CONFIGS / "run" / "demo_cpu.yaml")
    again = from_dict(RunConfig, to_dict(cfg))
    assert again == cfg


def test_generic_types():
    @dataclasses.dataclass(kw_only=True)
    class C:
        a: list[int] = dataclasses.field(default_factory=list)
        b: dict[str, float] = dataclasses.field(default_factory=dict)
        c: int | None = None
        d: Literal["x", "y"] = "x"
        e: bool = False

    c = from_dict(C, {"a": [1, 2], "b": {"k": 1}, "c": None, "d": "y", "e": True})
    assert c.a == [1, 2] and c.b == {"k": 1.0} and c.d == "y" and c.e is True
    with pytest.raises(ConfigError, match=r"a\[1\]: expected an integer"):
        from_dict(C, {"a": [1, "z"]})
    with pytest.raises(ConfigError, match="e: expected true or false"):
        from_dict(C, {"e": "yes"})
