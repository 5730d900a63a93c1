#!/usr/bin/env bash
# Issue 14 part 6, round 4 (engineer D), on the lent H200 in ONE call after staging (call 1
# unpacks .device/big into /tmp/site; this call carries .device/wheels, the reference wheel
# and this tree): the persistent softmax backward's variants against the default at
# 32768x4096 in one process (tune_k4d.py; --apply adopts the winner for the "small" class),
# the GPU tiers on the tree so decided, then the fair bench_kernels.py on softmax_bwd at
# every shape with torch.compile and the reference in the same process. Logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
WHEELS=${WHEELS:-../../.device/wheels}
REFWHL=${REFWHL:-../refwhl}
test -d /tmp/site/nvidia_cutlass_dsl || { echo "not staged"; exit 3; }
if [ ! -d /tmp/site/tvm_ffi ]; then for w in "$WHEELS"/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done; fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip.log" 2>&1 || echo "pip failed"
python3 -m pip install -q --no-deps --no-index --target /tmp/ref "$REFWHL"/*.whl >> "$OUT/pip.log" 2>&1 || echo "ref pip failed"
export QUACK_CACHE_DIR=/tmp/qk4d
T0=$SECONDS
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t))s (at $((SECONDS - T0))s) | $(grep -E '(passed|failed|error).* in [0-9.]+s' "$OUT/$name.log" | tail -1)"; }
if [ "${SWEEP:-1}" = 1 ]; then
step sweep "${SWEEP_LIMIT:-50}" python3 benchmarks/tune_k4d.py --jobs 16 --workdir /tmp/tune_k4d --rounds 2 --allocs 3 \
  --json "$OUT/decisions.json" --apply
grep -vE "Warning|warn" "$OUT/sweep.log" | tail -16
fi
sha256sum kernels/softmax.py | cut -c1-16; grep "^DEFAULTS" kernels/softmax.py
cp kernels/softmax.py "$OUT/softmax.py.decided"
step tests "${TEST_LIMIT:-110}" python3 -m pytest -q -p no:cacheprovider --async-compile=16 -rf \
  tests/kernels tests/test_gpu_roundtrip.py
grep -E "^(FAILED|ERROR)|^quack:" "$OUT/tests.log" | head -20
tail -3 "$OUT/tests.log"
if [ $((SECONDS - T0)) -lt "${BENCH_BEFORE:-175}" ]; then
  step bench "${BENCH_LIMIT:-70}" python3 benchmarks/bench_kernels.py --reps 20 --allocs 3 \
    --ops softmax_bwd --shapes "${BENCH_SHAPES:-32768x4096,32768x16384,32768x65536,4096x262144}" \
    --compile-ops softmax_bwd --ref /tmp/ref --ref-ops softmax_bwd \
    --ref-timeout "${REF_TIMEOUT:-60}" --json "$OUT/bench.json"
  grep -vE "Warning|warn" "$OUT/bench.log" | tail -14
fi
exit 0
