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


SHARED_REFERENCES = ("failure_free", "reference", "rejoin_after_e0", "single", "straight")
"""Module-scoped fixtures that train a reference run (10-20 s each in CI). Under pytest-xdist a
module fixture is built once per worker that runs one of its tests: the clean-clone CI built
six of them twice (about 65 s of work). The tests of a module that use one of them share an
`xdist_group`, so one worker runs them all and builds it once."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        used = sorted(
            name for name in SHARED_REFERENCES if name in defs and defs[name][-1].scope == "module"
        )
        if used and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}::{used[0]}"))
