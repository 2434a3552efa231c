"""Shared pytest set-up: repo root importable (spawned workers import test modules by name), and
Triton's CPU interpreter switched on for the whole session when there is no GPU.

`triton.jit` fixes compiled-vs-interpreted when a kernel (including triton's own standard-library
helpers) is decorated; megatron-core imports triton early, so the variable must be set before any
test module is imported. `backend="auto"` never sends CPU tensors to Triton, so this only affects
the kernel tests that ask for the interpreter explicitly.
"""

import os
import sys
from pathlib import Path

if not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


import pytest  # noqa: E402

import megatron_mecefo.mcore  # noqa: E402, F401 - before any test module imports megatron-core


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


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_tool(name, how): skipped without it; CI=true fails")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test marked `needs_tool` skips (or, under CI=true, fails) before its fixtures start."""
    from tests.helpers.tools import check_marks

    check_marks(item)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    from tests.helpers.xdist_groups import group_shared_references

    group_shared_references(items)
