#!/usr/bin/env bash
# Issue 14 on the lent H200, in one call after staging (../shared/device/README.md: call 1
# unpacks .device/big into /tmp/site; this call carries .device/wheels): build the training
# matrix, run the kernel GPU tiers (old + training), then the side-by-side figures.
# Logs go to $OUT. STEPS picks steps (default: all): build,tests,bench.
set -uo pipefail
STEPS=${STEPS:-build,tests,bench,variants}
. benchmarks/h200_stage.sh
export QUACK_CACHE_DIR=${QUACK_CACHE_DIR:-/tmp/qtrain}
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t))s | $(grep -E '(passed|failed|error).* in [0-9.]+s' "$OUT/$name.log" | tail -1)"; }
case ",$STEPS," in *,build,*)
  step build "${BUILD_LIMIT:-150}" python3 -m quack_build build -j 16 -k manifests/training.toml manifests/tests.toml
  tail -4 "$OUT/build.log";; esac
case ",$STEPS," in *,tests,*)
  step tests "${TEST_LIMIT:-300}" python3 -m pytest -q -p no:cacheprovider --async-compile=16 -rf \
    tests/kernels/test_training_gpu.py tests/kernels/test_kernels_gpu.py tests/kernels/test_reference_hooks.py
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -40
  grep -E "^quack:" "$OUT/tests.log" | tail -2;; esac
case ",$STEPS," in *,bench,*)
  step bench "${BENCH_LIMIT:-200}" python3 benchmarks/bench_kernels.py --reps 20 \
    --ops "${BENCH_OPS:-layernorm_bwd,layernorm_bwd_w32,rmsnorm_fwd,rmsnorm_fwd_w32,rmsnorm_bwd,rmsnorm_bwd_w32,layernorm_fwd,layernorm_fwd_w32,softmax_fwd,softmax_bwd,cross_entropy_fwd,cross_entropy_bwd}" \
    --compile-ops "${COMPILE_OPS:-layernorm_bwd,layernorm_bwd_w32}" --json "$OUT/bench.json"
  grep -vE "Warning|warn" "$OUT/bench.log" | tail -52;; esac
case ",$STEPS," in *,variants,*)
  step tune "${TUNE_LIMIT:-300}" python3 -m quack_build tune manifests/tuning.toml --kernel "${TUNE_KERNEL:-rmsnorm_fwd}" --table "$OUT/tuned.toml"
  grep -E "^(cross_entropy_bwd|rmsnorm_fwd)" "$OUT/variants.log";; esac
