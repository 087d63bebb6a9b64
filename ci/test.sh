#!/usr/bin/env bash
# The test command (README): sets up a Python if needed, then runs the CPU test suite: the real
# Triton kernels under the interpreter on 2, 4 and 8 emulated ranks, the backend checks, and the
# compile matrix (sm_90 and gfx942). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh test
exec timeout 1500 "$PY" -m pytest -q -p no:cacheprovider tests "$@"
