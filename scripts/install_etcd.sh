#!/bin/bash
# Install the etcd server for `mecefo-launch --store etcd` on one machine and its tests: Debian's
# etcd-server package (3.4 on Debian 12). A site with its own etcd cluster does not need this: it
# passes MECEFO_ETCD_ENDPOINTS. scripts/test.sh runs it; re-running is a no-op once `etcd` exists.
set -euo pipefail
if command -v etcd >/dev/null 2>&1; then
  exit 0
fi
sudo=()
if [ "$(id -u)" != 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "[install_etcd] error: etcd is missing and installing it needs root (apt-get install etcd-server)" >&2
    exit 1
  fi
  sudo=(sudo)
fi
echo "[install_etcd] apt-get install etcd-server"
export DEBIAN_FRONTEND=noninteractive
if ! "${sudo[@]}" apt-get install -y -qq etcd-server >/dev/null 2>&1; then
  "${sudo[@]}" apt-get update -qq >/dev/null
  "${sudo[@]}" apt-get install -y -qq etcd-server >/dev/null
fi
# the package may start a system etcd on 2379 where an init system runs: the project never uses it
command -v etcd >/dev/null && echo "[install_etcd] $(etcd --version | head -1)"
