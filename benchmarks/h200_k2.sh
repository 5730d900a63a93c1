#!/usr/bin/env bash
# Issue 14 part 6, round 2, on the lent H200 in ONE call after staging (call 1 unpacks
# .device/big into /tmp/site; this call carries .device/wheels): the variants side by side
# with the rules applied to the kernels' defaults (tune_k2.py --apply), then the GPU tiers
# on the tree so decided, then bench_kernels.py on the ops concerned. The GPU tiers'
# configurations build in the background at low priority during the sweep (the kernels
# whose sources the decisions leave alone stay valid). Logs and decisions.json under $OUT;
# apply the same edits to a checkout with `python benchmarks/tune_k2.py --apply-from FILE`.
# SWEEP=0 BENCH_BEFORE=0: the GPU tiers only, on the tree as it is.
set -uo pipefail
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
WHEELS=${WHEELS:-.device/wheels}
test -d /tmp/site/nvidia_cutlass_dsl || { echo "not staged"; exit 3; }
if [ ! -d /tmp/site/tvm_ffi ]; then for w in "$WHEELS"/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done; fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip.log" 2>&1 || echo "pip failed"
export QUACK_CACHE_DIR=/tmp/qk2
T0=$SECONDS
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t))s (at $((SECONDS - T0))s) | $(grep -E '(passed|failed|error).* in [0-9.]+s' "$OUT/$name.log" | tail -1)"; }
if [ "${SWEEP:-1}" = 1 ]; then  # SWEEP=0: the GPU tiers alone (a verification run)
# own process group (setsid): the build and its workers end together below
setsid nice -n 19 timeout 300 python3 -m quack_build build -j 12 -k manifests/training.toml manifests/tests.toml \
  > "$OUT/build.log" 2>&1 &
BPID=$!
step sweep "${SWEEP_LIMIT:-100}" python3 benchmarks/tune_k2.py --jobs 16 --json "$OUT/decisions.json" --apply
grep -E "^(occupancy|decide|kernels/|\[compiled|compile .* failed)" "$OUT/sweep.log"
grep -vE "Warning|warn|^(occupancy|decide|kernels/|\[)" "$OUT/sweep.log" | tail -70
kill -- -"$BPID" 2>/dev/null; sleep 1; kill -9 -- -"$BPID" 2>/dev/null
echo "background build: $(grep -cE '^ *(ok|compiled)' "$OUT/build.log") lines; $(tail -c 300 "$OUT/build.log" | tr '\n' ' ')"
fi
sha256sum kernels/_norm_fwd.py kernels/_norm_bwd.py kernels/softmax.py | cut -c1-16
step tests "${TEST_LIMIT:-130}" python3 -m pytest -q -p no:cacheprovider --async-compile=16 -rf \
  tests/kernels/test_training_gpu.py tests/kernels/test_kernels_gpu.py tests/kernels/test_reference_hooks.py
grep -E "^(FAILED|ERROR)|^quack:" "$OUT/tests.log" | head -30
if [ $((SECONDS - T0)) -lt "${BENCH_BEFORE:-200}" ]; then
  step bench "${BENCH_LIMIT:-45}" python3 benchmarks/bench_kernels.py --reps 20 --no-compile --no-eager \
    --ops "${BENCH_OPS:-rmsnorm_fwd_w32,layernorm_fwd,layernorm_fwd_w32,layernorm_bwd_w32,softmax_bwd,rmsnorm_fwd}" \
    --json "$OUT/bench.json"
  grep -vE "Warning|warn" "$OUT/bench.log" | tail -30
fi
exit 0
