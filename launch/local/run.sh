#!/bin/bash
# Launch mecefo-train on this machine under torchrun.
#   NPROC=2 bash launch/local/run.sh --config configs/run/demo_cpu.yaml [key=value ...]
# All arguments go to mecefo-train. The config is validated in one process first, so a user mistake
# gives one clear error line instead of one per rank. Restart model: none (a failed run exits with
# the code documented in launch/README.md).
set -euo pipefail

NPROC="${NPROC:-2}"
PYTHON="${PYTHON:-python}"
MECEFO_OMP_THREADS="${MECEFO_OMP_THREADS:-1}"

"${PYTHON}" -m megatron_mecefo.train --dry-run "$@" > /dev/null

torchrun_args=(--standalone --nnodes 1 --nproc-per-node "${NPROC}")
export OMP_NUM_THREADS="${MECEFO_OMP_THREADS}"
exec "${PYTHON}" -m torch.distributed.run "${torchrun_args[@]}" -m megatron_mecefo.train "$@"
