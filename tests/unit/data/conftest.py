"""Shared fixtures: one small demo corpus and one data bundle per test session (keeps it fast)."""

from __future__ import annotations

import pytest

from megatron_mecefo.data import DataConfig, prepare_data

SEQ_LENGTH = 32
NUM_TRAIN_SAMPLES = 300
SEED = 7


def small_demo_config(demo_dir: str, **overrides) -> DataConfig:
    """A demo corpus small enough to build in about a second."""
    kwargs = {"demo_dir": demo_dir, "demo_num_documents": 400, "demo_vocab_size": 256}
    kwargs.update(overrides)
    return DataConfig(**kwargs)


def no_barrier() -> None:
    pass


@pytest.fixture(scope="session")
def demo_cfg(tmp_path_factory) -> DataConfig:
    return small_demo_config(str(tmp_path_factory.mktemp("demo") / "demo_data"))


@pytest.fixture(scope="session")
def bundle(demo_cfg):
    return prepare_data(
        demo_cfg,
        seq_length=SEQ_LENGTH,
        num_train_samples=NUM_TRAIN_SAMPLES,
        num_valid_samples=0,
        seed=SEED,
        rank=0,
        barrier=no_barrier,
    )
