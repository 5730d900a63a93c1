#!/usr/bin/env bash
# Issue 14 part 6, round 3 (norm forwards), on the lent H200 in ONE call after staging
# (call 1 unpacks .device/big into /tmp/site; this call carries .device/wheels and
# .peer/refwhl): the variants side by side with the rules applied to the kernels' defaults
# (tune_k3.py --apply), the GPU tiers on the tree so decided (the other kernels' keys build
# in the background at low priority during the sweep), then bench_kernels.py with the
# reference library on RMSNorm fwd 4096x262144 (SWEEP=0 BENCH=0: the GPU tiers alone). Logs and decisions.json under $OUT; apply
# the same edits to a checkout with `python benchmarks/tune_k3.py --apply-from FILE`.
set -uo pipefail
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
ROOT=${ROOT:-../..}  # the device checkout's root (.device/, .peer/refwhl)
test -d /tmp/site/nvidia_cutlass_dsl || { echo "not staged"; exit 3; }
if [ ! -d /tmp/site/tvm_ffi ]; then for w in "$ROOT"/.device/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done; fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip.log" 2>&1 || echo "pip failed"
if [ "${SWEEP:-1}" = 1 ] || [ "${BENCH:-1}" = 1 ]; then
python3 -m pip install -q --no-deps --no-index --target /tmp/ref "$ROOT"/.peer/refwhl/*.whl >> "$OUT/pip.log" 2>&1 || echo "ref pip failed"
# the reference under the import name quackref, for the sweep's in-process comparison
rm -rf /tmp/refq && mkdir -p /tmp/refq && cp -r /tmp/ref/quack /tmp/refq/quackref \
  && find /tmp/refq/quackref -name "*.py" -print0 | xargs -0 sed -i -E 's/^(\s*)(from|import) quack(\.|\s|$)/\1\2 quackref\3/'
fi
export QUACKREF_DIR=/tmp/refq QUACK_CACHE_DIR=/tmp/qk3a
T0=$SECONDS
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t))s (at $((SECONDS - T0))s) | $(grep -E '(passed|failed|error).* in [0-9.]+s' "$OUT/$name.log" | tail -1)"; }
if [ "${SWEEP:-1}" = 1 ]; then  # SWEEP=0 BENCH=0: the GPU tiers alone (a verification run)
setsid nice -n 19 timeout 200 python3 -m quack_build build -j 8 -k manifests/training.toml manifests/tests.toml \
  > "$OUT/build.log" 2>&1 &
BPID=$!
step sweep "${SWEEP_LIMIT:-110}" env QUACK_CACHE_DIR=/tmp/qk3a_sweep python3 benchmarks/tune_k3.py --jobs 16 --rounds 3 --json "$OUT/decisions.json" --apply
grep -E "^(decide|kernels/|\[compiled|compile .* failed)|FAILED" "$OUT/sweep.log"
grep -E "TB/s" "$OUT/sweep.log"
kill -- -"$BPID" 2>/dev/null; sleep 1; kill -9 -- -"$BPID" 2>/dev/null
echo "background build: $(tail -c 200 "$OUT/build.log" | tr '\n' ' ')"
fi
grep -nE "^(RING_CLUSTERLESS|RING_SHAPE|X_SMEM)" kernels/_norm_fwd.py kernels/rmsnorm.py; sha256sum kernels/_norm_fwd.py kernels/rmsnorm.py | cut -c1-16
step tests "${TEST_LIMIT:-130}" python3 -m pytest -q -p no:cacheprovider --async-compile=16 -rf \
  tests/kernels tests/test_gpu_roundtrip.py
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
if [ "${BENCH:-1}" = 1 ] && [ $((SECONDS - T0)) -lt "${BENCH_BEFORE:-210}" ]; then
  step bench "${BENCH_LIMIT:-40}" python3 benchmarks/bench_kernels.py --reps 20 --no-compile --no-eager \
    --ops rmsnorm_fwd --shapes 4096x262144 --ref /tmp/ref --ref-timeout 30 --json "$OUT/bench.json"
  grep -vE "Warning|warn" "$OUT/bench.log" | tail -6
fi
exit 0
