#!/bin/bash
# One Slurm task = one node of a pretrain.sbatch job: run this node's `mecefo-launch` agent and
# record its exit code in NODE_DIR/node<I>.exit for the batch script (srun alone only reports
# the highest code) and its process id in NODE_DIR/node<I>.pid.
#   srun ... bash launch/slurm/node.sh NODE_DIR PYTHON [mecefo-launch flags] -- <mecefo-train args>
# The node index is the task index (SLURM_PROCID of SLURM_NTASKS), not SLURM_NODEID, so that
# several tasks on one machine act as several nodes (the CI's one-node Slurm does that).
# Spare nodes: the last MECEFO_SPARE_NODES tasks (validated and exported by pretrain.sbatch) run
# the agent with --standby; every agent gets --nnodes = the working nodes (tasks - spares).
# Signals: Slurm delivers a signal for the step (srun forwarding USR1, scancel) to every process
# of the task, the agent included, so this shell only keeps waiting for it (never forwards).
set -euo pipefail

node_dir="$1"
python="$2"
shift 2

working_nodes=$((${SLURM_NTASKS:?not inside a Slurm step} - ${MECEFO_SPARE_NODES:-0}))
role=()
if [ "${SLURM_PROCID:?not inside a Slurm step}" -ge "${working_nodes}" ]; then
  role=(--standby) # a spare node: no rank until the coordinator gives it a lost node's
fi
agent_cmd=(
  "${python}" -m megatron_mecefo.failover.node.agent_cli
  --nnodes "${working_nodes}"
  --node-rank "${SLURM_PROCID}"
  "${role[@]}"
  "$@"
)
echo "[node ${SLURM_PROCID}/${SLURM_NTASKS}] $(hostname) job ${SLURM_JOB_ID:-?}: ${agent_cmd[*]}"

# The agent starts with SIGUSR1 ignored until it installs its own handler (a stop request that
# lands during its start-up must not kill it); TERM keeps its default.
trap 'echo "[node ${SLURM_PROCID}] got SIGUSR1 (the agent got it too)"' USR1
trap 'echo "[node ${SLURM_PROCID}] got SIGTERM (the agent got it too)"' TERM
(
  trap '' USR1
  exec "${agent_cmd[@]}"
) &
agent_pid=$!
mkdir -p "${node_dir}"
echo "${agent_pid}" > "${node_dir}/node${SLURM_PROCID}.pid"
# `wait` also returns (>128) when a trapped signal arrives: keep waiting while the agent lives,
# then read its status (bash keeps it, so the last `wait` returns the agent's own code).
while kill -0 "${agent_pid}" 2> /dev/null; do
  wait "${agent_pid}" || true
done
rc=0
wait "${agent_pid}" || rc=$?
echo "${rc}" > "${node_dir}/node${SLURM_PROCID}.exit"
echo "[node ${SLURM_PROCID}] agent exited ${rc}"
exit "${rc}"
