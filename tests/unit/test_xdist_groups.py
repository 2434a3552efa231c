"""The suite's xdist groups hold: tests that share a module reference run go to one worker
(`tests/helpers/xdist_groups.py`), as do tests with a static `xdist_group` (the Slurm module's
one cluster). Runs a small suite of its own on two workers, as `scripts/test.sh` runs the real
one; pytest 9.2 with pytest-xdist 3.8 ran such tests on both workers without a word."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    from tests.helpers.xdist_groups import group_shared_references

    group_shared_references(items)
"""

TESTS = """
import os, time
import pytest

def _log(kind, i):
    with open(os.environ["WHERE"], "a") as f:
        f.write(f"{kind} {i} {os.environ['PYTEST_XDIST_WORKER']}\\n")

@pytest.fixture(scope="module")
def reference():
    _log("built", 0)

@pytest.mark.parametrize("i", range(4))
def test_shared(reference, i):
    time.sleep(0.2)
    _log("shared", i)

@pytest.mark.xdist_group("cluster")
@pytest.mark.parametrize("i", range(4))
def test_static(i):
    time.sleep(0.2)
    _log("static", i)

@pytest.mark.parametrize("i", range(8))
def test_free(i):
    time.sleep(0.2)
"""


def test_grouped_tests_share_one_worker(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_groups.py").write_text(TESTS)
    where = tmp_path / "where.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"]
    proc = subprocess.run(
        [*cmd, "--dist", "loadgroup", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path,
        env={"WHERE": str(where), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line.split() for line in where.read_text().splitlines()]
    workers = {kind: {w for k, _, w in rows if k == kind} for kind in ("shared", "static")}
    assert len([r for r in rows if r[0] == "shared"]) == 4 and len(workers["shared"]) == 1, rows
    assert len([r for r in rows if r[0] == "static"]) == 4 and len(workers["static"]) == 1, rows
    assert [r for r in rows if r[0] == "built"] == [["built", "0", *workers["shared"]]], rows
