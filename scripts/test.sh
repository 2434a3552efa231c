#!/bin/bash
# Install, then run the test suite (CPU; GPU-marked tests skip themselves without CUDA).
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/install_etcd.sh  # the etcd store's tests run a real 3-member cluster
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
rc=$?
set -e
if [ "${rc}" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "${rc}"
