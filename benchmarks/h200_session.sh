#!/usr/bin/env bash
# The figures of the closing notes, in one call on the lent H200 after staging
# (../shared/device/README.md: call 1 unpacks .device/big into /tmp/site, this is
# call 2, carrying .device/wheels). Logs go to $OUT; a short table is printed last.
set -uo pipefail
. benchmarks/h200_stage.sh
SUITE="tests/kernels tests/test_gpu_roundtrip.py"
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t))s | $(grep -E '(passed|failed|error).* in [0-9.]+s' "$OUT/$name.log" | tail -1)"; }
export QUACK_CACHE_DIR=/tmp/qsuite
step suite_cold_async 160 python3 -m pytest -q -p no:cacheprovider --async-compile=16 $SUITE
grep -E "^quack:" "$OUT/suite_cold_async.log" | tail -2
step suite_warm 100 python3 -m pytest -q -p no:cacheprovider $SUITE
grep -E "^quack:" "$OUT/suite_warm.log" | tail -2
step build_scaling 100 python3 benchmarks/bench_build.py --jobs 1 4 8 16 --manifest manifests/default.toml --packages kernels
tail -12 "$OUT/build_scaling.log"
step verify_run 75 bash -c "python3 -m quack_build build -j 16 && python3 -m quack_build verify --run"
tail -8 "$OUT/verify_run.log"
if [ "${RUN_TUNE:-0}" = 1 ]; then
  step tune 600 python3 -m quack_build tune manifests/tuning.toml --from-empty --table "$OUT/tuned.toml" --json
  tail -30 "$OUT/tune.log"
fi
