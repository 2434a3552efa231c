#!/bin/bash
# Install, then run the CPU demo: the tiny model on the embedded synthetic corpus, 2 ranks (gloo).
#   bash scripts/demo.sh [key=value ...]        (NPROC=4 bash scripts/demo.sh for 4 ranks)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PYTHON="${PWD}/.venv/bin/python"
NPROC="${NPROC:-2}" bash launch/local/run.sh --config configs/run/demo_cpu.yaml overwrite=true "$@"
