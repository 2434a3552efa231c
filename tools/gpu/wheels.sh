#!/usr/bin/env bash
# Download, here (with network), the wheels the lent GPU machine lacks, for its Python 3.12 on
# manylinux x86_64: megatron-core 0.16.1 (its own needs, torch, numpy and packaging, are there)
# and pyeclib (the Reed-Solomon snapshot parity the recovery benchmark encodes with). The folder
# is gitignored and travels as the run tool's `carry` (at most 64 MiB); tools/gpu/check.sh
# installs it with pip --no-index.
#
#   bash tools/gpu/wheels.sh [DIR]            # default tools/gpu/wheels
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DIR=${1:-$ROOT/tools/gpu/wheels}
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
WHEELS=(megatron-core==0.16.1 pyeclib==1.8.0)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64
    manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

mkdir -p "$DIR"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp ${PLATFORMS[@]/#/--platform } -d "$DIR" "${WHEELS[@]}"
kib=$(du -sk "$DIR" | cut -f1)
echo "wheels: $(ls "$DIR"/*.whl | wc -l) in $DIR, $((kib / 1024)) MiB ($kib KiB)"
ls "$DIR"/*.whl | sed 's|.*/|  |'
if [ "$kib" -ge $((64 * 1024)) ]; then
    echo "error: $DIR is over the 64 MiB a carried folder may hold" >&2
    exit 1
fi
