#!/bin/bash
# Create .venv (if missing) and install megatron-mecefo with its pinned dependencies.
#   bash scripts/install.sh            # runtime + dev (tests) extras
# torch==2.13.0 is installed FIRST and pinned: any looser torch pulls a multi-GB CUDA build.
# Re-running is cheap: the install is skipped while pyproject.toml is unchanged.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${MECEFO_VENV:-.venv}"
EXTRAS="${MECEFO_EXTRAS:-dev}"

if [ ! -x "${VENV}/bin/python" ]; then
  echo "[install] creating ${VENV} with $(${PYTHON} --version)"
  "${PYTHON}" -m venv "${VENV}"
fi
stamp="${VENV}/.mecefo-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)-${EXTRAS}"
if [ -f "${stamp}" ] && [ "$(cat "${stamp}")" = "${want}" ]; then
  echo "[install] up to date (${VENV})"
  exit 0
fi
pip_args=(--disable-pip-version-check --quiet)
echo "[install] torch==2.13.0 (CPU wheel where available)"
"${VENV}/bin/python" -m pip install "${pip_args[@]}" "torch==2.13.0"
echo "[install] megatron-mecefo[${EXTRAS}] and pinned dependencies"
"${VENV}/bin/python" -m pip install "${pip_args[@]}" -e ".[${EXTRAS}]"
echo "${want}" > "${stamp}"
echo "[install] done"
