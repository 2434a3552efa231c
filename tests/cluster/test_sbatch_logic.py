"""Parts of launch/slurm/pretrain.sbatch checked without Slurm: the stop lead time computed from
the step and checkpoint-save times measured in a job's logs, and the exported cluster timeout
profile equal to `megatron_mecefo.config.timeouts.PROFILES["cluster"]` (the NCCL block is
checked against `failover.trainer.groups.NCCL_POLICY` in tests/unit/failover/test_groups.py). The
whole script runs against a real Slurm in test_slurm.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from megatron_mecefo.config import timeouts

pytestmark = pytest.mark.timeout(60)

SBATCH = Path(__file__).resolve().parents[2] / "launch" / "slurm" / "pretrain.sbatch"


def _function(name: str) -> str:
    text = SBATCH.read_text()
    found = re.search(rf"^{name}\(\) \{{\n.*?^\}}\n", text, re.S | re.M)
    assert found, f"{name}() not found in pretrain.sbatch"
    return found.group(0)


def _lead_time(log_dir: Path, minimum: int = 120, margin: int = 30) -> int:
    script = (
        f"set -euo pipefail\nMECEFO_STOP_LEAD_MIN_S={minimum}\nMECEFO_STOP_MARGIN_S={margin}\n"
        f"{_function('lead_time_s')}\nlead_time_s {log_dir}\n"
    )
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return int(res.stdout)


def test_lead_time_follows_the_measured_save_and_step_times(tmp_path):
    assert _lead_time(tmp_path) == 120  # nothing measured yet: the minimum
    (tmp_path / "try0").mkdir()
    (tmp_path / "try0" / "rank0.log").write_text(
        "step   1000 | loss 2.1 | lr 1e-4 | gnorm 0.5 | 15210.0 ms/iter | 1000 tok/s | degraded 0\n"
        "[checkpoint] rank 0: checkpoint step_00001000 committed (95.5 s)\n"
        "step   1010 | loss 2.0 | lr 1e-4 | gnorm 0.5 | 15890.4 ms/iter | 1000 tok/s | degraded 0\n"
    )
    (tmp_path / "try1").mkdir()  # a requeued try measured a slower save
    (tmp_path / "try1" / "rank0.log").write_text(
        "[checkpoint] rank 0: checkpoint step_00002000 committed (140.0 s, pruned step_1)\n"
    )
    # 2 x 140 s (slowest save) + 2 x 15.89 s (slowest recent step) + 30 s margin, rounded up
    assert _lead_time(tmp_path) == 342
    assert _lead_time(tmp_path, minimum=600) == 600


def test_sbatch_exports_the_cluster_timeout_profile():
    text = SBATCH.read_text()
    block = text[text.index('if [ "${MECEFO_TIMEOUT_PROFILE}" = cluster ]; then') :]
    block = block[: block.index("\nfi\n")]
    exported = dict(re.findall(r'export (MECEFO_[A-Z_]+)="\$\{\1:-([^}]*)\}"', block))
    assert exported == timeouts.PROFILES["cluster"]


def test_profile_exports_keep_values_already_set():
    lines = timeouts.exports("cluster")
    res = subprocess.run(
        ["bash", "-c", f'MECEFO_GRACE_S=7\n{lines}echo "$MECEFO_GRACE_S $MECEFO_AGENT_TIMEOUT_S"'],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.stdout.split() == ["7", timeouts.PROFILES["cluster"]["MECEFO_AGENT_TIMEOUT_S"]]
    assert timeouts.exports("local") == ""
    with pytest.raises(KeyError):
        timeouts.exports("nope")
