#!/usr/bin/env bash
# The GPU tier's figures (docs/performance.md, "Test loop"), in one call on the lent H200
# after staging (../shared/device/README.md: call 1 unpacks .device/big into /tmp/site, this
# is call 2, carrying .device/wheels; ~6 minutes): README command 2, then the warm strict
# tier twice (the first session after README command 2 and a second one), then cold
# `--async-compile=16` from an empty cache. Logs (with --durations) go to $OUT.
set -uo pipefail
STAGE_NEEDS="cryptography" . benchmarks/h200_stage.sh
TIER="tests/kernels tests/test_gpu_roundtrip.py"
# every step bounded: a hang costs its own limit, not the call (its logs still come back)
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t)) s | $(grep -E '(passed|failed|error).* in [0-9.]+s' "$OUT/$name.log" | tail -1)"
  return $rc; }
export QUACK_CACHE_DIR=/tmp/qtier
step build 150 quack build manifests/tests.toml manifests/training.toml || { tail -20 "$OUT/build.log"; exit 4; }
step readme_cmd2 240 python3 -m pytest --quack-prebuilt -n auto -q -p no:cacheprovider
for i in 1 2; do
  step "warm$i" 150 python3 -m pytest --quack-prebuilt -q -p no:cacheprovider --durations=40 $TIER
done
rm -rf /tmp/qtier-cold
QUACK_CACHE_DIR=/tmp/qtier-cold step cold 180 python3 -m pytest --async-compile=16 --quack-prewarm -q \
  -p no:cacheprovider --durations=40 $TIER
grep -E "^quack:" "$OUT/cold.log" | tail -1
