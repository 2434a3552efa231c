"""Each rank's own log file (MECEFO_RANK_LOG_DIR, issue 18 item 7): a trainer's stdout and
stderr, C-level writes included, land in <dir>/rank<R>.log, appended across restarts; the agent
repeats a dead rank's last lines. A real child process is redirected."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_mecefo.metrics import rank_log

pytestmark = pytest.mark.timeout(60)

CHILD = (
    "import os, sys\n"
    "from megatron_mecefo.metrics.rank_log import redirect_rank_output\n"
    "redirect_rank_output()\n"
    "print('from python stdout', flush=True)\n"
    "os.write(2, b'from fd 2 (like NCCL)\\n')\n"
)


def _run(env):
    return subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60
    )


def test_rank_output_goes_to_its_own_file_across_restarts(tmp_path):
    env = {**os.environ, rank_log.RANK_LOG_DIR_ENV: str(tmp_path), "RANK": "3"}
    first = _run({**env, "MECEFO_INCARNATION": "0"})
    assert first.returncode == 0 and first.stdout == "" and first.stderr == "", first
    _run({**env, "MECEFO_INCARNATION": "1"})
    lines = (tmp_path / "rank3.log").read_text().splitlines()
    assert lines[0].startswith("[rank 3]") and lines[0].endswith("incarnation 0")
    assert lines[1:3] == ["from python stdout", "from fd 2 (like NCCL)"]
    assert lines[3].endswith("incarnation 1") and len(lines) == 6
    said = []
    rank_log.echo_tail(said.append, 3, lines=2, environ=env)
    assert said[0].startswith("rank 3's last lines") and said[-1] == "  | from fd 2 (like NCCL)"


def test_without_the_variable_nothing_changes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != rank_log.RANK_LOG_DIR_ENV}
    res = _run({**env, "RANK": "0"})
    assert "from python stdout" in res.stdout and "from fd 2" in res.stderr
    said = []
    rank_log.echo_tail(said.append, 0, environ=env)
    assert said == []
