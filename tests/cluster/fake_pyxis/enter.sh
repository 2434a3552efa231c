#!/bin/bash
# The fake container's view of the file system, inside a private mount namespace (see srun here).
#   FAKE_PYXIS_ROOTFS  the image's contents (bound at FAKE_PYXIS_WORKDIR)
#   FAKE_PYXIS_HIDE    host folders covered by an empty tmpfs (':'-separated)
#   FAKE_PYXIS_MOUNTS  pyxis's --container-mounts: SRC:DST[,SRC:DST...]
#   FAKE_PYXIS_STAGE   a host folder outside the hidden ones, for staging the mounts
set -euo pipefail

stage="$(mktemp -d "${FAKE_PYXIS_STAGE:?}/ns.XXXXXX")"
mount -t tmpfs fake-pyxis-stage "${stage}" # private to this namespace; the host sees an empty dir
srcs=() dsts=()
IFS=, read -r -a specs <<< "${FAKE_PYXIS_MOUNTS:-}"
for i in "${!specs[@]}"; do
  src="${specs[$i]%%:*}" dst="${specs[$i]#*:}"
  mkdir -p "${stage}/${i}"
  mount --bind "${src}" "${stage}/${i}" # staged before the host folders are hidden
  srcs+=("${stage}/${i}") dsts+=("${dst}")
done
mkdir -p "${stage}/rootfs"
mount --bind "${FAKE_PYXIS_ROOTFS:?}" "${stage}/rootfs"
IFS=: read -r -a hidden <<< "${FAKE_PYXIS_HIDE:-}"
for dir in "${hidden[@]}"; do
  mount -t tmpfs fake-pyxis-hide "${dir}"
done
if [ -n "${FAKE_PYXIS_WORKDIR:-}" ]; then
  mkdir -p "${FAKE_PYXIS_WORKDIR}"
  mount --bind "${stage}/rootfs" "${FAKE_PYXIS_WORKDIR}"
fi
for i in "${!srcs[@]}"; do
  mkdir -p "${dsts[$i]}"
  mount --bind "${srcs[$i]}" "${dsts[$i]}"
done
cd "${FAKE_PYXIS_WORKDIR:-/}"
exec "$@"
