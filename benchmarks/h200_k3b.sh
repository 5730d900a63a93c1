#!/usr/bin/env bash
# Issue 14 part 6, round 3 (engineer B), on the lent H200 in ONE call after staging (call 1
# unpacks .device/big into /tmp/site; this call carries .device/wheels, the reference wheel
# and this tree with the variants compiled ahead: `tune_k3b.py --compile-only --workdir
# .tune_k3`): the softmax / cross-entropy variants side by side, the rules applied to the
# kernels' DEFAULTS (tune_k3b.py --apply), the GPU tiers on the tree so decided, then the fair
# bench_kernels.py (3 allocations a shape, the reference interleaved) on the ops concerned.
# Logs and decisions.json under $OUT; apply the same edits to a checkout with
# `python benchmarks/tune_k3b.py --apply-from FILE`.
set -uo pipefail
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
WHEELS=${WHEELS:-../../.device/wheels}
REFWHL=${REFWHL:-../refwhl}
test -d /tmp/site/nvidia_cutlass_dsl || { echo "not staged"; exit 3; }
if [ ! -d /tmp/site/tvm_ffi ]; then for w in "$WHEELS"/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done; fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip.log" 2>&1 || echo "pip failed"
python3 -m pip install -q --no-deps --no-index --target /tmp/ref "$REFWHL"/*.whl >> "$OUT/pip.log" 2>&1 || echo "ref pip failed"
export QUACK_CACHE_DIR=/tmp/qk3b
T0=$SECONDS
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t))s (at $((SECONDS - T0))s) | $(grep -E '(passed|failed|error).* in [0-9.]+s' "$OUT/$name.log" | tail -1)"; }
if [ "${SWEEP:-1}" = 1 ]; then
step sweep "${SWEEP_LIMIT:-45}" python3 benchmarks/tune_k3b.py --jobs 16 --workdir .tune_k3 --rounds 2 --allocs 3 \
  --json "$OUT/decisions.json" --apply
grep -vE "Warning|warn" "$OUT/sweep.log" | tail -50
fi
sha256sum kernels/softmax.py kernels/cross_entropy.py | cut -c1-16
step tests "${TEST_LIMIT:-120}" python3 -m pytest -q -p no:cacheprovider --async-compile=16 -rf \
  tests/kernels tests/test_gpu_roundtrip.py
grep -E "^(FAILED|ERROR)|^quack:" "$OUT/tests.log" | head -20
tail -3 "$OUT/tests.log"
if [ $((SECONDS - T0)) -lt "${BENCH_BEFORE:-190}" ]; then
  step bench "${BENCH_LIMIT:-85}" python3 benchmarks/bench_kernels.py --reps 20 --allocs 3 \
    --ops "${BENCH_OPS:-softmax_fwd,cross_entropy_fwd,cross_entropy_bwd,softmax_bwd}" \
    --shapes "${BENCH_SHAPES:-32768x4096,32768x16384,4096x262144}" \
    --compile-ops softmax_bwd --ref /tmp/ref --ref-ops softmax_fwd,cross_entropy_fwd,cross_entropy_bwd \
    --ref-timeout "${REF_TIMEOUT:-80}" --json "$OUT/bench.json"
  grep -vE "Warning|warn" "$OUT/bench.log" | tail -30
fi
exit 0
