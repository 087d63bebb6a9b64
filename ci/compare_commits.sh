#!/usr/bin/env bash
# Before/after on one machine in one call: the benchmarks of ci/gpu.sh for the library in this
# tree ("new") and for an older tree ("old", made with `git archive OLD | tar -x -C DIR`), run
# in alternating rounds, each into its own results file; then the two side by side.
#   bash ci/compare_commits.sh OLD_DIR OUTDIR [ROUNDS] [NPROC]
# Env: PO_OLD_COMMIT / PO_COMMIT (recorded in the rows), and every PO_SKIP_* / PO_*_ARGS
# variable of ci/gpu.sh (both trees' scripts read the same names).
set -uo pipefail
old=$(cd "$1" && pwd)
out=$(mkdir -p "$2" && cd "$2" && pwd)
rounds=${3:-1}
nproc=${4:-2}
here=$(cd "$(dirname "$0")/.." && pwd)
export PO_SKIP_CHECKS=1 PO_SKIP_EXAMPLES=1 PO_SKIP_DEMO=1 PO_SKIP_WAITS=1 PO_SKIP_CAMPAIGN=1
export PO_SKIP_PRED=${PO_SKIP_PRED:-1} PO_EMB_SWEEP=${PO_EMB_SWEEP:-0} PO_DLRM_STEPS=${PO_DLRM_STEPS:-0}
status=0
for ((i = 1; i <= rounds; i++)); do
  # odd rounds run new first, even rounds old first, so drift over the call hits both alike
  order=(new old); ((i % 2 == 0)) && order=(old new)
  for which in "${order[@]}"; do
    tree=$here; commit=${PO_COMMIT:-new}
    [ "$which" = old ] && { tree=$old; commit=${PO_OLD_COMMIT:-old}; }
    echo "== round $i: $which ($tree)"
    PO_COMMIT=$commit PO_DEVICE_KIND=${PO_DEVICE_KIND:-$(bash "$here/ci/device_kind.sh" "$nproc")} \
      bash "$tree/ci/gpu.sh" "$out/$which-r$i" "$nproc" > "$out/$which-r$i.log" 2>&1 || status=1
    cat "$out/$which-r$i"/*.jsonl >> "$out/$which.jsonl" 2>/dev/null
    cat "$out/$which-r$i/timing.txt" 2>/dev/null
  done
done
cd "$here" && python3 -m benchmarks.compare_results "$out/old.jsonl" "$out/new.jsonl" --impl fused \
  | tee "$out/compare.txt" | tail -n 60
exit $status
