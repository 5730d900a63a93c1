#!/usr/bin/env bash
# Issue 14 part 6, round 5 (engineer E: softmax backward at 32768x4096), on the lent H200 in
# ONE call after staging (call 1 unpacks .device/big into /tmp/site; this call carries
# .device/wheels, the reference wheel and this tree with the variants compiled ahead:
# `tune_k5e.py --compile-only --workdir .tune_k5`): the variants side by side with
# torch.compile in one process (DUMP=1: torch.compile's Triton kernels dumped: Inductor's and
# Triton's cache dirs packed into $OUT/dump.tgz, TORCH_LOGS=output_code in sweep.log;
# inductor.json: the configurations its autotuners kept, registers), the rule applied to softmax.DEFAULTS["small"] (tune_k5e.py --apply), the GPU tiers on the
# tree so decided, then (time permitting) the fair bench_kernels.py on softmax_bwd.
# Apply the same edit to a checkout with `python benchmarks/tune_k5e.py --apply-from FILE`.
set -uo pipefail
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
WHEELS=${WHEELS:-../../.device/wheels}
REFWHL=${REFWHL:-../refwhl}
test -d /tmp/site/nvidia_cutlass_dsl || { echo "not staged"; exit 3; }
if [ ! -d /tmp/site/tvm_ffi ]; then for w in "$WHEELS"/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done; fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip.log" 2>&1 || echo "pip failed"
python3 -m pip install -q --no-deps --no-index --target /tmp/ref "$REFWHL"/*.whl >> "$OUT/pip.log" 2>&1 || echo "ref pip failed"
export QUACK_CACHE_DIR=/tmp/qk5e
T0=$SECONDS
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t))s (at $((SECONDS - T0))s) | $(grep -E '(passed|failed|error).* in [0-9.]+s' "$OUT/$name.log" | tail -1)"; }
if [ "${SWEEP:-1}" = 1 ]; then
  if [ "${DUMP:-0}" = 1 ]; then  # torch.compile's kernels: Inductor's and Triton's caches, packed
    export TORCHINDUCTOR_CACHE_DIR=/tmp/k5e-ind TRITON_CACHE_DIR=/tmp/k5e-triton TORCH_LOGS=output_code
  fi
  step sweep "${SWEEP_LIMIT:-150}" python3 benchmarks/tune_k5e.py --jobs 16 --workdir .tune_k5 \
    --set "${SET:-r2}" --rounds "${ROUNDS:-3}" --allocs 3 --json "$OUT/decisions.json" --dump "$OUT" ${APPLY---apply}
  grep -E "^(decide|kernels/|\[compiled|compile .* failed|load .* failed)|FAILED|TB/s" "$OUT/sweep.log" | cut -c1-200
  if [ "${DUMP:-0}" = 1 ]; then
    rm -rf /tmp/k5e-ind/fxgraph /tmp/k5e-ind/aotautograd; find /tmp/k5e-triton -name "*.cubin" -delete
    tar -czf "$OUT/dump.tgz" -C /tmp k5e-ind k5e-triton
  fi
  unset TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR TORCH_LOGS
fi
grep -nE "^DEFAULTS" kernels/softmax.py; sha256sum kernels/softmax.py | cut -c1-16
if [ "${TESTS:-1}" = 1 ]; then
  step tests "${TEST_LIMIT:-130}" python3 -m pytest -q -p no:cacheprovider --async-compile=16 -rf \
    tests/kernels tests/test_gpu_roundtrip.py
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
  tail -c 600 "$OUT/tests.log" | grep -E "passed|failed|skipped" | tail -2
fi
if [ $((SECONDS - T0)) -lt "${BENCH_BEFORE:-150}" ]; then
  step bench "${BENCH_LIMIT:-80}" python3 benchmarks/bench_kernels.py --reps 20 --allocs 3 --no-eager \
    --ops softmax_bwd --shapes "${BENCH_SHAPES:-32768x4096,32768x16384}" \
    --compile-ops softmax_bwd --ref /tmp/ref --ref-ops softmax_bwd --ref-timeout 70 --json "$OUT/bench.json"
  grep -vE "Warning|warn" "$OUT/bench.log" | tail -8
fi
exit 0
