#!/usr/bin/env bash
# The demo command (README): sets up a Python if needed, then runs the 2-rank fused GEMV +
# AllReduce demo (on GPUs when at least 2 are present, else on CPU-emulated ranks).
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source ci/env.sh run
exec timeout 1200 "$PY" -m portable_overlap demo "$@"
