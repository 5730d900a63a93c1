#!/usr/bin/env bash
# Issue 14 part 6, round 8 (engineer I): the decided tree re-measured at 16384 (and 14336) in
# PROCS processes x ROUNDS rounds: same-dtype default, the new fp32-w default ("w32 (default)")
# and round 5-7's "xs2 mb3" side by side (benchmarks/tune_k8i.py --cands). Logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
ROOT=${ROOT:-../..}
test -d /tmp/site/nvidia_cutlass_dsl || { echo "not staged"; exit 3; }
if [ ! -d /tmp/site/tvm_ffi ]; then for w in "$ROOT"/.device/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done; fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip.log" 2>&1 || echo "pip failed"
grep -nE "^ROW_CTA: dict" kernels/_ln_row.py
for p in $(seq 1 "${PROCS:-5}"); do
  timeout -k 5 60 python3 benchmarks/tune_k8i.py --jobs 16 --rounds "${ROUNDS:-5}" --ns 16384,14336 \
    --cands "xs2 mb3" --json "$OUT/confirm$p.json" > "$OUT/confirm$p.log" 2>&1 || echo "confirm$p rc=$?"
  grep -E " us " "$OUT/confirm$p.log" | sed -E 's/ +/ /g; s/grid 1 \(api 1\) //'
done
exit 0
