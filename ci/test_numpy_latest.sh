#!/usr/bin/env bash
# The CPU kernels with the newest numpy: users get whatever numpy pip gives them, not the one the
# main test venv happens to hold. Makes (or reuses) .venv-numpy-latest with the CPU build of
# torch, Triton and the newest numpy, then runs the demo and a representative subset of the
# emulated-rank tests (the interpreter compatibility check, GEMV + AllReduce, GEMM + All-to-All).
# Extra arguments go to pytest.
#   bash ci/test_numpy_latest.sh
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-numpy-latest
pip_q=(-q --disable-pip-version-check)
if [ ! -x "$venv/bin/python" ]; then
  echo "setting up $venv (torch CPU build, triton, newest numpy, pytest) ..." >&2
  python3 -m venv "$venv"
  # torch and Triton pinned as in ci/env.sh: the machine's pip takes this CPU build from its local
  # disk, and Triton matches what the GPU machines compile with
  "$venv/bin/pip" install "${pip_q[@]}" "torch==2.13.0" "triton==3.6.0"
fi
# every run: the newest numpy (and test tools) the index offers
"$venv/bin/pip" install "${pip_q[@]}" --upgrade numpy pytest pytest-timeout
PY="$venv/bin/python"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import numpy, torch, triton; print(f"numpy {numpy.__version__}, torch {torch.__version__}, triton {triton.__version__}")'
timeout 900 "$PY" -m portable_overlap demo --cpu
exec timeout 1500 "$PY" -m pytest -q -p no:cacheprovider tests/test_interpreter_compat.py \
  tests/test_gemv_allreduce.py tests/test_gemm_alltoall.py "$@"
