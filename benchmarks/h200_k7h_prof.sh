#!/usr/bin/env bash
# Issue 14 part 6, round 7 (engineer H), device call 1 after staging: the misses at
# 4096x262144 timed side by side (benchmarks/prof_k7h.py), one launch of each under Nsight
# Compute (--clock-control none; caches flushed before each replay pass, ncu's default),
# then LayerNorm 32768x4096 same / fp32 w + b re-measured in 3 processes. Under $OUT:
# prof.ncu-rep, details.txt (--page details), raw.csv (--page raw), logs.txt.
set -uo pipefail
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
ROOT=${ROOT:-../..}
test -d /tmp/site/nvidia_cutlass_dsl || { echo "not staged"; exit 3; }
if [ ! -d /tmp/site/tvm_ffi ]; then for w in "$ROOT"/.device/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done; fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/logs.txt" 2>&1 || echo "pip failed"
T0=$SECONDS
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS
  echo "=== $name" >> "$OUT/logs.txt"
  timeout -k 5 "$limit" "$@" >> "$OUT/logs.txt" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t))s (at $((SECONDS - T0))s)"; }
step compile 90 python3 benchmarks/prof_k7h.py --compile --jobs 16
grep -E "compiled|failed" "$OUT/logs.txt"
step time 60 python3 benchmarks/prof_k7h.py --time --rounds 3 --groups p262144
grep -E "TB/s|FAILED" "$OUT/logs.txt" | sed -E 's/ +/ /g'
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || ls /usr/local/cuda/bin/ncu)
echo "ncu: $NCU $($NCU --version | tail -1)"
SECS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Chart \
--section MemoryWorkloadAnalysis_Tables --section Occupancy --section LaunchStats --section WarpStateStats \
--section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats"
t=$SECONDS
timeout -k 5 ${NCU_LIMIT:-200} $NCU --clock-control none --profile-from-start off --target-processes application-only \
  $SECS -o "$OUT/prof" -f python3 benchmarks/prof_k7h.py --profile > "$OUT/ncu.log" 2>&1
echo "ncu: rc=$? $((SECONDS - t))s"; grep -E "profiled|==ERROR|==WARNING" "$OUT/ncu.log" | head -20
if [ -f "$OUT/prof.ncu-rep" ]; then
  $NCU -i "$OUT/prof.ncu-rep" --page details > "$OUT/details.txt" 2>&1
  $NCU -i "$OUT/prof.ncu-rep" --page raw --csv > "$OUT/raw.csv" 2>&1
  $NCU -i "$OUT/prof.ncu-rep" --page details --print-summary per-kernel > "$OUT/summary.txt" 2>&1
  grep -E "^  [a-zA-Z_]|Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Waves Per SM|L2 Hit Rate|Cluster Size|Grid Size|Block Limit|Theoretical Occ|Compute \(SM\) Th" "$OUT/details.txt" | head -150
fi
for i in 1 2 3; do
  step "ln4096_$i" 45 python3 benchmarks/prof_k7h.py --time --rounds 5 --groups "ln 4096"
done
grep -E "^ln 4096 .*TB/s" "$OUT/logs.txt" | sed -E 's/ +/ /g'
echo "total $((SECONDS - T0))s"
exit 0
