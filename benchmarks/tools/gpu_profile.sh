#!/usr/bin/env bash
# Kernel profile and tuning sweep on the H200, one device call (issue 5; docs/performance.md, "Kernel tuning"):
# Nsight Compute sections for the listed kernels (registers, occupancy, DRAM throughput,
# warp stalls), then one tune.py run per argument.
#   VARIANTS="<benchmarks.tools.profile_kernels variants>" bash benchmarks/tools/gpu_profile.sh \
#       "DTYPES|CASES|CONFIGS[|--no-check]" ...
# e.g.  "bfloat16|ent,mask|prefetch=1;scalar_sums=1"  (tune.py runs with --no-default).
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
if [ -n "${VARIANTS:-}" ]; then
    step ncu "${NCU_S:-150}" ncu --clock-control none --kernel-name regex:logprob_entropy \
        --section LaunchStats --section Occupancy --section SpeedOfLight --section WarpStateStats \
        --section MemoryWorkloadAnalysis -f -o "$OUT/prof" \
        python3 -m benchmarks.tools.profile_kernels --variants "$VARIANTS"
    ncu --import "$OUT/prof.ncu-rep" --csv --page details > "$OUT/ncu.csv" 2> /dev/null
    rm -f "$OUT/prof.ncu-rep"  # the CSV holds what we read; keeps the files under the 8 that come back
    # kernel | metric = value, in launch order
    grep -E '"(Registers Per Thread|Achieved Occupancy|DRAM Throughput|Duration)"' "$OUT/ncu.csv" \
        | awk -F'","' '{print $1 "\"", $5, "|", $(NF-2), "=", $NF}'
fi
i=0
for spec in "$@"; do
    IFS='|' read -r dtypes cases configs extra <<< "$spec"
    i=$((i + 1))
    step "tune$i" "${TUNE_S:-200}" python3 -m benchmarks.tools.tune --no-default ${extra:-} \
        --dtypes "$dtypes" --cases "$cases" --configs "$configs" --out /tmp
    grep -E " fwd |FAILED|^check" "$OUT/tune$i.log"
done
