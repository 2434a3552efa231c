#!/bin/bash
# Launch mecefo-train on this machine with failover (default) or under plain torchrun.
#   NPROC=4 bash launch/local/run.sh --config configs/run/demo_cpu.yaml [--inject kill:2:10:5] [key=value ...]
# All arguments go to mecefo-train. The config (and any --inject/--failures) is validated in one
# process first, so a user mistake gives one clear error line instead of one per rank.
# Restart model: with MECEFO_LAUNCHER=failover (default) mecefo-launch starts the coordinator and
# the ranks; a dead rank is restarted by the agent and rejoins from a live peer, survivors never
# stop. With MECEFO_LAUNCHER=torchrun, a rank death ends the job (exit codes: launch/README.md).
set -euo pipefail

NPROC="${NPROC:-2}"
PYTHON="${PYTHON:-python}"
MECEFO_OMP_THREADS="${MECEFO_OMP_THREADS:-1}"
MECEFO_LAUNCHER="${MECEFO_LAUNCHER:-failover}"

"${PYTHON}" -m megatron_mecefo.train --dry-run "$@" > /dev/null

export OMP_NUM_THREADS="${MECEFO_OMP_THREADS}"
case "${MECEFO_LAUNCHER}" in
  failover)
    launch_args=(--nproc-per-node "${NPROC}")
    exec "${PYTHON}" -m megatron_mecefo.failover.agent "${launch_args[@]}" -- "$@"
    ;;
  torchrun)
    torchrun_args=(--standalone --nnodes 1 --nproc-per-node "${NPROC}")
    exec "${PYTHON}" -m torch.distributed.run "${torchrun_args[@]}" -m megatron_mecefo.train "$@"
    ;;
  *)
    echo "error: MECEFO_LAUNCHER must be failover or torchrun, got '${MECEFO_LAUNCHER}'" >&2
    exit 2
    ;;
esac
