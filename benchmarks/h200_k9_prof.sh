#!/usr/bin/env bash
# Issue 14 part 6, round 9: one launch each of prof_k9.py's variants under Nsight Compute
# (--clock-control none, caches flushed before each replay pass). Under $OUT: details.txt.
set -uo pipefail
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
test -d /tmp/site/nvidia_cutlass_dsl || { echo "not staged"; exit 3; }
if [ ! -d /tmp/site/tvm_ffi ]; then for w in .device/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done; fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip.log" 2>&1 || echo "pip failed"
timeout -k 5 90 python3 benchmarks/prof_k9.py --compile --jobs 16 > "$OUT/compile.log" 2>&1; tail -1 "$OUT/compile.log"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || ls /usr/local/cuda/bin/ncu)
SECS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section Occupancy \
--section LaunchStats --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats \
--section SourceCounters"
t=$SECONDS
timeout -k 5 ${NCU_LIMIT:-150} $NCU --clock-control none --profile-from-start off --target-processes application-only \
  $SECS -o "$OUT/prof" -f python3 benchmarks/prof_k9.py --profile > "$OUT/ncu.log" 2>&1
echo "ncu: rc=$? $((SECONDS - t))s"; grep -E "profiled|==ERROR" "$OUT/ncu.log" | head
if [ -f "$OUT/prof.ncu-rep" ]; then
  $NCU -i "$OUT/prof.ncu-rep" --page details > "$OUT/details.txt" 2>&1
  $NCU -i "$OUT/prof.ncu-rep" --page raw --csv > "$OUT/raw.csv" 2>&1
fi
exit 0
