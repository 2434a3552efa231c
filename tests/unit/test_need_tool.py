"""tests/helpers/tools.py: a test that needs a missing external tool skips on a developer's machine
and fails under CI=true, whether it asks in its body (`need_tool`) or by mark (`needs_tool`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import tools

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
MISSING = "mecefo-no-such-tool"


def _outcome(fn, *args) -> tuple[str, str]:
    """("skip" | "fail" | "ok", message): caught here, so a wrong skip fails this test."""
    try:
        fn(*args)
    except pytest.skip.Exception as exc:
        return "skip", str(exc)
    except pytest.fail.Exception as exc:
        return "fail", str(exc)
    return "ok", ""


@pytest.mark.parametrize("ci", ["", "0", "false"])
def test_a_missing_tool_skips_outside_ci(monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    assert _outcome(tools.need_tool, MISSING, "apt-get it") == (
        "skip",
        f"{MISSING} missing: apt-get it",
    )


@pytest.mark.parametrize("ci", ["true", "True", "1"])
def test_a_missing_tool_fails_under_ci(monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    kind, message = _outcome(tools.need_tool, MISSING, "apt-get it")
    assert kind == "fail" and message.startswith(f"{MISSING} missing: apt-get it"), message
    assert "CI=true" in message
    assert _outcome(tools.tool_missing, "Slurm", "not root")[0] == "fail"


def test_a_present_tool_is_found_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert tools.need_tool("sh", "any shell") == shutil.which("sh")


def _run_marked(tmp_path: Path, ci: str | None) -> str:
    """A test file marked with a missing and a present tool, run by pytest with this conftest."""
    test = tmp_path / "test_marked.py"
    test.write_text(
        "from tests.helpers.tools import needs_tool\n\n"
        f"@needs_tool({MISSING!r}, 'apt-get it')\n"
        "def test_missing():\n    pass\n\n"
        "@needs_tool('sh', 'any shell')\n"
        "def test_present():\n    pass\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest"]
    cmd += ["--rootdir", str(tmp_path), "-c", "/dev/null", str(test)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=50)
    return res.stdout.strip().splitlines()[-1]


def test_the_mark_skips_outside_ci_and_fails_under_it(tmp_path):
    assert _run_marked(tmp_path, None).startswith("1 passed, 1 skipped")
    summary = _run_marked(tmp_path, "true")
    assert summary.startswith("1 passed, 1 error"), summary  # fails in set-up, before fixtures
