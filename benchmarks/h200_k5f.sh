#!/usr/bin/env bash
# Issue 14 part 6, round 5 (engineer F: the mixed-precision norm forwards / backward), on the
# lent H200 in ONE call after staging (call 1 unpacks .device/big into /tmp/site; this call
# carries .device/wheels): the variants side by side with the rules applied to the modules'
# tables (tune_k5f.py --apply), then the GPU tiers on the tree so decided, then (time
# permitting) bench_kernels.py on the norms' same-dtype / _w32 rows. Logs and decisions.json
# under $OUT; apply the same edits to a checkout with
# `python benchmarks/tune_k5f.py --apply-from FILE`. SWEEP=0: the GPU tiers alone;
# SWEEP_GROUPS="g1,g2": those groups only (not GROUPS: bash's own array of the user's group
# ids, which an assignment cannot change: round 5's second call swept nothing through it).
set -uo pipefail
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
ROOT=${ROOT:-../..}  # the device checkout's root (.device/)
test -d /tmp/site/nvidia_cutlass_dsl || { echo "not staged"; exit 3; }
if [ ! -d /tmp/site/tvm_ffi ]; then for w in "$ROOT"/.device/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done; fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip.log" 2>&1 || echo "pip failed"
export QUACK_CACHE_DIR=/tmp/qk5f
T0=$SECONDS
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t))s (at $((SECONDS - T0))s) | $(grep -E '(passed|failed|error).* in [0-9.]+s' "$OUT/$name.log" | tail -1)"; }
if [ "${SWEEP:-1}" = 1 ]; then
step sweep "${SWEEP_LIMIT:-150}" python3 benchmarks/tune_k5f.py --jobs 16 --rounds 3 --json "$OUT/decisions.json" --apply ${SWEEP_GROUPS:+--groups "$SWEEP_GROUPS"}
grep -E "^(decide|kernels/|\[compiled|compile .* failed)|FAILED" "$OUT/sweep.log"
grep -E "TB/s" "$OUT/sweep.log" | sed -E 's/ +/ /g'
fi
grep -nE "^(WIDE_FWD|ROW_CTA|ROW_CLUSTER|W_SMEM_WIDE_ONE_CTA)" kernels/rmsnorm.py kernels/_ln_row.py kernels/_norm_bwd.py
sha256sum kernels/rmsnorm.py kernels/_ln_row.py kernels/_norm_bwd.py | cut -c1-16
step tests "${TEST_LIMIT:-170}" python3 -m pytest -q -p no:cacheprovider --async-compile=16 -rf \
  tests/kernels tests/test_gpu_roundtrip.py
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
tail -c 600 "$OUT/tests.log" | grep -E "passed|failed|skipped" | tail -2
if [ "${BENCH:-1}" = 1 ] && [ $((SECONDS - T0)) -lt "${BENCH_BEFORE:-240}" ]; then
  step bench "${BENCH_LIMIT:-80}" python3 benchmarks/bench_kernels.py --reps 20 --no-compile --no-eager \
    --ops rmsnorm_fwd,rmsnorm_fwd_w32,layernorm_fwd,layernorm_fwd_w32,rmsnorm_bwd,rmsnorm_bwd_w32 --json "$OUT/bench.json"
  grep -vE "Warning|warn" "$OUT/bench.log" | tail -30
fi
exit 0
