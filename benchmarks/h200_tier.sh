#!/usr/bin/env bash
# The GPU tier's figures (docs/performance.md, "Test loop"), in one call on the lent H200
# after staging (../shared/device/README.md: call 1 unpacks .device/big into /tmp/site, this
# is call 2, carrying .device/wheels; ~6 minutes): README command 2, then the warm strict
# tier twice (the first session after README command 2 and a second one), then cold
# `--async-compile=16` from an empty cache. Logs (with --durations) go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
if [ -d .device/wheels ] && [ ! -f /tmp/site/.wheels-unpacked ]; then
  for w in .device/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
  touch /tmp/site/.wheels-unpacked
fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
# The machine sets it: every import would recompile its source, which users do not pay.
unset PYTHONDONTWRITEBYTECODE
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip.log" 2>&1 \
  || echo "editable install failed: see pip.log"
# Stop before any test when the staging is incomplete: a build of 1,058 configurations
# failing on a missing module costs the whole call.
python3 -c "import cutlass.cute, cryptography, torch; print(torch.cuda.get_device_name(), cutlass.__version__, torch.__version__)" \
  || { echo "not staged: see ../shared/device/README.md"; exit 3; }
TIER="tests/kernels tests/test_gpu_roundtrip.py"
step() { local name=$1; shift; local t=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t)) s | $(grep -E '(passed|failed|error).* in [0-9.]+s' "$OUT/$name.log" | tail -1)"
  return $rc; }
export QUACK_CACHE_DIR=/tmp/qtier
step build quack build manifests/tests.toml manifests/training.toml || { tail -20 "$OUT/build.log"; exit 4; }
step readme_cmd2 python3 -m pytest --quack-prebuilt -n auto -q -p no:cacheprovider
for i in 1 2; do
  step "warm$i" python3 -m pytest --quack-prebuilt -q -p no:cacheprovider --durations=40 $TIER
done
rm -rf /tmp/qtier-cold
QUACK_CACHE_DIR=/tmp/qtier-cold step cold python3 -m pytest --async-compile=16 --quack-prewarm -q \
  -p no:cacheprovider --durations=40 $TIER
grep -E "^quack:" "$OUT/cold.log" | tail -1
