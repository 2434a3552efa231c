#!/usr/bin/env bash
# One call on a lent GPU (docs/DEVELOPMENT.md, "What one lent GPU does"): install the carried
# wheels (tools/gpu/wheels.sh made them), then run tools/gpu/check.py, which writes
# gpu_check.json and gpu_check.md under $OUT (or --out).
#
#   bash tools/gpu/check.sh                   # on the device: run tool, carry ["tools/gpu/wheels"]
#   bash tools/gpu/check.sh --dry-run         # here, no GPU (or MECEFO_GPU_DRY=1): the plan only
#
# PYTHON (default python3) runs everything; the wheels go into MECEFO_GPU_SITE (default
# /tmp/mecefo-gpu-site) with pip --no-index --no-deps, at most INSTALL_BOUND_S seconds (as
# tools/gpu/parts.py counts it); no wheels folder: one line, and the parts that need megatron-core
# are skipped. Arguments go to check.py, checked first (a bad one: one error line, exit 2).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python3}
SITE=${MECEFO_GPU_SITE:-/tmp/mecefo-gpu-site}
INSTALL_BOUND_S=45
export MECEFO_GPU_WHEELS=${MECEFO_GPU_WHEELS:-$ROOT/tools/gpu/wheels}

case " $* " in *" -h "* | *" --help "*) exec "$PY" "$ROOT/tools/gpu/check.py" --help ;; esac
"$PY" "$ROOT/tools/gpu/check.py" --parse-only "$@" || exit $?
dry=${MECEFO_GPU_DRY:-0}
prev=""
for arg in "$@"; do
    case "$arg" in
        --dry-run) dry=1 ;;
        --wheels=*) MECEFO_GPU_WHEELS=${arg#--wheels=} ;;
    esac
    [ "$prev" = "--wheels" ] && MECEFO_GPU_WHEELS=$arg
    prev=$arg
done

say() { echo "[gpu-check] $*"; }
if [ "$dry" != "0" ]; then
    export MECEFO_GPU_DRY=1
elif ! compgen -G "$MECEFO_GPU_WHEELS/*.whl" >/dev/null; then
    say "install: skipped, no wheels in $MECEFO_GPU_WHEELS (carry tools/gpu/wheels; make it with tools/gpu/wheels.sh)"
    export MECEFO_GPU_INSTALL="skipped|0|no wheels in $MECEFO_GPU_WHEELS"
else
    say "install: $(ls "$MECEFO_GPU_WHEELS"/*.whl | wc -l) wheels into $SITE (bound ${INSTALL_BOUND_S} s)"
    start=$SECONDS
    log=$(mktemp)
    timeout -k 5 "$INSTALL_BOUND_S" "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --disable-pip-version-check --target "$SITE" \
        "$MECEFO_GPU_WHEELS"/*.whl >"$log" 2>&1
    rc=$?
    secs=$((SECONDS - start))
    if [ "$rc" = 0 ]; then
        export MECEFO_GPU_INSTALL="ok|$secs|"
    elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        export MECEFO_GPU_INSTALL="skipped|$secs|pip install timed out after ${INSTALL_BOUND_S} s"
    else
        export MECEFO_GPU_INSTALL="failed|$secs|pip exit $rc: $(tail -n 1 "$log" | tr '|' '/')"
    fi
    rm -f "$log"
    say "install: ${MECEFO_GPU_INSTALL%%|*} in ${secs} s"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$ROOT"
exec "$PY" "$ROOT/tools/gpu/check.py" "$@"
