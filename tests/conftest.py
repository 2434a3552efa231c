"""Shared pytest set-up: repo root importable (spawned workers import test modules by name)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def demo_data_dir(tmp_path_factory):
    """The embedded demo corpus, generated once per test session (shared by dist/e2e tests)."""
    from megatron_mecefo.data.config import DataConfig
    from megatron_mecefo.data.demo import ensure_demo_corpus

    cfg = DataConfig()
    path = str(tmp_path_factory.mktemp("session") / "demo_data")
    ensure_demo_corpus(
        path,
        num_documents=cfg.demo_num_documents,
        seed=cfg.demo_seed,
        vocab_size=cfg.demo_vocab_size,
    )
    return path
