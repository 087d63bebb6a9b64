#!/usr/bin/env bash
# Everything that needs GPUs, in one go: environment report, GPU checks (torchrun, 2 ranks by
# default; NPROC=1 runs them on one GPU, where every op is its local computation), then the
# benchmarks. Logs and results go to the folder given as $1 (or $OUT).
#   bash ci/gpu.sh OUTDIR [NPROC]
# Env: PO_DEVICE_KIND (names the results file), PO_TUNE=1 (sweep launch configs first),
#      PO_SKIP_CHECKS=1 (all GPU checks; PO_CHECKS_TIMEOUT_S: gpu_checks.py's limit, 720),
#      PO_SKIP_TORCH_FUSED=1 (torch's fused ops as transports, tests/gpu/check_torch_fused.py),
#      PO_SKIP_BENCH=1 (GEMV + AllReduce benchmark),
#      PO_SKIP_A2A=1 / PO_A2A_ARGS (GEMM + All-to-All benchmark), PO_SKIP_AG=1 / PO_AG_ARGS
#      (AllGather + GEMM benchmark), PO_SKIP_MOE=1 / PO_MOE_ARGS (MoE combine benchmark),
#      PO_SKIP_MOE_DISPATCH=1 / PO_MOE_DISPATCH_ARGS (MoE dispatch benchmark),
#      PO_SKIP_MOE_LAYER=1 / PO_MOE_LAYER_ARGS (whole MoE layer benchmark),
#      PO_SKIP_SIG=1 / PO_SKIP_SIG_BENCH=1 / PO_SIG_BENCH_ARGS (GEMM with
#      tile-group signals: checks and benchmark), PO_SKIP_EMB=1 / PO_EMB_BENCH_ARGS
#      (embedding + All-to-All: checks, benchmark, DLRM example; PO_DLRM_STEPS, 0 or
#      PO_SKIP_DLRM=1 (default PO_SKIP_EXAMPLES) skips the example, PO_EMB_SWEEP=0,
#      PO_SKIP_EMB_BENCH=1 keeps only its checks, PO_SKIP_EMB_CHECKS=1 (default
#      PO_SKIP_CHECKS) only its benchmark),
#      PO_SKIP_MR=1 / PO_MR_ARGS (GEMM + ReduceScatter / AllReduce benchmark), PO_CHECKS=name,...
#      (only those checks of gpu_checks.py), PO_SKIP_PRED=1 / PO_PRED_ARGS (wave-group predictor:
#      its error against the measured op, the search's pick against a bounded exhaustive search;
#      independent of PO_SKIP_SIG), PO_SKIP_EXAMPLES=1 / PO_PREFILL_TRANSPORT (the prefill
#      example's fused transport, default the library's: auto), PO_SKIP_DEMO=1,
#      PO_SKIP_WAITS=1 (bounded waits on the device clock), PO_SKIP_LANGUAGE=1 (the device API
#      and tutorials, tests/gpu/check_language.py), PO_SKIP_TUT_BENCH=1 / PO_TUT_ARGS (the
#      tutorials' kernels beside the library's ops, benchmarks/bench_tutorials.py), PO_SKIP_AUTO=1 (transport="auto",
#      tests/gpu/check_auto_transport.py), PO_SKIP_CAMPAIGN=1 / PO_CAMPAIGN_ARGS
#      (the fault campaign, tests/gpu/check_campaign.py), PO_SKIP_LAYOUTS=1 / PO_LAYOUT_PARTS
#      (odd layouts and tensors past 2**31 elements, tests/gpu/check_layouts.py),
#      PO_COMMIT (recorded with every result), PO_ARCHIVE=1 (logs packed into gpu-logs.tgz),
#      PO_PACK=FILE (OUTDIR packed into FILE after every torchrun section).
set -uo pipefail
out=${1:-${OUT:-out}}
nproc=${2:-2}
kind=${PO_DEVICE_KIND:-$(bash "$(dirname "$0")/device_kind.sh" "$nproc")}
mkdir -p "$out"
cd "$(dirname "$0")/.."
# Never use NVLink multicast on the shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# room for the MoE benchmark's NVSHMEM combine buffers (the library's default heap is 1 GB)
export NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-8G}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache TRITON_CACHE_DIR=/tmp/triton_cache
status=0
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv > "$out/gpus.txt" 2>&1
nvidia-smi topo -m >> "$out/gpus.txt" 2>&1
timeout 120 python3 -m portable_overlap env 2>&1 | tee "$out/env.txt"
# Each torchrun section's wall time goes to timing.txt, so device calls can be planned.
# Filters end in tail, never head: a head that exits early kills tee and truncates the log
# (the summary line is the log's last).
run() {
  local t0=$SECONDS rc
  timeout "$1" torchrun --nproc-per-node "$nproc" --master-port "$((29500 + RANDOM % 1000))" "${@:2}"
  rc=$?
  echo "$2 world=$nproc rc=$rc $((SECONDS - t0)) s (limit $1 s)" >> "$out/timing.txt"
  # PO_PACK=FILE: OUTDIR packed into FILE after every section, so that a run stopped at a
  # device call's limit still leaves the logs and rows of the sections it finished
  if [ -n "${PO_PACK:-}" ]; then
    tar czf "$PO_PACK.part" -C "$(dirname "${out%/}")" "$(basename "${out%/}")" \
        && mv -f "$PO_PACK.part" "$PO_PACK"
  fi
  return $rc
}
if [ "${PO_SKIP_CHECKS:-0}" != 1 ]; then
  run $(( ${PO_CHECKS_TIMEOUT_S:-720} + 60 )) tests/gpu/gpu_checks.py 2>&1 | tee "$out/checks.log" | grep -E "PASS|FAIL|gpu checks|Error|error" | tail -n 80
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${PO_SKIP_TORCH_FUSED:-0}" != 1 ]; then  # torch's fused ops as transports (32-37 s on 4 H200s)
  PO_TORCH_FUSED_CHECK_TIMEOUT=200 run 240 tests/gpu/check_torch_fused.py 2>&1 \
      | tee "$out/check_torch_fused.log" | grep -E "^PASS|^FAIL|checks" | tail -n 20
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${PO_SKIP_BENCH:-0}" != 1 ]; then
  tune=(); [ "${PO_TUNE:-0}" = 1 ] && tune=(--tune)
  run 540 benchmarks/bench_gemv_allreduce.py --out "$out/$kind.jsonl" --device-kind "$kind" \
      "${tune[@]}" ${PO_BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" | grep -vE "^\[|Warning|warn" | tail -20
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${PO_SKIP_A2A:-0}" != 1 ]; then
  run 420 benchmarks/bench_gemm_alltoall.py --out "$out/$kind.jsonl" --device-kind "$kind" \
      ${PO_A2A_ARGS:-} 2>&1 | tee "$out/bench_a2a.log" | grep -vE "^\[|Warning|warn" | tail -14
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${PO_SKIP_AG:-0}" != 1 ]; then
  run 300 benchmarks/bench_allgather_gemm.py --out "$out/$kind.jsonl" --device-kind "$kind" \
      ${PO_AG_ARGS:-} 2>&1 | tee "$out/bench_ag.log" | grep -vE "^\[|Warning|warn" | tail -10
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${PO_SKIP_MR:-0}" != 1 ]; then  # GEMM + ReduceScatter / AllReduce over copy engines
  run 420 benchmarks/bench_matmul_reduce.py --out "$out/$kind.jsonl" --device-kind "$kind" \
      ${PO_MR_ARGS:-} 2>&1 | tee "$out/bench_mr.log" | grep -vE "^\[|Warning|warn" | tail -16
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${PO_SKIP_MOE:-0}" != 1 ]; then
  run 480 benchmarks/bench_moe_combine.py --out "$out/$kind.jsonl" --device-kind "$kind" \
      ${PO_MOE_ARGS:-} 2>&1 | tee "$out/bench_moe.log" | grep -vE "^\[|Warning|warn" | tail -16
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${PO_SKIP_MOE_DISPATCH:-0}" != 1 ]; then
  run 300 benchmarks/bench_moe_dispatch.py --out "$out/$kind.jsonl" --device-kind "$kind" \
      ${PO_MOE_DISPATCH_ARGS:-} 2>&1 | tee "$out/bench_moe_dispatch.log" | grep -vE "^\[|Warning|warn" | tail -16
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${PO_SKIP_MOE_LAYER:-0}" != 1 ]; then  # 356 s on 4 H200s (three rounds): alone in
  # ci/scaleup.sh's moe-layer part, where it may take most of a 600 s device call
  run 540 benchmarks/bench_moe_layer.py --out "$out/$kind.jsonl" --device-kind "$kind" \
      ${PO_MOE_LAYER_ARGS:-} 2>&1 | tee "$out/bench_moe_layer.log" | grep -vE "^\[|Warning|warn" | tail -24
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${PO_SKIP_WAITS:-0}" != 1 ]; then
  timeout 150 python3 tests/gpu/check_waits.py 2>&1 | tee "$out/check_waits.log" | grep -E "PASS|FAIL|wait checks" | tail -12
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${PO_SKIP_LANGUAGE:-0}" != 1 ]; then  # the public device API and the tutorials
  run 300 tests/gpu/check_language.py 2>&1 | tee "$out/check_language.log" | grep -E "^PASS|^FAIL|^SKIP|language checks" | tail -14
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${PO_SKIP_TUT_BENCH:-0}" != 1 ]; then  # the tutorials' kernels beside the library's ops
  run 420 benchmarks/bench_tutorials.py --out "$out/$kind.jsonl" --device-kind "$kind" \
      ${PO_TUT_ARGS:-} 2>&1 | tee "$out/bench_tutorials.log" | grep -E "W=[0-9]|Error" | tail -12
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${PO_SKIP_AUTO:-0}" != 1 ]; then  # transport="auto" (the planner)
  run 300 tests/gpu/check_auto_transport.py 2>&1 | tee "$out/check_auto.log" | grep -E "^PASS|^FAIL|checks" | tail -24
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${PO_SKIP_CAMPAIGN:-0}" != 1 ]; then
  run 300 tests/gpu/check_campaign.py ${PO_CAMPAIGN_ARGS:-} 2>&1 | tee "$out/campaign.log" | grep -E "fault campaign|FAIL" | tail -44
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${PO_SKIP_LAYOUTS:-0}" != 1 ]; then  # one H200: 10-12 min with a cold Triton cache
  run 900 tests/gpu/check_layouts.py ${PO_LAYOUT_PARTS:+--parts "$PO_LAYOUT_PARTS"} 2>&1 | tee "$out/check_layouts.log" | grep -E "FAIL|layout checks" | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${PO_SKIP_EXAMPLES:-0}" != 1 ]; then
  run 240 examples/moe/moe_layer.py 2>&1 | tee "$out/example_moe.log" | grep -vE "^\[|Warning|warn" | tail -5
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  run 300 examples/transformer/prefill.py --graph ${PO_PREFILL_TRANSPORT:+--transport "$PO_PREFILL_TRANSPORT"} 2>&1 | tee "$out/example_prefill.log" | grep -vE "^\[|Warning|warn" | tail -13
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
# GEMM with tile-group signals (host-collective transport): checks, then its benchmark with the
# wave-group partition and SM-reserve sweeps at 8192^3. PO_SKIP_SIG=1 skips both;
# PO_SIG_BENCH_ARGS adds benchmark arguments.
if [ "${PO_SKIP_SIG:-0}" != 1 ]; then
  if [ "${PO_SKIP_CHECKS:-0}" != 1 ]; then
    run 360 tests/gpu/check_gemm_signal.py 2>&1 | tee "$out/check_gemm_signal.log" \
        | grep -E "PASS|FAIL|gpu checks|Error|error" | tail -n 60
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  fi
  if [ "${PO_SKIP_SIG_BENCH:-0}" != 1 ]; then
    run 300 benchmarks/bench_gemm_signal.py --out "$out/$kind.jsonl" --device-kind "$kind" \
        --partitions --reserves 0,8,16,24,32 --comm-ctas 8,16 ${PO_SIG_BENCH_ARGS:-} 2>&1 \
        | tee "$out/bench_gemm_signal.log" | grep -vE "^\[|Warning|warn" | tail -45
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  fi
fi
# The wave-group predictor against the op (GEMM + AllReduce / ReduceScatter, 2 shapes, at most
# 32 partitions each; stops taking new candidates after --budget-s 120 s; the library tuner per
# shape, ~10-20 s each).
if [ "${PO_SKIP_PRED:-0}" != 1 ]; then
  run 420 benchmarks/bench_wave_predictor.py --out "$out/$kind.jsonl" --device-kind "$kind" \
      ${PO_PRED_ARGS:-} 2>&1 | tee "$out/bench_wave_predictor.log" | grep -vE "^\[|Warning|warn" | tail -14
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${PO_SKIP_EMB:-0}" != 1 ]; then  # fused embedding pooling + All-to-All: checks, benchmark
  if [ "${PO_SKIP_EMB_CHECKS:-${PO_SKIP_CHECKS:-0}}" != 1 ]; then
    run 300 tests/gpu/check_embedding_alltoall.py 2>&1 | tee "$out/emb-checks.log" | grep -E "PASS|FAIL|gpu checks|Error|error" | tail -n 80
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  fi
  if [ "${PO_SKIP_EMB_BENCH:-0}" != 1 ]; then
    sweep=(); [ "${PO_EMB_SWEEP:-1}" = 1 ] && sweep=(--sweep)
    run 300 benchmarks/bench_embedding_alltoall.py --out "$out/$kind.jsonl" --device-kind "$kind" "${sweep[@]}" \
        ${PO_EMB_BENCH_ARGS:-} 2>&1 | tee "$out/emb-bench.log" | grep -vE "^\[|Warning|warn" | tail -20
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    if [ "${PO_DLRM_STEPS:-300}" != 0 ] && [ "${PO_SKIP_DLRM:-${PO_SKIP_EXAMPLES:-0}}" != 1 ]; then  # the DLRM example
      run 300 examples/dlrm/train.py --steps ${PO_DLRM_STEPS:-300} 2>&1 | tee "$out/dlrm.log" | grep -vE "^\[|Warning|warn" | tail -32
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
    fi
  fi
fi
if [ "${PO_SKIP_DEMO:-0}" != 1 ]; then
  timeout 300 python3 -m portable_overlap demo 2>&1 | tee "$out/demo.log" | grep -vE "^\[|Warning|warn" | tail -12
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
# The device tool brings back at most 8 files: PO_ARCHIVE=1 packs the logs into one archive and
# keeps only the results, the timings and the archive beside it.
if [ "${PO_ARCHIVE:-0}" = 1 ]; then
  (cd "$out" && tar czf ../gpu-logs.tgz . && find . -type f ! -name '*.jsonl' ! -name timing.txt -delete \
     && mv ../gpu-logs.tgz .)
fi
exit $status
