#!/usr/bin/env bash
# The test command (README): sets up a Python if needed, then runs the CPU test suite: the real
# Triton kernels under the interpreter on 2, 3, 4 and 8 emulated ranks, the backend checks, and the
# compile matrix (sm_90, gfx942 and gfx950). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh test
# The limit guards against a hang (every emulated world has its own per-test deadline, and
# pytest-timeout stops any test after 600 s). On a 2-core machine with a warm Triton cache the
# suite (about 1800 tests) has taken 77 min; a cold cache adds the compiles of the compile
# matrix (sm_90, gfx942, gfx950), so the guard leaves it more than twice that.
exec timeout 10800 "$PY" -m pytest -q -p no:cacheprovider tests "$@"
