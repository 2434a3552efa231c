#!/bin/bash
# A real one-node Slurm cluster on localhost for the cluster tests (Debian's slurm-wlm + munge).
#   bash tests/cluster/slurm_local.sh install          # apt-get the packages (root, network; ~10 s)
#   bash tests/cluster/slurm_local.sh start DIR        # munged + slurmctld + slurmd, all state in DIR
#   bash tests/cluster/slurm_local.sh stop DIR         # stop the daemons started by `start DIR`
# `start` generates a fresh munge key, picks free ports (or SLURMCTLD_PORT / SLURMD_PORT), writes
# DIR/slurm.conf (one node named after this host, MECEFO_SLURM_CPUS CPUs declared, default 8;
# proctrack/linuxproc and task/none so no cgroups are needed; jobcomp/filetxt records every job's
# end state in DIR/jobcomp.txt since there is no slurmdbd) and waits until `sinfo` shows the node
# idle. Clients then need `SLURM_CONF=DIR/slurm.conf` (the munge socket is named in it).
# Exit codes: 0 ok; 3 Slurm cannot be set up here (message on stderr says why); 1 anything else.
set -euo pipefail

MECEFO_SLURM_CPUS="${MECEFO_SLURM_CPUS:-8}"
MECEFO_SLURM_START_TIMEOUT_S="${MECEFO_SLURM_START_TIMEOUT_S:-60}"
SLURM_BINARIES=(munged slurmctld slurmd sbatch scontrol sinfo squeue scancel)

