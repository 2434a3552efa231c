#!/bin/bash
# Create .venv (if missing) and install megatron-mecefo for CPU development and CI.
#   bash scripts/install.sh            # runtime + dev (tests) + peers (torchft: test_peers) extras
#   MECEFO_EXTRAS=dev,tensorboard bash scripts/install.sh
# pyproject.toml declares ranges only. The exact versions CI tests are in .ci/constraints.txt:
#   1. torch (its pin in the constraints file) is installed FIRST, then checked to be a CPU build
#      (PyPI's Linux torch is the CUDA build: gigabytes of CUDA packages). By default pip's own
#      sources are used: on the project's machines a local CPU wheel in pip's find-links matches
#      the pin. Elsewhere set MECEFO_TORCH_INDEX=https://download.pytorch.org/whl/cpu;
#   2. the package and its extras under `pip -c .ci/constraints.txt`, so nothing replaces torch.
# On a GPU machine do not use this script: install into the environment that has the site's (or
# the NGC image's) torch with `pip install -e '.[gpu]'` (README.md, "GPU quick start").
# Re-running is cheap: the install is skipped while pyproject.toml and the constraints are unchanged.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${MECEFO_VENV:-.venv}"
EXTRAS="${MECEFO_EXTRAS:-dev,peers}"
CONSTRAINTS="${MECEFO_CONSTRAINTS:-.ci/constraints.txt}"
MECEFO_TORCH_INDEX="${MECEFO_TORCH_INDEX:-}"  # empty: pip's configured index and find-links

torch_pin="$(grep -E '^torch==' "${CONSTRAINTS}" || true)"
if [ -z "${torch_pin}" ]; then
  echo "[install] error: ${CONSTRAINTS} has no torch==VERSION line" >&2
  exit 2
fi
if [ ! -x "${VENV}/bin/python" ]; then
  echo "[install] creating ${VENV} with $(${PYTHON} --version)"
  "${PYTHON}" -m venv "${VENV}"
fi
stamp="${VENV}/.mecefo-installed"
want="$(cat pyproject.toml "${CONSTRAINTS}" | sha256sum | cut -d' ' -f1)-${EXTRAS}"
if [ -f "${stamp}" ] && [ "$(cat "${stamp}")" = "${want}" ]; then
  echo "[install] up to date (${VENV})"
  exit 0
fi
pip_args=(--disable-pip-version-check --quiet --quiet) # errors only; MECEFO_VERBOSE=1: all
if [ "${MECEFO_VERBOSE:-0}" = 1 ]; then pip_args=(--disable-pip-version-check); fi
torch_source=()
if [ -n "${MECEFO_TORCH_INDEX}" ]; then
  torch_source=(--index-url "${MECEFO_TORCH_INDEX}" --extra-index-url https://pypi.org/simple)
fi
echo "[install] ${torch_pin} (CPU build, from ${MECEFO_TORCH_INDEX:-the configured index and find-links})"
"${VENV}/bin/python" -m pip install "${pip_args[@]}" "${torch_source[@]}" "${torch_pin}"
# -W ignore: torch warns that numpy is missing (it is installed in the next step)
if ! "${VENV}/bin/python" -W ignore -c 'import sys, torch; sys.exit(torch.version.cuda is not None)'; then
  echo "[install] error: a CUDA build of torch is installed in ${VENV}; CI wants the CPU one" >&2
  exit 1
fi
echo "[install] megatron-mecefo[${EXTRAS}] under ${CONSTRAINTS}"
"${VENV}/bin/python" -m pip install "${pip_args[@]}" --constraint "${CONSTRAINTS}" -e ".[${EXTRAS}]"
echo "${want}" > "${stamp}"
echo "[install] done"
