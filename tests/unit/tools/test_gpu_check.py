"""`tools/gpu/check.sh` / `check.py` without a GPU: the dry mode plans every part within the
9-minute budget and writes the JSON the device run writes; a missing wheels folder is reported; a
bad argument is one error line and exit 2; a part that outlives its bound is killed with its
whole process group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.gpu import check, parts

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(120)

PART_NAMES = ["gpu_health", "step_time", "degraded", "kernels", "recovery", "largest_preset"]
ENV_KEYS = {"python", "gpu_name", "driver", "torch", "cuda", "triton", "megatron_core", "wheels"}
PART_KEYS = {"name", "status", "seconds", "bound_s", "reason", "commands", "result"}


def _run(args: list[str], tmp_path: Path, wrapper: bool = False, **env) -> tuple:
    """(exit code, stdout, stderr) of check.py (or check.sh) with a hard timeout."""
    cmd = ["bash", str(ROOT / "tools/gpu/check.sh")] if wrapper else [sys.executable]
    cmd += [] if wrapper else [str(ROOT / "tools/gpu/check.py")]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MECEFO_GPU_")}
    environ.pop("OUT", None)
    environ |= {"PYTHON": sys.executable, "MECEFO_GPU_SITE": str(tmp_path / "site"), **env}
    res = subprocess.run(cmd + args, capture_output=True, text=True, timeout=60, env=environ)
    return res.returncode, res.stdout, res.stderr


def _doc(out: Path) -> dict:
    return json.loads((out / "gpu_check.json").read_text())


def test_dry_run_plans_every_part_within_the_budget(tmp_path):
    out = tmp_path / "out"
    rc, stdout, stderr = _run(["--dry-run", "--out", str(out), "--wheels", "nowhere"], tmp_path)
    assert rc == 0, stderr
    doc = _doc(out)
    assert doc["mode"] == "dry-run" and doc["schema"] == check.SCHEMA
    assert [p["name"] for p in doc["parts"]] == PART_NAMES
    for p in doc["parts"]:
        assert PART_KEYS <= p.keys() and p["bound_s"] > 0
        assert p["status"] == "planned", p["reason"]  # scripts there, every flag known to them
        assert p["commands"] and all(str(out / "parts") in c for c in p["commands"])
        assert f"[gpu-check] {p['name']}: planned (bound {p['bound_s']} s)" in stdout
    bounds = sum(p["bound_s"] for p in doc["parts"]) + parts.INSTALL_BOUND_S + parts.ENV_BOUND_S
    assert doc["total_bound_s"] == bounds <= 540
    env = doc["environment"]
    assert ENV_KEYS <= env.keys() and env["install"]["status"] == "planned"
    assert env["wheels"] | {"dir": None} == {
        "dir": None,
        "present": False,
        "files": [],
        "mib": 0,
        "under_64_mib": True,
        "megatron_core_wheel": None,
    }
    assert "wheels: absent in" in stdout
    table = (out / "gpu_check.md").read_text()
    assert all(f"| {name} | planned |" in table for name in PART_NAMES)


def test_the_wheels_folder_is_inspected(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    name = "megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl"
    (wheels / name).write_bytes(b"0" * 2048)
    out = tmp_path / "out"
    rc, _, stderr = _run(
        ["--out", str(out)], tmp_path, MECEFO_GPU_DRY="1", MECEFO_GPU_WHEELS=str(wheels)
    )
    assert rc == 0, stderr
    w = _doc(out)["environment"]["wheels"]
    assert w["present"] and w["files"] == [name] and w["megatron_core_wheel"] == name


@pytest.mark.parametrize(
    "args", [["--bogus"], ["--budget", "9999"], ["--only", "nothing"], ["--budget", "x"]]
)
@pytest.mark.parametrize("wrapper", [False, True], ids=["check.py", "check.sh"])
def test_a_bad_argument_is_one_error_line_and_exit_2(tmp_path, args, wrapper):
    rc, stdout, stderr = _run([*args, "--dry-run", "--out", str(tmp_path)], tmp_path, wrapper)
    assert rc == 2
    assert stderr.startswith("error: ") and stderr.count("\n") == 1 and "Traceback" not in stderr
    assert not (tmp_path / "gpu_check.json").exists() and "[gpu-check]" not in stdout


def test_the_wrapper_passes_arguments_and_the_dry_switch_through(tmp_path):
    out = tmp_path / "out"
    wheels = tmp_path / "none"
    rc, stdout, stderr = _run(
        ["--out", str(out), "--only", "kernels", "--wheels", str(wheels)],
        tmp_path,
        wrapper=True,
        MECEFO_GPU_DRY="1",
    )
    assert rc == 0, stderr
    doc = _doc(out)
    assert doc["mode"] == "dry-run" and [p["name"] for p in doc["parts"]] == ["kernels"]
    assert doc["environment"]["wheels"]["dir"] == str(wheels)
    assert not (tmp_path / "site").exists()  # nothing installed in the dry mode


def test_a_plan_with_a_flag_its_script_lacks_is_skipped():
    part = parts.Part("p", "t", 5, (), (("", ("tools/bench/kernels.py", "--no-such")),), str)
    rec = check.plan_part(part, {"status": "planned"})
    assert rec == {"status": "skipped", "reason": "tools/bench/kernels.py has no --no-such"}


def test_a_part_past_its_bound_is_killed_with_its_group(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen(['sleep', '120']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)"
    )
    t0 = time.monotonic()
    entry = check.run_one(
        [sys.executable, "-c", code, "--out", str(tmp_path / "x.json")], 3, tmp_path / "x.log"
    )
    assert time.monotonic() - t0 < 30
    assert entry["status"] == "skipped" and entry["reason"].startswith("timed out after 3 s")
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:  # init reaps the orphan
        time.sleep(0.1)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
