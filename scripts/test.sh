#!/bin/bash
# Install, then run the test suite (CPU; GPU-marked tests skip themselves without CUDA).
#   bash scripts/test.sh [pytest args]
# Two pytest-xdist workers (MECEFO_TEST_WORKERS; 0 = in one process): about 40% of a serial run's
# time is waiting (detection timeouts, restarts), which the other worker fills. Tests that share a
# fixture that cannot be doubled (the Slurm cluster) are one xdist_group.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/install_etcd.sh  # the etcd store's tests run a real 3-member cluster
# bytecode of the repository's own modules, written once: where PYTHONDONTWRITEBYTECODE is set
# (this project's machines), every process of the suite compiled them from source again (about
# 4% of a launched job's CPU: the agent, store host, coordinator and fork server each)
.venv/bin/python -m compileall -q -j 0 megatron_mecefo tests tools > /dev/null
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 \
  -n "${MECEFO_TEST_WORKERS:-2}" --dist loadgroup tests "$@"
rc=$?
set -e
if [ "${rc}" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "${rc}"