cant() {
  echo "slurm_local: cannot run Slurm here: $*" >&2
  exit 3
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

have_binaries() {
  local bin
  for bin in "${SLURM_BINARIES[@]}"; do
    PATH="${PATH}:/usr/sbin:/sbin" command -v "${bin}" > /dev/null || return 1
  done
}

cmd_install() {
  if have_binaries; then
    echo "slurm_local: slurm and munge already installed"
    return 0
  fi
  [ "$(id -u)" -eq 0 ] || cant "slurm-wlm/munge are not installed and installing them needs root"
  command -v apt-get > /dev/null || cant "slurm-wlm/munge are not installed and there is no apt-get"
  local apt_args=(-y -qq --no-install-recommends -o Dpkg::Use-Pty=0)
  export DEBIAN_FRONTEND=noninteractive
  # policy-rc.d already denies service starts in containers; the daemons are started by `start`.
  if ! { apt-get update -qq && apt-get install "${apt_args[@]}" slurmctld slurmd slurm-client munge; } \
    > /tmp/slurm_local_apt.log 2>&1; then
    tail -5 /tmp/slurm_local_apt.log >&2
    cant "apt-get install slurmctld slurmd slurm-client munge failed (no network?), log above"
  fi
  have_binaries || cant "packages installed but binaries missing"
}

write_conf() {
  local dir="$1" host="$2" ctld_port="$3" slurmd_port="$4"
  cat > "${dir}/slurm.conf" << EOF
# One-node test cluster written by tests/cluster/slurm_local.sh.
ClusterName=mecefo-ci
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=${ctld_port}
SlurmdPort=${slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also delays a requeued job's restart (default 120 s).
AuthInfo=socket=${dir}/munge/munge.socket,cred_expire=5
StateSaveLocation=${dir}/state
SlurmdSpoolDir=${dir}/spool
SlurmctldPidFile=${dir}/run/slurmctld.pid
SlurmdPidFile=${dir}/run/slurmd.pid
SlurmctldLogFile=${dir}/log/slurmctld.log
SlurmdLogFile=${dir}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
# a requeued job becomes eligible after cred_expire; the main scheduling loop then picks it up.
SchedulerParameters=sched_interval=1
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=${dir}/jobcomp.txt
MpiDefault=none
# Like many sites: srun kills a step when one task fails unless --kill-on-bad-exit=0 is given.
KillOnBadExit=1
MailProg=/bin/true
ReturnToService=2
KillWait=10
MinJobAge=3600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName=${host} NodeAddr=127.0.0.1 CPUs=${MECEFO_SLURM_CPUS} RealMemory=4000 State=UNKNOWN
PartitionName=ci Nodes=${host} Default=YES MaxTime=INFINITE State=UP
EOF
}

cmd_start() {
  local dir="$1"
  have_binaries || cant "slurm-wlm/munge are not installed (run: $0 install)"
  [ "$(id -u)" -eq 0 ] || cant "the test cluster runs its daemons as root (SlurmUser=root)"
  export PATH="${PATH}:/usr/sbin:/sbin"
  mkdir -p "${dir}"/{munge,state,spool,run,log}
  chmod 700 "${dir}" "${dir}/munge"
  dir="$(cd "${dir}" && pwd)"
  local host ctld_port slurmd_port
  host="$(hostname -s)"
  ctld_port="${SLURMCTLD_PORT:-$(free_port)}"
  slurmd_port="${SLURMD_PORT:-$(free_port)}"
  while [ "${slurmd_port}" = "${ctld_port}" ]; do slurmd_port="$(free_port)"; done
  write_conf "${dir}" "${host}" "${ctld_port}" "${slurmd_port}"
  export SLURM_CONF="${dir}/slurm.conf"

  dd if=/dev/urandom of="${dir}/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "${dir}/munge/munge.key"
  local munge_args=(
    --force
    --key-file="${dir}/munge/munge.key"
    --socket="${dir}/munge/munge.socket"
    --pid-file="${dir}/munge/munged.pid"
    --seed-file="${dir}/munge/munged.seed"
    --log-file="${dir}/log/munged.log"
  )
  munged "${munge_args[@]}" || cant "munged did not start ($(tail -2 "${dir}/log/munged.log" 2> /dev/null))"
  # -D: foreground (our own pid files, nothing forks away); -i: ignore stale state.
  setsid slurmctld -D -i -f "${SLURM_CONF}" > "${dir}/log/slurmctld.out" 2>&1 &
  echo $! > "${dir}/run/slurmctld.daemon"
  setsid slurmd -D -f "${SLURM_CONF}" > "${dir}/log/slurmd.out" 2>&1 &
  echo $! > "${dir}/run/slurmd.daemon"

  local deadline=$((SECONDS + MECEFO_SLURM_START_TIMEOUT_S)) state=""
  while [ "${SECONDS}" -lt "${deadline}" ]; do
    state="$(sinfo -h -n "${host}" -o '%T' 2> /dev/null || true)"
    if [ "${state}" = "idle" ]; then
      echo "slurm_local: node ${host} idle (slurmctld :${ctld_port}, slurmd :${slurmd_port})"
      echo "SLURM_CONF=${SLURM_CONF}"
      return 0
    fi
    sleep 0.5
  done
  echo "slurm_local: node not idle after ${MECEFO_SLURM_START_TIMEOUT_S} s (state '${state}')" >&2
  tail -n 20 "${dir}"/log/*.log "${dir}"/log/*.out >&2 || true
  cmd_stop "${dir}"
  exit 1
}

stop_pid_file() {
  local file="$1" pid
  [ -f "${file}" ] || return 0
  pid="$(cat "${file}")"
  if kill -0 "${pid}" 2> /dev/null; then
    kill -TERM "${pid}" 2> /dev/null || true
    for _ in $(seq 50); do
      kill -0 "${pid}" 2> /dev/null || break
      sleep 0.1
    done
    kill -KILL "${pid}" 2> /dev/null || true
  fi
  rm -f "${file}"
}

cmd_stop() {
  local dir="$1"
  export PATH="${PATH}:/usr/sbin:/sbin"
  if [ -f "${dir}/slurm.conf" ] && [ -f "${dir}/run/slurmctld.daemon" ]; then
    # Cancel what is left and let slurmd's step daemons end their processes before slurmd goes.
    export SLURM_CONF="${dir}/slurm.conf"
    scancel --quiet --partition=ci 2> /dev/null || true
    for _ in $(seq 60); do
      [ -z "$(squeue -h -o %i 2> /dev/null)" ] && break
      sleep 0.5
    done
  fi
  stop_pid_file "${dir}/run/slurmd.daemon"
  stop_pid_file "${dir}/run/slurmctld.daemon"
  stop_pid_file "${dir}/munge/munged.pid"
  echo "slurm_local: stopped (${dir})"
}

case "${1:-}" in
  install) cmd_install ;;
  start) cmd_start "${2:?usage: $0 start DIR}" ;;
  stop) cmd_stop "${2:?usage: $0 stop DIR}" ;;
  *)
    echo "usage: $0 install | start DIR | stop DIR" >&2
    exit 2
    ;;
esac
