# Sourced by ci/test.sh and ci/demo.sh: sets PY to a Python that has what the project needs,
# making .venv (CPU build of torch, Triton, test tools) on a machine that lacks it.
#   source ci/env.sh run|test
# A Python that already has torch >= 2.11 and Triton (a GPU machine's image) is used as it is, with
# the checkout on PYTHONPATH.
_need=${1:-run}
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_probe='
import sys, torch, triton, numpy
v = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if sys.argv[1] == "test":
    import pytest
sys.exit(0 if v >= (2, 11) else 1)
'
export PYTHONPATH="$_root${PYTHONPATH:+:$PYTHONPATH}"
if [ -x "$_root/.venv/bin/python" ] && "$_root/.venv/bin/python" -c "$_probe" "$_need" 2>/dev/null; then
  PY="$_root/.venv/bin/python"
elif python3 -c "$_probe" "$_need" 2>/dev/null; then
  PY=python3
else
  echo "setting up $_root/.venv (torch CPU build, triton, test tools) ..." >&2
  python3 -m venv "$_root/.venv"
  # torch first and pinned: the machine's pip takes this CPU build from its local disk, where a
  # bare 'torch' would pull a multi-GB CUDA build
  # Triton pinned to what the GPU machines run (3.6), so CI compiles what they compile
  "$_root/.venv/bin/pip" install -q --disable-pip-version-check "torch==2.13.0" "triton==3.6.0"
  "$_root/.venv/bin/pip" install -q --disable-pip-version-check -e "$_root[test,mpi]" mpich
  PY="$_root/.venv/bin/python"
fi
export PY
