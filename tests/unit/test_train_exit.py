"""`mecefo-train` and `mecefo-coordinator` end with `proc.exit_now`: the exit code, the atexit
handlers and everything printed survive, and the interpreter's teardown (1.1 s of CPU once torch
and megatron are imported) is skipped."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

CHILD = """
import atexit
from megatron_mecefo.control.proc import exit_now
atexit.register(lambda: print("atexit ran", end=""))
print("printed before, no newline;", end="")
exit_now(5)
print("never")
"""


def test_exit_now_keeps_the_code_the_atexit_handlers_and_the_output():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=50)
    assert out.returncode == 5, out.stderr
    assert out.stdout == "printed before, no newline;atexit ran", out.stdout


def test_the_command_ends_through_it():
    import tomllib
    from pathlib import Path

    scripts = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "scripts"
    ]
    assert scripts["mecefo-train"] == "megatron_mecefo.train:cli"
    assert scripts["mecefo-coordinator"] == "megatron_mecefo.failover.authority.store_host:cli"
