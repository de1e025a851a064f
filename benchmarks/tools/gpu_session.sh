#!/usr/bin/env bash
# Everything this project runs on the H200 in one device call (10-minute limit),
# most important first; each step has its own time limit and log under $OUT.
#   carry: .whl (megatron-core wheel for Python 3.12)
# Benchmarks append to benchmarks/results/h200.json (copied to $OUT at the end).
set -u
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT" /tmp/site
if ! ls .whl/megatron_core-*.whl > /dev/null 2>&1; then
    # Without it the Megatron parity tests error and bench.py records Megatron as skipped,
    # replacing measured rows on --append.
    echo "no .whl/megatron_core-*.whl here: call the device with carry=[\".whl\"]" >&2
    exit 2
fi
python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export BENCH_GIT_COMMIT=${BENCH_GIT_COMMIT:-unknown}
step() {  # step NAME SECONDS CMD...
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name rc=$? $(( $(date +%s) - t0 ))s: $(tail -n 1 "$OUT/$name.log")"
}
results=benchmarks/results/h200.json
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
step core_tests ${CORE_S:-110} python3 -m pytest -q -p no:cacheprovider tests/jaxops/test_logprob_*.py ${CORE_K:+-k "$CORE_K"}
step gpu_tests ${GPU_S:-75} python3 -m pytest -q -p no:cacheprovider tests/jaxops/test_sharding_gpu.py tests/bridge/test_bridge_cuda.py
step bench_mask ${MASK_S:-100} python3 -m benchmarks.bench --device-name h200 --quick --append \
    --filter T=8192 --filter V=151936 --filter mask=True \
    --filter impl=jaxops-pallas,jaxops-xla,bridge,jax-jit,torch-eager --out $results
step bridge_overhead ${OVERHEAD_S:-40} python3 -m benchmarks.bridge_overhead --quick --no-compile --out "$OUT"
step bench_sweep ${SWEEP_S:-60} python3 -m benchmarks.bench --device-name h200 --quick --append \
    --filter T=1024,32768 --filter impl=jaxops-pallas,jaxops-xla --out $results
cp $results "$OUT/h200.json"
grep -hE "passed|failed" "$OUT"/core_tests.log "$OUT"/gpu_tests.log | tail -n 4
grep -E "jaxops-pallas" "$OUT"/bench_mask.log "$OUT"/bench_sweep.log | tail -n 16
