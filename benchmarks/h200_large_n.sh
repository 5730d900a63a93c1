#!/usr/bin/env bash
# Issue 14 part 6 on the lent H200, in one call after staging (../shared/device/README.md:
# call 1 unpacks .device/big into /tmp/site; this call carries .device/wheels and the
# reference wheel): the large-row kernel variants side by side (tune_large_n.py) while the
# CPU builds the configurations, the GPU tiers, then ours vs the reference library
# (bench_kernels.py --ref). Logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
WHEELS=${WHEELS:-.device/wheels}
REF_WHL=${REF_WHL:-.peer/refwhl/quack_kernels-0.6.4-py3-none-any.whl}
test -d /tmp/site/nvidia_cutlass_dsl || { echo "not staged"; exit 3; }
if [ ! -d /tmp/site/tvm_ffi ]; then for w in "$WHEELS"/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done; fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip.log" 2>&1 || echo "pip failed"
python3 -m pip install -q --no-deps --no-index --target /tmp/ref "$REF_WHL" > "$OUT/refpip.log" 2>&1 || echo "ref pip failed"
python3 -c "import torch, cutlass; print(torch.cuda.get_device_name(), cutlass.__version__, torch.__version__)"
export QUACK_CACHE_DIR=/tmp/qk
T0=$SECONDS
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t))s (at $((SECONDS - T0))s) | $(grep -E '(passed|failed|error).* in [0-9.]+s' "$OUT/$name.log" | tail -1)"; }
cat > /tmp/bench.toml <<'TOML'
[defaults]
archs = ["sm_90a"]
[[kernel]]
name = "rmsnorm_fwd"
[kernel.params]
dtype = "bfloat16"
n = [4096, 16384, 65536, 262144]
has_weight = true
weight_dtype = ["same", "float32"]
[[kernel]]
name = "layernorm_fwd"
[kernel.params]
dtype = "bfloat16"
n = [4096, 16384, 65536, 262144]
weight_dtype = ["same", "float32"]
[[kernel]]
name = "layernorm_bwd"
[kernel.params]
dtype = "bfloat16"
n = [4096, 16384, 65536, 262144]
weight_dtype = ["same", "float32"]
[[kernel]]
name = "softmax_fwd"
[kernel.params]
dtype = "bfloat16"
n = [4096, 16384, 65536, 262144]
[[kernel]]
name = "softmax_bwd"
[kernel.params]
dtype = "bfloat16"
n = [4096, 16384, 65536, 262144]
TOML
# CPU: build the bench configurations first, then the GPU tiers' (tests overlap their own
# compiles too), while the GPU runs the variant sweep
(timeout "${BUILD_LIMIT:-200}" python3 -m quack_build build -j 12 -k /tmp/bench.toml manifests/training.toml manifests/tests.toml > "$OUT/build.log" 2>&1; echo "build rc=$?" >> "$OUT/build.log") &
BPID=$!
step sweep "${SWEEP_LIMIT:-110}" python3 benchmarks/tune_large_n.py "${SWEEP:-wrapper,flush,ring_grids,softmax,rmsnorm,layernorm,ln_bwd}"
grep -vE "Warning|warn" "$OUT/sweep.log" | tail -75
for i in $(seq 1 30); do kill -0 $BPID 2>/dev/null || break; sleep 1; done
tail -3 "$OUT/build.log"
step tests "${TEST_LIMIT:-110}" python3 -m pytest -q -p no:cacheprovider --async-compile=16 -rf \
  tests/kernels/test_training_gpu.py tests/kernels/test_kernels_gpu.py tests/kernels/test_reference_hooks.py
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30
step bench "${BENCH_LIMIT:-110}" python3 benchmarks/bench_kernels.py --reps 20 --no-compile --no-eager \
  --ops "${BENCH_OPS:-softmax_bwd,softmax_fwd,rmsnorm_fwd,rmsnorm_fwd_w32,layernorm_fwd,layernorm_fwd_w32,layernorm_bwd,layernorm_bwd_w32}" \
  --ref /tmp/ref --ref-ops "${REF_OPS:-softmax_bwd,softmax_fwd,rmsnorm_fwd,layernorm_fwd}" --ref-timeout 80 --json "$OUT/bench.json"
grep -vE "Warning|warn" "$OUT/bench.log" | tail -45
kill $BPID 2>/dev/null
exit 0
