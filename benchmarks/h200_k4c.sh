#!/usr/bin/env bash
# Issue 14 part 6, round 4 (engineer C: LayerNorm fwd, rows of one 256-thread CTA), on the
# lent H200 in ONE call after staging (call 1 unpacks .device/big into /tmp/site; this call
# carries .device/wheels): the variants side by side with the rule applied to
# layernorm.ROW_CTA (tune_k4c.py --apply), then the GPU tiers on the tree so decided.
# Logs and decisions.json under $OUT; apply the same edit to a checkout with
# `python benchmarks/tune_k4c.py --apply-from FILE`. SWEEP=0: the GPU tiers alone.
set -uo pipefail
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
ROOT=${ROOT:-../..}  # the device checkout's root (.device/)
test -d /tmp/site/nvidia_cutlass_dsl || { echo "not staged"; exit 3; }
if [ ! -d /tmp/site/tvm_ffi ]; then for w in "$ROOT"/.device/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done; fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip.log" 2>&1 || echo "pip failed"
export QUACK_CACHE_DIR=/tmp/qk4c
T0=$SECONDS
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t))s (at $((SECONDS - T0))s) | $(grep -E '(passed|failed|error).* in [0-9.]+s' "$OUT/$name.log" | tail -1)"; }
if [ "${SWEEP:-1}" = 1 ]; then
step sweep "${SWEEP_LIMIT:-90}" python3 benchmarks/tune_k4c.py --jobs 16 --rounds 3 --json "$OUT/decisions.json" --apply
grep -E "^(decide|kernels/|\[compiled|compile .* failed)|FAILED" "$OUT/sweep.log"
grep -E "TB/s" "$OUT/sweep.log"
fi
grep -nE "^ROW_CTA" kernels/layernorm.py; sha256sum kernels/layernorm.py | cut -c1-16
step tests "${TEST_LIMIT:-120}" python3 -m pytest -q -p no:cacheprovider --async-compile=16 -rf \
  tests/kernels tests/test_gpu_roundtrip.py
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
tail -c 600 "$OUT/tests.log" | grep -E "passed|failed|skipped" | tail -2
exit 0
