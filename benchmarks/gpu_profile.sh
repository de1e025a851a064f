#!/usr/bin/env bash
# Kernel profile and tuning sweep on the H200, one device call (issue 5, NOTES step 7):
# registers per thread (ptxas on XLA's PTX dump), Nsight Compute sections for the forward
# kernels (occupancy, DRAM throughput, warp stalls), then tune.py timings.
#   VARIANTS: profile_kernels.py variants; TUNE_CONFIGS / TUNE_CASES / TUNE_DTYPES: tune.py
set -u
OUT=${OUT:-/tmp/gpu_profile}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
step() {  # step NAME SECONDS CMD...
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name rc=$? $(( $(date +%s) - t0 ))s: $(tail -n 1 "$OUT/$name.log")"
}
V=${VARIANTS:-"dtype=bf16,case=ent;dtype=bf16,case=noent;dtype=bf16,case=ent,prefetch=1;dtype=bf16,case=noent,prefetch=1;dtype=bf16,case=mask;dtype=bf16,case=mask,prefetch=1;dtype=fp32,case=ent;dtype=bf16,case=ent,phase=fwd_bwd;dtype=bf16,case=ent,phase=fwd_bwd,prefetch=1"}
rm -rf /tmp/xla_dump
step ptx 120 env XLA_FLAGS=--xla_dump_to=/tmp/xla_dump python3 benchmarks/profile_kernels.py --variants "$V"
for f in $(grep -l "logprob_entropy" /tmp/xla_dump/*.ptx 2>/dev/null); do
    echo "## $f"; ptxas -arch=sm_90a -v "$f" -o /dev/null 2>&1 | grep -B1 -A2 "logprob_entropy"
done > "$OUT/ptxas.log" 2>&1
echo "== ptxas: $(grep -c Used "$OUT/ptxas.log") kernels"; grep -E "^## |Used" "$OUT/ptxas.log" | head -n 40
step ncu 180 ncu --clock-control none --kernel-name regex:logprob_entropy \
    --section LaunchStats --section Occupancy --section SpeedOfLight --section WarpStateStats \
    --section MemoryWorkloadAnalysis -f -o "$OUT/prof" python3 benchmarks/profile_kernels.py --variants "$V"
ncu --import "$OUT/prof.ncu-rep" --csv --page details > "$OUT/ncu.csv" 2> "$OUT/ncu_import.log"
grep -E '"(Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Block Limit Registers|DRAM Throughput|Duration|Memory Throughput)"' "$OUT/ncu.csv" \
    | awk -F'","' '{print $5, "|", $(NF-2), "=", $NF}' | head -n 80
step tune 300 python3 benchmarks/tune.py --dtypes "${TUNE_DTYPES:-bfloat16}" --cases "${TUNE_CASES:-ent,noent,mask,mask-noent}" \
    --configs "${TUNE_CONFIGS:-prefetch=1}" --out "$OUT"
grep -E "fwd|FAILED|check|bandwidth" "$OUT/tune.log"
if [ -n "${TUNE_FP32_CONFIGS-prefetch=1}" ]; then
    mkdir -p "$OUT/fp32"
    step tune_fp32 120 python3 benchmarks/tune.py --dtypes float32 --cases ent,mask --no-default --no-check \
        --configs "${TUNE_FP32_CONFIGS-prefetch=1}" --out "$OUT/fp32"
    grep -E "fwd|FAILED" "$OUT/tune_fp32.log"
fi
