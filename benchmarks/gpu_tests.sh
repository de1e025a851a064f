#!/usr/bin/env bash
# Every GPU test of the project on one GPU, in five device calls of under 10 minutes each
# (the device machine's limit per command). Measured on the H200, per file:
#     bash benchmarks/gpu_tests.sh a   # bridge with Megatron 150 s, batch invariance 245 s,
#                                      # large sizes 15 s, fused head's bridge 15 s, the
#                                      # fused head's GPU tests
#     bash benchmarks/gpu_tests.sh b   # Mosaic kernels 400 s, Triton/XLA 20 s, sharding 35 s,
#                                      # bool masks in place, the shared backend suite
#     bash benchmarks/gpu_tests.sh c   # the bridge's direct route ~370 s (incl. 4 batch-
#                                      # invariance tests at T = 8192, ~60 s each), and the
#                                      # PPO example (50 steps against float64 and Megatron)
#     bash benchmarks/gpu_tests.sh d1  # the default's promise across entry points, batches
#     bash benchmarks/gpu_tests.sh d2  # 1, 7, 100 (d1) and 1000, 8191, 8192 (d2), each
#                                      # against T = 8193: past 370 s with JOBS=4 on an H100
#                                      # all in one, so a call each (d: both, one after the other)
#     bash benchmarks/gpu_tests.sh b d # several groups, one after the other
# JOBS=N (optional; needs pytest-xdist, which the device image has): N test processes share
# the one GPU, with XLA_PYTHON_CLIENT_ALLOCATOR=platform so that each test's memory goes back
# (with XLA's caching allocator, 8 processes ran the Mosaic kernels' T = 8192 tests, now
# test_mosaic_gpu.py, out of memory on the H200). On an H100: test_batch_invariance.py -m gpu
# with 6 processes 68 s (245 s in one on the H200), the log-prob tests (then one file,
# test_logprob_entropy.py) with 8 54 s, test_sharding_gpu.py with 4 22 s; the linear files
# with 6 had one failure that the cut log did not name, so run those alone when a failure
# must be told apart from the sharing.
# carry: .whl (a megatron-core wheel for the device's Python). Each file (or the files one
# test file was split into, run together) runs under its own time limit, so one slow file
# cannot hide the others' results; logs (with pytest's slowest durations) go to
# $OUT/<first file>.log and one summary line per run is printed. The tests mirror the
# packages: tests/jaxops (the JAX op), tests/bridge (the PyTorch bridge).
set -u
OUT=${OUT:-/tmp/gpu_tests}
mkdir -p "$OUT" /tmp/site
if ls .whl/megatron_core-*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/megatron_core-*.whl
else
    echo "no .whl/megatron_core-*.whl: the Megatron parity tests will fail" >&2
fi
# EXTRA_SITE=DIR (optional): packages in front of the image's, e.g. another JAX carried in
# with benchmarks/tools/wheel_parts.sh.
export PYTHONPATH=${EXTRA_SITE:+$EXTRA_SITE:}/tmp/site:$PWD PYTHONUNBUFFERED=1 \
    XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -n 1
PARALLEL=()
if [ -n "${JOBS:-}" ]; then
    PARALLEL=(-n "$JOBS")
    export XLA_PYTHON_CLIENT_ALLOCATOR=platform
fi
run() {  # run SECONDS FILE [FILE ...] [pytest args...]
    local limit=$1 file=$2; shift 2
    local log="$OUT/$(basename "$file" .py)${LOG_SUFFIX:-}.log" t0=$(date +%s) more=0 arg
    for arg in "$@"; do [[ $arg == *.py ]] && more=$((more + 1)); done
    timeout "$limit" python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfs \
        --durations=5 ${PARALLEL[@]+"${PARALLEL[@]}"} "$file" "$@" > "$log" 2>&1
    local rc=$?
    [ $more -gt 0 ] && file="$file (+$more)"
    echo "== $file rc=$rc $(( $(date +%s) - t0 ))s: $(grep -E '(passed|failed|error)' "$log" | tail -n 1)"
    [ $rc = 124 ] && echo "   (time limit $limit s hit: $(grep -cE '^\.|^F' "$log") progress lines)"
}
example() {  # example SECONDS SCRIPT [args...]
    local limit=$1 script=$2; shift 2
    local log="$OUT/$(basename "$script" .py).log" t0=$(date +%s)
    timeout "$limit" python3 "$script" "$@" > "$log" 2>&1
    echo "== $script rc=$? $(( $(date +%s) - t0 ))s: $(tail -n 1 "$log")"
}
# Files split by topic from one test file each: their GPU tests run together, as before.
LOGPROB=(tests/jaxops/test_logprob_{entropy,tiles,masks,extremes,bad_calls,staged}.py)
MOSAIC=(tests/jaxops/test_mosaic{,_dispatch,_lowering,_gpu}.py)
LINEAR_HEAD=(tests/jaxops/test_linear_head{,_fused,_lowering}.py)
[ $# -gt 0 ] || { echo "usage: bash benchmarks/gpu_tests.sh a|b|c|d|d1|d2 [more groups]" >&2; exit 2; }
for group in "$@"; do
case "$group" in
    a)
        run 170 tests/bridge/test_bridge_cuda.py
        run 290 tests/jaxops/test_batch_invariance.py -m gpu
        run 40 tests/jaxops/test_large_sizes.py -m gpu
        run 40 tests/bridge/test_bridge_linear.py -k cuda
        run 120 "${LINEAR_HEAD[@]}" -m gpu  # the GPU tests are in test_linear_head_fused.py
        ;;
    b)
        run 450 "${MOSAIC[@]}" -m gpu  # the GPU tests are in test_mosaic_gpu.py
        run 50 "${LOGPROB[@]}" -m gpu
        run 60 tests/jaxops/test_sharding_gpu.py
        run 90 tests/jaxops/test_mask_view.py -m gpu  # H100: 9 passed, 97 s
        run 60 tests/jaxops/test_backends.py  # every registry backend compiled: H100 36 passed, 17 s
        ;;
    c)
        run 420 tests/bridge/test_bridge_direct.py
        example 120 examples/torch_ppo_loop.py --device cuda
        ;;
    d|d1|d2)
        # The same rows of a batch of 8193 are the reference in both halves.
        [ "$group" = d2 ] || JAXOPS_PROMISE_T=1,7,100,8193 LOG_SUFFIX=_d1 \
            run 560 tests/bridge/test_default_batch_invariance.py -m gpu
        [ "$group" = d1 ] || JAXOPS_PROMISE_T=1000,8191,8192,8193 LOG_SUFFIX=_d2 \
            run 560 tests/bridge/test_default_batch_invariance.py -m gpu
        ;;
    *)
        echo "usage: bash benchmarks/gpu_tests.sh a|b|c|d|d1|d2 [more groups]" >&2
        exit 2
        ;;
esac
done
