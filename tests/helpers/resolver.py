"""pip resolver dry runs for the install tests: a fresh venv of a given Python, a pip environment
that ignores this machine's pip configuration (its local wheels, local indexes and torch cap), and
a bounded `pip install --dry-run --report`. The public index is needed; callers skip with one
message when it is unreachable or the Python they need is missing."""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
from pathlib import Path


def find_python(version: str) -> str | None:
    """An interpreter for `version` ("3.12"): on PATH, or one pyenv installed."""
    found = shutil.which(f"python{version}")
    candidates = [found] if found else []
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates += sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"))
    for cand in candidates:
        try:
            out = subprocess.run(
                [cand, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == version:
            return cand
    return None


def pypi_reachable(timeout_s: float = 5.0) -> str | None:
    """None when pypi.org answers on 443, else why not."""
    try:
        with socket.create_connection(("pypi.org", 443), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"pypi.org:443 unreachable ({exc})"


def clean_pip_env() -> dict[str, str]:
    """This process's environment without any pip settings: no config files (PIP_CONFIG_FILE=
    /dev/null: pip then reads none), no PIP_* variables (find-links to local wheels, constraints),
    so the resolver sees only the public index, as a fresh machine would."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
        PIP_DEFAULT_TIMEOUT="60",
    )
    for cert in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        if cert not in env and Path("/etc/ssl/certs/ca-certificates.crt").is_file():
            env["PIP_CERT"] = "/etc/ssl/certs/ca-certificates.crt"
    return env


def make_venv(python: str, path: Path) -> Path:
    """A fresh venv at `path` (with its bundled pip); returns its interpreter."""
    subprocess.run([python, "-m", "venv", str(path)], check=True, timeout=120)
    return path / "bin" / "python"


def site_packages(venv_python: Path) -> Path:
    out = subprocess.run(
        [str(venv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return Path(out.stdout.strip())


def fake_installed(venv_python: Path, packages: dict[str, str]) -> None:
    """Register `name -> version` as installed in the venv (a dist-info with METADATA only): the
    resolver then treats them as an image's preinstalled packages."""
    root = site_packages(venv_python)
    for name, version in packages.items():
        folder = root / f"{name.replace('-', '_')}-{version}.dist-info"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        (folder / "INSTALLER").write_text("fake\n")
        (folder / "RECORD").write_text("")


def dry_run(
    cmd: list[str], *, cwd: Path, report: Path, timeout_s: float
) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run a `pip install --dry-run --report REPORT ...` command; (process, report or None)."""
    proc = subprocess.run(
        cmd, cwd=cwd, env=clean_pip_env(), capture_output=True, text=True, timeout=timeout_s
    )
    data = json.loads(report.read_text()) if report.is_file() else None
    return proc, data


def installs(report: dict) -> dict[str, str]:
    """Normalised name -> version of what a `--report` would install."""
    out = {}
    for item in report.get("install", []):
        meta = item["metadata"]
        out[meta["name"].lower().replace("_", "-")] = meta["version"]
    return out
