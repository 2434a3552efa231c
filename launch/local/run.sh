#!/bin/bash
# Launch mecefo-train on this machine with failover (default) or under plain torchrun.
#   NPROC=4 bash launch/local/run.sh --config configs/run/demo_cpu.yaml [--inject kill:2:10:5] [key=value ...]
# All arguments go to mecefo-train. The config (and any --inject/--failures) is validated in one
# process first, so a user mistake gives one clear error line instead of one per rank.
# Restart model: with MECEFO_LAUNCHER=failover (default) mecefo-launch starts the coordinator and
# the ranks; a dead rank is restarted by the agent and rejoins from a live peer, survivors never
# stop. With MECEFO_LAUNCHER=torchrun, a rank death ends the job (exit codes: launch/README.md).
# Simulated nodes: NNODES=2 NSPARE=1 NPROC=2 runs 2 working nodes of 2 ranks (one mecefo-launch
# each) and 1 standby node on this machine; a lost node's ranks move to the standby.
set -euo pipefail

NPROC="${NPROC:-2}"
NNODES="${NNODES:-1}"
NSPARE="${NSPARE:-0}"
PYTHON="${PYTHON:-python}"
MECEFO_OMP_THREADS="${MECEFO_OMP_THREADS:-1}"
MECEFO_LAUNCHER="${MECEFO_LAUNCHER:-failover}"

MECEFO_DRY_RUN_WORLD="$((NNODES * NPROC))" "${PYTHON}" -m megatron_mecefo.train --dry-run "$@" \
  > /dev/null

export OMP_NUM_THREADS="${MECEFO_OMP_THREADS}"
case "${MECEFO_LAUNCHER}" in
  failover)
    launch_args=(--nproc-per-node "${NPROC}")
    if [ "${NNODES}" -eq 1 ] && [ "${NSPARE}" -eq 0 ]; then
      exec "${PYTHON}" -m megatron_mecefo.failover.node.agent_cli "${launch_args[@]}" -- "$@"
    fi
    port="$("${PYTHON}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    node_args=(--nnodes "${NNODES}" --coordinator "127.0.0.1:${port}")
    pids=()
    "${PYTHON}" -m megatron_mecefo.failover.node.agent_cli "${launch_args[@]}" --nnodes "${NNODES}" \
      --node-rank 0 --coordinator-port "${port}" -- "$@" &
    pids+=($!)
    for ((i = 1; i < NNODES + NSPARE; i++)); do
      role=()
      if [ "${i}" -ge "${NNODES}" ]; then role=(--standby); fi
      "${PYTHON}" -m megatron_mecefo.failover.node.agent_cli "${launch_args[@]}" "${node_args[@]}" \
        --node-rank "${i}" "${role[@]}" -- "$@" &
      pids+=($!)
    done
    trap 'kill -TERM "${pids[@]}" 2> /dev/null || true' TERM INT
    trap 'kill -USR1 "${pids[@]}" 2> /dev/null || true' USR1
    rc=0
    wait "${pids[0]}" || rc=$?  # the job's outcome is the head node's
    for pid in "${pids[@]:1}"; do wait "${pid}" || true; done
    exit "${rc}"
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
