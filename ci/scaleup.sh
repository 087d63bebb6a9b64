#!/usr/bin/env bash
# The scale-up measurements (docs/scaling.md) in parts that each fit one 10-minute device call,
# on the GPUs of one host (4 or 8). Logs and rows go to OUTDIR; the device kind names the
# results file (ci/device_kind.sh: nvidia-h200-x<NPROC>.jsonl on H200s).
#   bash ci/scaleup.sh PART OUTDIR [NPROC]
# PART:
#   checks    the GPU checks of every op (tests/gpu/gpu_checks.py) with a limit of 540 s;
#             checks-ops, checks-moe and checks-rest split them in three
#   ops       torch's fused ops checked as transports, then AllGather + GEMM (stores at two
#             sender counts and with copy-engine pulls, beside the copy engines, torch's fused
#             op, sequential) and GEMM + ReduceScatter / AllReduce
#   gemv      GEMV + AllReduce (one-shot, two-shot, torch's path, auto) and the checks of
#             transport="auto" over every pattern
#   moe       the MoE combine and dispatch benchmarks, the MoE example, the prefill example
#             (default transport)
#   moe-layer the whole-layer MoE benchmark alone, three rotated rounds
#   embedding embedding + All-to-All (checks, benchmark, the DLRM example), GEMM + All-to-All
#   rest      the device API and its tutorials beside the library's ops, the fault campaign
# On 4 H200s the sections now in ops and gemv took about 470 s together (GEMV + AllReduce
# with its tuning 91 s, AllGather + GEMM 118, GEMM + ReduceScatter / AllReduce 162, the
# torch_fused checks 32-37, the auto checks 44-62), the layer benchmark alone 356 s and the
# embedding checks 132-220: on 8 GPUs such groups would come close to a call's 600 s, hence
# the parts (docs/scaling.md).
# OUTDIR.tgz is packed after every section (PO_PACK), so a part stopped at a call's limit
# still returns what it finished: copy it to $OUT after the run whatever its exit status.
# Each part runs ci/gpu.sh with the other sections skipped, so the options of gpu.sh
# (PO_AG_ARGS, PO_MR_ARGS, ...) still apply; PO_COMMIT is recorded with every row.
set -uo pipefail
part=${1:?usage: bash ci/scaleup.sh checks[-ops|-moe|-rest]|ops|gemv|moe|moe-layer|embedding|rest OUTDIR [NPROC]}
out=${2:?usage: bash ci/scaleup.sh checks[-ops|-moe|-rest]|ops|gemv|moe|moe-layer|embedding|rest OUTDIR [NPROC]}
nproc=${3:-8}
cd "$(dirname "$0")/.."
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
skip_all=(PO_SKIP_CHECKS PO_SKIP_BENCH PO_SKIP_A2A PO_SKIP_AG PO_SKIP_MR PO_SKIP_MOE
          PO_SKIP_MOE_DISPATCH PO_SKIP_MOE_LAYER PO_SKIP_SIG PO_SKIP_PRED PO_SKIP_EMB
          PO_SKIP_WAITS PO_SKIP_LANGUAGE PO_SKIP_TUT_BENCH PO_SKIP_AUTO PO_SKIP_CAMPAIGN
          PO_SKIP_EXAMPLES PO_SKIP_DEMO PO_SKIP_LAYOUTS PO_SKIP_TORCH_FUSED)
# every section of gpu.sh off, then each part turns its own on (a section left out of this
# list would run in every part: tests/test_bench_runner.py checks that none is)
for v in "${skip_all[@]}"; do export "$v=1"; done
status=0
# the GPU checks of gpu_checks.py named in $1 (comma-separated; empty: all), within 540 s
checks() {
  export PO_SKIP_CHECKS=0 PO_CHECKS=${PO_CHECKS:-$1} PO_CHECKS_TIMEOUT_S=${PO_CHECKS_TIMEOUT_S:-540}
}
case "$part" in
  ops)
    # torch's fused ops as transports, checked on this world before anything is timed
    export PO_SKIP_TORCH_FUSED=0 PO_SKIP_AG=0 PO_SKIP_MR=0
    # the stores at the rule's sender count and at 24, and with half of every shard pulled by
    # the copy engines (docs/scaling.md)
    export PO_AG_ARGS=${PO_AG_ARGS:---senders default,24 --stores pull_share=0.5 --schedules none}
    ;;
  checks)  # every check of gpu_checks.py (or PO_CHECKS): about 450 s on one H100 with a cold
    # Triton cache, longer on 4 and 8 GPUs, past a call's 600 s; the three parts below split them
    checks ""
    ;;
  checks-ops)  # 249 s on one H100 (a world of one, cold cache)
    checks gemv,patterns,gemm_alltoall,allgather_gemm,matmul_reduce,empty_dims
    ;;
  checks-moe)  # 125 s on one H100
    checks moe_combine,moe_dispatch,expert_swiglu,moe_dispatch_swiglu,moe_layer
    ;;
  checks-rest)  # the checks of every op at drawn shapes, of contexts' lives and of peer faults
    checks sweep,streams,compile_graphs,capture_first,inference_mode,context_churn,eager_and_replays,refresh,peer_failures,late_stores
    ;;
  gemv)
    export PO_SKIP_BENCH=0 PO_SKIP_AUTO=0
    ;;
  moe)
    export PO_SKIP_MOE=0 PO_SKIP_MOE_DISPATCH=0 PO_SKIP_EXAMPLES=0
    ;;
  moe-layer)
    export PO_SKIP_MOE_LAYER=0
    export PO_MOE_LAYER_ARGS=${PO_MOE_LAYER_ARGS:---rounds 3}
    ;;
  embedding)  # on 4 H200s the checks took 132-220 s, the benchmark 24-53, the example 38-87
    export PO_SKIP_EMB=0 PO_SKIP_EMB_CHECKS=0 PO_SKIP_DLRM=0 PO_SKIP_A2A=0
    export PO_DLRM_STEPS=${PO_DLRM_STEPS:-100}
    ;;
  rest)
    export PO_SKIP_LANGUAGE=0 PO_SKIP_TUT_BENCH=0 PO_SKIP_CAMPAIGN=0
    ;;
  *)
    echo "unknown part '$part': checks, checks-ops, checks-moe, checks-rest, ops, gemv, moe, moe-layer, embedding or rest" >&2
    exit 2
    ;;
esac
export PO_PACK="${out%/}.tgz"
PO_DEVICE_KIND=${PO_DEVICE_KIND:-$(bash ci/device_kind.sh "$nproc")} bash ci/gpu.sh "$out" "$nproc" || status=1
# one file with every log and row: a tool that fetches only a few files still gets them all
tar czf "${out%/}.tgz" -C "$(dirname "${out%/}")" "$(basename "${out%/}")" && echo "packed ${out%/}.tgz"
exit $status
