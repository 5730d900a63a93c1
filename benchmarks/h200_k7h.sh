#!/usr/bin/env bash
# Issue 14 part 6, round 7 (engineer H), device call 2 after staging: the variants the profile
# pointed at (benchmarks/tune_k7h.py) side by side with the rule applied to the modules' tables
# (--apply), then the GPU tests of the norms on the tree so decided (tests/kernels -k "rmsnorm or
# layernorm" and tests/kernels/test_k7h_gpu.py). Logs and decisions.json under $OUT; the same
# edits elsewhere: `python benchmarks/tune_k7h.py --apply-from FILE`. SWEEP=0: the tests alone.
set -uo pipefail
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
ROOT=${ROOT:-../..}  # the device checkout's root (.device/)
test -d /tmp/site/nvidia_cutlass_dsl || { echo "not staged"; exit 3; }
if [ ! -d /tmp/site/tvm_ffi ]; then for w in "$ROOT"/.device/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done; fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip.log" 2>&1 || echo "pip failed"
export QUACK_CACHE_DIR=/tmp/qk7h
T0=$SECONDS
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t))s (at $((SECONDS - T0))s) | $(grep -E '(passed|failed|error).* in [0-9.]+s' "$OUT/$name.log" | tail -1)"; }
if [ "${SWEEP:-1}" = 1 ]; then
step sweep "${SWEEP_LIMIT:-170}" python3 benchmarks/tune_k7h.py --jobs 16 --rounds 3 --json "$OUT/decisions.json" --apply
grep -E "^(decide|kernels/|\[compiled|compile .* failed)|FAILED" "$OUT/sweep.log"
grep -E "TB/s" "$OUT/sweep.log" | sed -E 's/ +/ /g'
fi
grep -nE "^(WIDE_FWD|ROW_CTA|ROW_CLUSTER|ROW_SMALL)" kernels/rmsnorm.py kernels/_ln_row.py
step tests_norm "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider --async-compile=16 -rf \
  tests/kernels -k "rmsnorm or layernorm or k7h"
grep -E "^(FAILED|ERROR)" "$OUT/tests_norm.log" | head -20
tail -c 600 "$OUT/tests_norm.log" | grep -E "passed|failed|skipped" | tail -2
echo "total $((SECONDS - T0))s"
exit 0
