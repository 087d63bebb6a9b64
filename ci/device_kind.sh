#!/usr/bin/env bash
# The device tool's name for this machine, from its GPUs' name and the GPU count a run uses:
#   bash ci/device_kind.sh NPROC   ->  nvidia-h200-x4, nvidia-h100-x2, nvidia-h200 (one H200), ...
# The results files are named by it, so rows of an H100 machine never land in an H200 file.
nproc=${1:-1}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
case "$name" in
  *H200*) family=nvidia-h200 ;;
  *H100*) family=nvidia-h100 ;;
  *MI300X*) family=amd-mi300x ;;
  *) family=unknown-gpu ;;
esac
if [ "$family" = nvidia-h200 ] && [ "$nproc" = 1 ]; then
  echo "$family"
else
  echo "$family-x$nproc"
fi
