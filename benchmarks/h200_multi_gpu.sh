#!/usr/bin/env bash
# Issue 16 on a multi-GPU host: GPU tier warm (strict) and cold (--async-compile) at -n 0/2/4,
# then OOM under sharing (-n 4, memory pressure). Wall times + pinning records in the logs.
# Usage (issue 16; a machine of 2+ GPUs, e.g. kind nvidia-h200-x2): stage as in
# ../shared/device/README.md (call 1 carries .device/big), then in call 2 (carry .device/wheels):
#   bash benchmarks/h200_multi_gpu.sh        # NS="0 2 4" by default; logs under $OUT
set -uo pipefail
. benchmarks/h200_stage.sh
nvidia-smi -L; NC=$(nproc); echo "cores $NC"
TIER="tests/kernels tests/test_gpu_roundtrip.py"
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout -k 5 "$limit" "$@" >> "$OUT/$LOG.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t))s | $(grep -E '(passed|failed).* in [0-9.]+s' "$OUT/$LOG.log" | tail -1)"
  grep -E "^quack: [0-9]|retried after|GPU pinning|PROBLEM" "$OUT/$LOG.log" | tail -2; echo "=== end $name" >> "$OUT/$LOG.log"; }
P="python3 -m pytest -q -p no:cacheprovider -rf"
export QUACK_CACHE_DIR=/tmp/qwarm
LOG=build step build 90 python3 -m quack_build build -j "$NC" -k manifests/training.toml manifests/tests.toml
for n in ${NS:-0 2 4}; do LOG=warm step "warm -n $n" 110 $P --quack-prebuilt -n $n $TIER; done
for n in ${NS:-0 2 4}; do export QUACK_CACHE_DIR=/tmp/qcold$n
  LOG=cold step "cold -n $n --async-compile" 130 $P --async-compile=$((NC)) -n $n $TIER; done
export QUACK_CACHE_DIR=/tmp/qwarm QUACK_TEST_OOM_PRESSURE=2
LOG=oom step "oom -n 4 pressure" 110 $P --quack-prebuilt -n 4 tests/kernels/test_training_gpu.py
grep -E "CUDA OOM retry" "$OUT/oom.log" | head -12
