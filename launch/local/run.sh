#!/bin/bash
# Launch mecefo-train on this machine with failover (default) or under plain torchrun.
#   NPROC=4 bash launch/local/run.sh --config configs/run/demo_cpu.yaml [--inject kill:2:10:5] [key=value ...]
# All arguments go to mecefo-train. Everything that can be known before start-up (config, layout,
# run directory, data files, injections) is checked in one process first
# (`python -m megatron_mecefo.precheck`), so a mistake gives one error line and a non-zero exit
# instead of one per rank; a run that is already complete gives one line and exit 0.
# Restart model: with MECEFO_LAUNCHER=failover (default) mecefo-launch starts the coordinator and
# the ranks; a dead rank is restarted by the agent and rejoins from a live peer, survivors never
# stop; a deterministic error (exit 2, 3, 4, 5) ends the job. With MECEFO_LAUNCHER=torchrun, a
# rank death ends the job (exit codes: launch/README.md). Exit 0 means the job trained to its
# last step.
# Store: MECEFO_STORE=etcd runs the job on etcd (MECEFO_ETCD_ENDPOINTS, or 3 local members started
# here; no node is special: launch/README.md); the default tcp store lives on the head node.
# Simulated nodes: NNODES=2 NSPARE=1 NPROC=2 runs 2 working nodes of 2 ranks (one mecefo-launch
# each) and 1 standby node on this machine; a lost node's ranks move to the standby. The agents
# die with this script (even on SIGKILL); its exit code is 0 when the job trained to its last
# step (the run's summary.json, written by this launch, says so: `python -m
# megatron_mecefo.job_outcome`), whichever agent was killed; else the head node's, or, when the
# head's agent was killed by a signal, the first other node's failure.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
default_python=python3
if [ -x "${here}/.venv/bin/python" ]; then default_python="${here}/.venv/bin/python"; fi
NPROC="${NPROC:-2}"
NNODES="${NNODES:-1}"
NSPARE="${NSPARE:-0}"
PYTHON="${PYTHON:-${default_python}}"
MECEFO_OMP_THREADS="${MECEFO_OMP_THREADS:-1}"
MECEFO_LAUNCHER="${MECEFO_LAUNCHER:-failover}"
MECEFO_STORE="${MECEFO_STORE:-tcp}"

fail() {
  echo "error: $1" >&2
  exit 2
}
whole() { [[ "$2" =~ ^[0-9]+$ ]] && [ "$2" -ge "$3" ] || fail "$1 must be a whole number >= $3, got '$2'"; }
whole NPROC "${NPROC}" 1
whole NNODES "${NNODES}" 1
whole NSPARE "${NSPARE}" 0
whole MECEFO_OMP_THREADS "${MECEFO_OMP_THREADS}" 1
case "${MECEFO_LAUNCHER}" in
  failover | torchrun) ;;
  *) fail "MECEFO_LAUNCHER must be failover or torchrun, got '${MECEFO_LAUNCHER}'" ;;
esac
case "${MECEFO_STORE}" in
  tcp | etcd) export MECEFO_STORE ;;
  *) fail "MECEFO_STORE must be tcp or etcd, got '${MECEFO_STORE}'" ;;
esac
if [ "${MECEFO_LAUNCHER}" = torchrun ] && [ $((NNODES + NSPARE)) -gt 1 ]; then
  fail "NNODES and NSPARE simulate failover nodes: use them with MECEFO_LAUNCHER=failover"
fi
if ! "${PYTHON}" -c 'import megatron_mecefo' 2> /dev/null; then
  fail "${PYTHON} cannot import megatron_mecefo: run 'bash scripts/install.sh' first, or set PYTHON to the interpreter that has it"
fi

precheck_rc=0
"${PYTHON}" -m megatron_mecefo.precheck --world-size "$((NNODES * NPROC))" --nodes "${NNODES}" \
  -- "$@" || precheck_rc=$?
case "${precheck_rc}" in
  0) ;;
  10) exit 0 ;; # already complete: the precheck said so in one line
  *) exit "${precheck_rc}" ;;
esac

