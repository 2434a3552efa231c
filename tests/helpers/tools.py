"""External tools a test needs (etcd, Slurm, hadolint, Python 3.12): without one a test skips with
one line on a developer's machine, and fails under `CI=true`, where a missing tool would otherwise
drop a proof without anyone noticing. Every such test goes through `need_tool` / `tool_missing` or
the `needs_tool` mark (checked before the test runs, `tests/conftest.py`)."""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest

MARK = "needs_tool"
"""`@pytest.mark.needs_tool("etcd", "bash scripts/install_etcd.sh")`: `need_tool` before the
test runs."""


def in_ci() -> bool:
    """`CI=true` (any case, or `1`), as GitHub Actions, GitLab and most runners set it."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def tool_missing(name: str, how: str) -> NoReturn:
    """This test cannot run without `name` (`how`: how to get it): fail under CI, else skip."""
    message = f"{name} missing: {how}"
    if in_ci():
        pytest.fail(f"{message} (CI=true: a missing tool fails the test)", pytrace=False)
    pytest.skip(message)


def need_tool(name: str, how: str) -> str:
    """The path of executable `name` on PATH, or `tool_missing`."""
    path = shutil.which(name)
    if path is None:
        tool_missing(name, how)
    return path


def needs_tool(name: str, how: str) -> pytest.MarkDecorator:
    """A mark (test, class, module or `pytest.param`) for a test that needs `name` on PATH."""
    return getattr(pytest.mark, MARK)(name, how)


def check_marks(item: pytest.Item) -> None:
    """`pytest_runtest_setup`: every `needs_tool` mark on `item` is satisfied, else skip/fail."""
    for mark in item.iter_markers(MARK):
        need_tool(*mark.args, **mark.kwargs)
