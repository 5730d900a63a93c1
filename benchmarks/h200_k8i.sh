#!/usr/bin/env bash
# Issue 14 part 6, round 8 (engineer I), the device call after staging: LayerNorm fwd fp32 w + b
# at ROW_CTA's class (benchmarks/tune_k8i.py) in PROCS processes (the first compiles, the others
# reuse its objects), the rule over their mean applied to kernels/_ln_row.py (--apply), then the
# GPU tests of the LayerNorm forwards on the tree so decided. Logs and JSON under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
ROOT=${ROOT:-../..}  # the device checkout's root (.device/)
test -d /tmp/site/nvidia_cutlass_dsl || { echo "not staged"; exit 3; }
if [ ! -d /tmp/site/tvm_ffi ]; then for w in "$ROOT"/.device/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done; fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip.log" 2>&1 || echo "pip failed"
export QUACK_CACHE_DIR=/tmp/qk8i
T0=$SECONDS
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t))s (at $((SECONDS - T0))s) | $(grep -E '(passed|failed|error).* in [0-9.]+s' "$OUT/$name.log" | tail -1)"; }
JS=()
for p in $(seq 1 "${PROCS:-3}"); do
  step "sweep$p" "${SWEEP_LIMIT:-120}" python3 benchmarks/tune_k8i.py --jobs 16 --rounds "${ROUNDS:-3}" --json "$OUT/sweep$p.json"
  grep -E "^\[compiled|compile .* failed|FAILED" "$OUT/sweep$p.log"
  [ -s "$OUT/sweep$p.json" ] && JS+=("$OUT/sweep$p.json")
done
grep -E " us " "$OUT/sweep1.log" | sed -E 's/ +/ /g'
if [ ${#JS[@]} -gt 0 ]; then
  python3 benchmarks/tune_k8i.py --decide "${JS[@]}" --apply 2>&1 | tee "$OUT/decide.log"
fi
grep -nE "^ROW_CTA: dict" kernels/_ln_row.py
step tests "${TEST_LIMIT:-170}" python3 -m pytest -q -p no:cacheprovider --async-compile=16 -rf \
  tests/kernels -k "layernorm or k7h or k8i"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
tail -c 600 "$OUT/tests.log" | grep -E "passed|failed|skipped" | tail -2
cp kernels/_ln_row.py "$OUT/_ln_row.py"
echo "total $((SECONDS - T0))s"
exit 0
