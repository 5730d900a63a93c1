#!/usr/bin/env bash
# Issue 14 part 6, round 6 (engineer G: the last mixed-precision norm misses), on the lent H200
# in ONE call after staging (call 1 unpacks .device/big into /tmp/site; this call carries
# .device/wheels): the variants side by side with the rule applied to the modules' tables
# (tune_k6g.py --apply), then the GPU tests of the norms on the tree so decided, then (time
# permitting) the rest of the GPU tiers. Logs and decisions.json under $OUT; apply the same
# edits to a checkout with `python benchmarks/tune_k6g.py --apply-from FILE`. SWEEP=0: the
# tests alone; SWEEP_GROUPS="g1,g2": those groups only (not GROUPS: bash's own array).
set -uo pipefail
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
ROOT=${ROOT:-../..}  # the device checkout's root (.device/)
test -d /tmp/site/nvidia_cutlass_dsl || { echo "not staged"; exit 3; }
if [ ! -d /tmp/site/tvm_ffi ]; then for w in "$ROOT"/.device/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done; fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip.log" 2>&1 || echo "pip failed"
export QUACK_CACHE_DIR=/tmp/qk6g
T0=$SECONDS
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t))s (at $((SECONDS - T0))s) | $(grep -E '(passed|failed|error).* in [0-9.]+s' "$OUT/$name.log" | tail -1)"; }
before=$(cat kernels/rmsnorm.py kernels/_ln_row.py | sha256sum)
if [ "${SWEEP:-1}" = 1 ]; then
step sweep "${SWEEP_LIMIT:-120}" python3 benchmarks/tune_k6g.py --jobs 16 --rounds 3 --json "$OUT/decisions.json" --apply ${SWEEP_GROUPS:+--groups "$SWEEP_GROUPS"}
grep -E "^(decide|kernels/|\[compiled|compile .* failed)|FAILED" "$OUT/sweep.log"
grep -E "TB/s" "$OUT/sweep.log" | sed -E 's/ +/ /g'
fi
grep -nE "^(WIDE_FWD|ROW_CTA|ROW_CLUSTER)" kernels/rmsnorm.py kernels/_ln_row.py
# TESTS_IF_CHANGED=1: the GPU tests only when the sweep changed a default (a second call
# whose tree is otherwise the one the first call tested)
if [ "${TESTS_IF_CHANGED:-0}" = 1 ] && [ "$before" = "$(cat kernels/rmsnorm.py kernels/_ln_row.py | sha256sum)" ]; then
  echo "defaults unchanged: no tests"; echo "total $((SECONDS - T0))s"; exit 0
fi
step tests_norm "${TEST_LIMIT:-70}" python3 -m pytest -q -p no:cacheprovider --async-compile=16 -rf \
  tests/kernels -k "rmsnorm or layernorm"
grep -E "^(FAILED|ERROR)" "$OUT/tests_norm.log" | head -20
tail -c 600 "$OUT/tests_norm.log" | grep -E "passed|failed|skipped" | tail -2
if [ $((SECONDS - T0)) -lt "${REST_BEFORE:-175}" ]; then
  step tests_rest "${REST_LIMIT:-60}" python3 -m pytest -q -p no:cacheprovider --async-compile=16 -rf \
    tests/kernels tests/test_gpu_roundtrip.py -k "not (rmsnorm or layernorm)"
  grep -E "^(FAILED|ERROR)" "$OUT/tests_rest.log" | head -20
  tail -c 600 "$OUT/tests_rest.log" | grep -E "passed|failed|skipped" | tail -2
fi
echo "total $((SECONDS - T0))s"
exit 0