export OMP_NUM_THREADS="${MECEFO_OMP_THREADS}"
case "${MECEFO_LAUNCHER}" in
  failover)
    launch_args=(--nproc-per-node "${NPROC}")
    if [ "${NNODES}" -eq 1 ] && [ "${NSPARE}" -eq 0 ]; then
      exec "${PYTHON}" -m megatron_mecefo.failover.node.agent_cli "${launch_args[@]}" -- "$@"
    fi
    pids=()
    launch_start="$(date +%s)" # a summary.json older than this is an earlier launch's
    export MECEFO_DIE_WITH_PARENT=1 # the agents die with this script, even on SIGKILL
    if [ "${MECEFO_STORE}" = etcd ]; then
      # every simulated node is an agent of one etcd job: the site's cluster, or 3 local members
      if [ -z "${MECEFO_ETCD_ENDPOINTS:-}" ]; then
        etcd_dir="$(mktemp -d -t mecefo-etcd-XXXXXX)"
        "${PYTHON}" -m megatron_mecefo.control.etcd_cluster --data-dir "${etcd_dir}" \
          --endpoints-file "${etcd_dir}/endpoints" &
        etcd_pid=$!
        trap 'kill -TERM "${etcd_pid}" 2> /dev/null || true; rm -rf "${etcd_dir}"' EXIT
        for ((t = 0; t < 300; t++)); do
          [ -s "${etcd_dir}/endpoints" ] && break
          kill -0 "${etcd_pid}" 2> /dev/null || fail "the local etcd cluster did not start"
          sleep 0.1
        done
        [ -s "${etcd_dir}/endpoints" ] || fail "the local etcd cluster did not start within 30 s"
        MECEFO_ETCD_ENDPOINTS="$(cat "${etcd_dir}/endpoints")"
        export MECEFO_ETCD_ENDPOINTS
      fi
      export MECEFO_JOB_ID="${MECEFO_JOB_ID:-local-$$-$(date +%s)}"
      node_args=(--nnodes "${NNODES}" --store etcd)
      head_args=("${node_args[@]}")
    else
      port="$("${PYTHON}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
      node_args=(--nnodes "${NNODES}" --coordinator "127.0.0.1:${port}")
      head_args=(--nnodes "${NNODES}" --coordinator-port "${port}")
    fi
    "${PYTHON}" -m megatron_mecefo.failover.node.agent_cli "${launch_args[@]}" "${head_args[@]}" \
      --node-rank 0 -- "$@" &
    pids+=($!)
    for ((i = 1; i < NNODES + NSPARE; i++)); do
      role=()
      if [ "${i}" -ge "${NNODES}" ]; then role=(--standby); fi
      "${PYTHON}" -m megatron_mecefo.failover.node.agent_cli "${launch_args[@]}" "${node_args[@]}" \
        --node-rank "${i}" "${role[@]}" -- "$@" &
      pids+=($!)
    done
    trap 'kill -TERM "${pids[@]}" 2> /dev/null || true' TERM
    trap 'kill -INT "${pids[@]}" 2> /dev/null || true' INT # Ctrl-C: each agent stops, exit 130
    trap 'kill -USR1 "${pids[@]}" 2> /dev/null || true' USR1
    codes=()
    for pid in "${pids[@]}"; do
      rc=0
      wait "${pid}" || rc=$?
      while kill -0 "${pid}" 2> /dev/null; do # a trapped signal ended the wait, not the agent
        rc=0
        wait "${pid}" || rc=$?
      done
      codes+=("${rc}")
    done
    rc="${codes[0]}" # the job's outcome is the head node's...
    if [ "${rc}" -gt 128 ]; then # ...unless its agent was killed: then the others say why
      for other in "${codes[@]:1}"; do
        if [ "${other}" -ne 0 ] && [ "${other}" -le 128 ]; then
          rc="${other}"
          break
        fi
      done
    fi
    # exit 0 means trained to the last step: what the job wrote decides, not which agent died
    if [ "${rc}" -ne 0 ] && "${PYTHON}" -m megatron_mecefo.job_outcome --since "${launch_start}" \
      --codes "${codes[*]}" -- "$@"; then
      rc=0
    fi
    exit "${rc}"
    ;;
  torchrun)
    torchrun_args=(--standalone --nnodes 1 --nproc-per-node "${NPROC}")
    exec "${PYTHON}" -m torch.distributed.run "${torchrun_args[@]}" -m megatron_mecefo.train "$@"
    ;;
esac
