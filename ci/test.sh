#!/usr/bin/env bash
# The test command (README): sets up a Python if needed, then runs the CPU test suite: the real
# Triton kernels under the interpreter on 2, 4 and 8 emulated ranks, the backend checks, and the
# compile matrix (sm_90 and gfx942). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh test
# The limit guards against a hang (every emulated world has its own per-test deadline too). On
# a 2-core machine with a cold Triton cache the suite has needed more than 1500 s (the compile
# matrix alone 485 s; 700 of about 1190 tests in 1500 s on one such run), so the guard leaves
# it twice the time it is expected to take there.
exec timeout 5400 "$PY" -m pytest -q -p no:cacheprovider tests "$@"
