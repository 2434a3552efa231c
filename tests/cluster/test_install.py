"""Installability (issue 18): pyproject.toml declares ranges (no torch pin, no exact pins, Python
3.12 allowed, a Transformer Engine extra); the CI's exact versions live in .ci/constraints.txt and
lie inside those ranges; scripts/install.sh installs the CPU torch first and everything else under
the constraints; and a fresh Python 3.12 on Linux, with none of this machine's local wheels or pip
settings, resolves `pip install -e '.[gpu,dev]'` from the public index (a resolver dry run: only
metadata is fetched). The dry run skips with one message where Python 3.12 or PyPI is missing
(a missing Python 3.12 fails under CI=true: `tests/helpers/tools.py`)."""

from __future__ import annotations

import os
import stat
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.helpers import resolver
from tests.helpers.tools import tool_missing

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CONSTRAINTS = ROOT / ".ci" / "constraints.txt"


def _requirements() -> list[Requirement]:
    reqs = [Requirement(r) for r in PROJECT["dependencies"]]
    for extra in PROJECT["optional-dependencies"].values():
        reqs += [Requirement(r) for r in extra]
    return reqs


def _pins() -> dict[str, Version]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[req.name.lower()] = Version(spec.version)
    return pins


def test_metadata_declares_ranges_not_pins():
    assert SpecifierSet(PROJECT["requires-python"]).contains("3.12")  # NGC images ship 3.12
    assert SpecifierSet(PROJECT["requires-python"]).contains("3.11")
    for req in _requirements():
        ops = {s.operator for s in req.specifier}
        assert not ops & {"==", "==="}, f"exact pin in package metadata: {req}"
    torch = [r for r in _requirements() if r.name == "torch"]
    assert torch and all(s.operator == ">=" for r in torch for s in r.specifier), torch
    extras = PROJECT["optional-dependencies"]
    assert {"dev", "gpu", "te"} <= set(extras), extras
    (te,) = [Requirement(r) for r in extras["te"]]
    assert te.name == "transformer-engine" and te.extras == {"pytorch"}, te
    assert te.specifier.contains("2.10.0") and not te.specifier.contains("2.12.0"), te


def test_ci_constraints_pin_cpu_torch_inside_the_ranges():
    pins = _pins()
    assert pins["torch"] == Version("2.13.0"), pins  # the CPU wheel CI tests
    for req in _requirements():
        name = req.name.lower()
        if name in pins:
            assert req.specifier.contains(pins[name], prereleases=True), (req, pins[name])
    missing = {r.name.lower() for r in _requirements()} - set(pins) - {"transformer-engine"}
    assert not missing, f"CI does not pin {sorted(missing)}"


def _fake_venv(tmp_path: Path, cuda: bool) -> tuple[Path, Path]:
    """A venv whose `python` only records its arguments (and answers the CUDA-build check)."""
    venv, calls = tmp_path / "venv", tmp_path / "calls.txt"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "python"
    fake.write_text(
        "#!/bin/bash\n"
        f'echo "$*" >> {calls}\n'
        'case " $* " in *" -c "*) exit ' + ("1" if cuda else "0") + ";; esac\n"
        "exit 0\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return venv, calls


def _install(venv: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MECEFO_VENV": str(venv), "MECEFO_EXTRAS": "dev"}
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "install.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_install_script_puts_cpu_torch_first_then_everything_under_constraints(tmp_path):
    venv, calls = _fake_venv(tmp_path, cuda=False)
    res = _install(venv)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = calls.read_text().splitlines()
    installs = [ln for ln in lines if ln.startswith("-m pip install")]
    assert len(installs) == 2, lines
    torch_step, package_step = installs
    assert torch_step.endswith("torch==2.13.0"), torch_step
    assert "--index-url" not in torch_step, torch_step  # default: pip's sources (local wheel)
    assert lines.index(torch_step) < lines.index(package_step)
    assert f"--constraint {CONSTRAINTS.relative_to(ROOT)}" in package_step, package_step
    assert package_step.endswith("-e .[dev]"), package_step
    assert (venv / ".mecefo-installed").is_file()
    again = _install(venv)  # unchanged pyproject + constraints: nothing to do
    assert "up to date" in again.stdout and len(calls.read_text().splitlines()) == len(lines)


def test_install_script_takes_a_torch_index_when_asked(tmp_path):
    venv, calls = _fake_venv(tmp_path, cuda=False)
    env = {**os.environ, "MECEFO_VENV": str(venv), "MECEFO_TORCH_INDEX": "https://example/cpu"}
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    torch_step = [ln for ln in calls.read_text().splitlines() if "torch==" in ln][0]
    assert "--index-url https://example/cpu" in torch_step, torch_step


def test_install_script_refuses_a_cuda_torch(tmp_path):
    venv, calls = _fake_venv(tmp_path, cuda=True)
    res = _install(venv)
    assert res.returncode == 1 and "CUDA build of torch" in res.stderr, res.stdout + res.stderr
    assert not [ln for ln in calls.read_text().splitlines() if "-e .[dev]" in ln]
    assert not (venv / ".mecefo-installed").exists()


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_fresh_python312_resolves_gpu_and_dev_extras(tmp_path):
    """`pip install -e '.[gpu,dev]'` on a fresh Python 3.12 venv, this machine's pip settings and
    local wheels ignored: the resolver finds a consistent set on the public index (Linux: a CUDA
    torch and the triton it needs, megatron-core 0.16)."""
    python = resolver.find_python("3.12")
    if python is None:
        tool_missing("Python 3.12", "the resolver dry run needs it (PATH or pyenv)")
    why = resolver.pypi_reachable()
    if why:
        pytest.skip(f"resolver dry run skipped: {why}")
    venv_python = resolver.make_venv(python, tmp_path / "py312")
    report = tmp_path / "report.json"
    cmd = [str(venv_python), "-m", "pip", "install", "--dry-run", "--ignore-installed"]
    cmd += ["--report", str(report), "-e", ".[gpu,dev]"]
    proc, data = resolver.dry_run(cmd, cwd=ROOT, report=report, timeout_s=420)
    assert proc.returncode == 0 and data is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = resolver.installs(data)
    assert Version(got["megatron-core"]).release[:2] == (0, 16), got
    assert "torch" in got and "triton" in got and "megatron-mecefo" in got, got
    assert data["environment"]["python_version"].startswith("3.12"), data["environment"]
