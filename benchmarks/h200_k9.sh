#!/usr/bin/env bash
# Issue 14 part 6, round 9: device call after staging (/tmp/site from .device/big):
# compile the round's variants (benchmarks/prof_k9.py), time them in $PROCS processes,
# then the norm GPU tests (--async-compile) unless TESTS=0. Logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
test -d /tmp/site/nvidia_cutlass_dsl || { echo "not staged"; exit 3; }
if [ ! -d /tmp/site/tvm_ffi ]; then for w in .device/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done; fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip.log" 2>&1 || echo "pip failed"
T0=$SECONDS
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t))s (at $((SECONDS - T0))s)"; }
step compile ${COMPILE_LIMIT:-120} python3 benchmarks/prof_k9.py --compile --jobs 16 ${GROUPS_ARG:-}
grep -E "compiled|failed" "$OUT/compile.log" | tail -5
for i in $(seq 1 ${PROCS:-2}); do
  step "time$i" ${TIME_LIMIT:-90} python3 benchmarks/prof_k9.py --time --rounds ${ROUNDS:-3} ${GROUPS_ARG:-}
  grep -E "TB/s|FAILED|Error" "$OUT/time$i.log" | sed -E 's/ +/ /g'
done
if [ "${TESTS:-1}" = 1 ]; then
  step tests ${TEST_LIMIT:-240} python3 -m pytest -q -p no:cacheprovider -x --async-compile=16 -rf ${TEST_ARGS:-tests/kernels -k "rmsnorm or layernorm"}
  tail -3 "$OUT/tests.log"
fi
echo "total $((SECONDS - T0))s"
exit 0
