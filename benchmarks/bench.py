#!/usr/bin/env python3
"""Benchmark: log-prob (+ entropy) of softmax(logits / tau), against the HBM roofline and the anchors.

One run, one device, every implementation side by side (docs/design.md §7, §8, issue 5):

  jaxops-pallas   this project's op as callers get it: implementation="pallas", the
                  default (jaxops.backends.registry.pallas_backend: on Hopper the Mosaic GPU
                  kernels for every V_loc TMA tiles, bool masks read in place; Triton
                  before Hopper and for V_loc TMA cannot tile; never a function of T) (jax.jit)
  jaxops-pallas_triton  the Pallas kernels lowered through Triton: the pre-Hopper path (jax.jit)
  jaxops-pallas_mosaic  the Mosaic GPU kernels named explicitly; on Hopper the default's own
                  kernels again, so --filter only (impl=jaxops-pallas_mosaic)     (jax.jit)
  jaxops-pallas_mosaic-u8  the same, the keep mask handed over as uint8 (masked cases;
                  --filter only)                                                   (jax.jit)
  jaxops-xla      this project's op, statistics in fused jnp   (jax.jit)
  bridge          the op called from PyTorch through `bridge.logprob_entropy`
  jax-jit         jax.jit(log_softmax + take + entropy), plain XLA
  torch-compile   torch.compile(log_softmax + gather + entropy)
  torch-eager     the same in eager PyTorch
  megatron        Megatron-core fused_vocab_parallel_cross_entropy, on a clone
                  (log-prob only: no entropy, no mask), TP group of size 1

each with float32 / bfloat16 logits, with / without entropy, with / without a dense
bool keep mask, over a list of (T, V) sizes; V = 151,936 (Qwen) and V_loc = 18,992 (one
shard of TP = 8). Per case and phase (forward, forward+backward) it records the
median time, the roofline time and the ratio, and the peak extra memory, and writes
the JSON after every case (a timeout still leaves results).

    python -m benchmarks.bench --device-name h200 --quick --out $OUT/h200.json
    python -m benchmarks.bench --tiny                 # CPU: tiny sizes (CI runs this)
    python -m benchmarks.bench --dry-run --quick      # list the cases only
    python -m benchmarks.bench --filter impl=jaxops-*,torch-compile --filter dtype=bf16 --filter T=8192
    python -m benchmarks.bench --filter T=1024 --append --out $OUT/h200.json   # add rows

(`python benchmarks/bench.py ...` runs the same.) Modes: full (default on a GPU) = every
combination at every size (256 cases; more than one 10-minute device call: split it with
--filter and --append); --quick = every combination at T = 8192, V = 151,936, then fp32
log-prob-only and bf16 with entropy at T = 32768, 1024 and V_loc (112 cases: the default
"pallas" and the Triton backend next to the anchors; ~6 min incl. compiles, and a
--budget-s guard that starts no case after 450 s); --tiny = CPU smoke run (each Pallas
row once, in interpret mode).
The sizes run in priority order and the JSON is rewritten after every case, so a timeout
still leaves every finished row. On a GPU each size runs in a process of its own
(--process-per-size; size_processes.py says why: XLA's memory pool never shrinks). --budget-s S: no case starts once S seconds have passed
(S = 0: none starts, every row says "skipped: time budget"); --budget-s none: no budget.

The cases are in cases.py, the implementations in impls.py, the measurement rules (also
recorded in the JSON under "method") in runner.py's doc, the roofline and the timing loop
in harness.py.
"""

if __name__ == "__main__" and not __package__:  # run by path: see benchmarks/__init__.py
    import os, sys  # noqa: E401
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import dataclasses
import math
import os
import platform
import sys
import time

from benchmarks import harness
from benchmarks.cases import DEFAULT_PALLAS, IMPLS, build_cases, parse_filters
from benchmarks.harness import HERE, write_json
from benchmarks.results_json import RUN_KEYS, describe, keep_measured, merge_previous

MODE_DEFAULTS = {  # reps, target ms per repetition, max calls per repetition, budget s
    "tiny": (3, 2.0, 4, None), "quick": (7, 30.0, 50, 450), "full": (15, 60.0, 100, None)}


def build_parser():
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Implementations: " + ", ".join(IMPLS) + " (jaxops-pallas is the default "
               "\"pallas\"; jaxops-pallas_mosaic and jaxops-pallas_mosaic-u8 only when "
               "--filter impl= matches them)")
    add = parser.add_argument
    add("--device-name", default=None,
        help="results name, e.g. h200 (default: from the GPU name, or 'cpu')")
    add("--out", default=None, help="results JSON (default benchmarks/results/<device-name>.json)")
    add("--tiny", action="store_true", help="tiny sizes (forced when there is no CUDA GPU)")
    add("--quick", action="store_true",
        help="fewer cases: all combos at T=8192, V=151936; two combos (fp32 log-prob only, bf16 "
             "with entropy; no mask) at the other sizes (fits one 10-minute device call)")
    add("--filter", action="append", default=[],
        help="key=v1,v2 with key in impl (glob), dtype, T, V, entropy, mask; "
             "repeat (or separate with ';') to AND them")
    add("--with-compile", action="store_true",
        help="run torch.compile also in --tiny (slow on CPU)")
    add("--reps", type=int, default=None, help="repetitions (median over them)")
    add("--target-ms", type=float, default=None,
        help="duration of one repetition (sets the calls per repetition)")
    add("--max-calls", type=int, default=None)
    add("--max-input-gb", type=float, default=16.0,
        help="use 2 rotating input sets when they fit in this, else 1")
    add("--budget-s", type=harness.budget_seconds, default=None,
        help="start no new case after this many seconds (rows say so); 0: start none; "
             "'none': no budget (default: 450 with --quick, else none)")
    add("--temperature", type=float, default=1.0,
        help="tau (1.0: Megatron, which takes none, computes the same thing)")
    add("--pallas-config", default="",
        help="PallasConfig fields for the Triton kernels (jaxops-pallas_triton; for "
             "jaxops-pallas, non-default fields pin it to Triton), e.g. "
             "block_v=4096,num_warps=8,prefetch=1; the Mosaic kernels ignore it")
    add("--mosaic-config", default="",
        help="MosaicConfig fields for jaxops-pallas_mosaic, e.g. block_v=256,num_stages=4,"
             "chunk_v=4096 (approx_math takes 0/1)")
    add("--bool-mask-view", action="store_true",
        help="set jaxops.backends.mosaic.mask_view.ENABLED (bool masks read in place by the Mosaic kernels; "
             "already jaxops' default: kept for old command lines)")
    add("--bridge-kwargs", default="",
        help="extra keyword arguments for bridge.logprob_entropy, e.g. "
             "check_targets=False,implementation=pallas (default: none, as callers)")
    add("--append", action="store_true",
        help="add to an existing --out file of the same device (rows measured again replace "
             "the old ones, a case skipped in this run keeps its earlier measured row; each "
             "row records its run)")
    add("--process-per-size", choices=("auto", "on", "off"), default="auto",
        help="run each (T, V) size in a fresh process, so that every size starts on empty "
             "memory pools (size_processes.py; auto: on with a CUDA GPU and several sizes)")
    add("--dry-run", action="store_true", help="list the cases and exit")
    return parser


def raise_compile_cache_limits():
    """torch.compile: one cache entry per (dtype, grad mode, shape class) per function; the
    default limit (8) would silently fall back to eager. The error text, or None."""
    try:
        import torch._dynamo as dynamo
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(dynamo.config, name):
                setattr(dynamo.config, name, 1024)
    except Exception as exc:
        return f"torch.compile cache limits not raised: {harness.short_error(exc)}"
    return None


def resolved_budget(budget_s, mode):
    """--budget-s as seconds, or None for no budget: unset takes the mode's default,
    'none' (parsed as infinity) means none."""
    if budget_s is None:
        return MODE_DEFAULTS[mode][3]
    return None if math.isinf(budget_s) else budget_s


def main(argv=None):
    args = build_parser().parse_args(argv)
    # Environment before JAX starts (runner.py's doc): share the GPU with PyTorch.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")

    filters = parse_filters(args.filter)
    if args.dry_run:  # no GPU needed to list what a mode would run
        mode = "tiny" if args.tiny else ("quick" if args.quick else "full")
        cases = build_cases(mode, filters)
        for case in cases:
            print(case)
        print(f"{len(cases)} cases ({mode})")
        return 0
    from benchmarks import size_processes  # before torch and JAX touch the GPU
    planned = "tiny" if args.tiny else ("quick" if args.quick else "full")
    planned_cases = build_cases(planned, filters)
    if size_processes.wanted(args.process_per_size, planned_cases, planned):
        args.budget_s = resolved_budget(args.budget_s, planned)
        return size_processes.run(sys.argv[1:] if argv is None else argv, args,
                                  planned_cases, planned)
    t_start = time.perf_counter()
    import torch
    import jax
    from benchmarks import tables
    from benchmarks.runner import Bench, print_row

    args.on_gpu = torch.cuda.is_available() and jax.default_backend() == "gpu"
    if not args.on_gpu and not args.tiny:
        print("[bench] no CUDA GPU for both torch and jax: running --tiny", flush=True)
        args.tiny = True
    mode = "tiny" if args.tiny else ("quick" if args.quick else "full")
    defaults = MODE_DEFAULTS[mode]
    args.reps = args.reps or defaults[0]
    args.target_ms = args.target_ms or defaults[1]
    args.max_calls = args.max_calls or defaults[2]
    args.budget_s = resolved_budget(args.budget_s, mode)
    args.pallas_config = (harness.pallas_config(args.pallas_config)
                          if args.pallas_config.strip(" ,") else None)
    args.mosaic_config = (harness.mosaic_config(args.mosaic_config)
                          if args.mosaic_config.strip(" ,") else None)
    args.bridge_kwargs = harness.parse_kwargs(args.bridge_kwargs)
    if args.bool_mask_view:  # before any kernel is traced
        from jaxops.backends.mosaic import mask_view
        mask_view.ENABLED = True
    cases = build_cases(mode, filters)

    gpu_name = (torch.cuda.get_device_name(0) if args.on_gpu
                else platform.processor() or platform.machine() or "cpu")
    device_name = args.device_name or ("cpu" if not args.on_gpu else harness.slug(gpu_name))
    out_path = args.out or os.path.join(HERE, "results", f"{device_name}.json")
    warnings = [w for w in (raise_compile_cache_limits(),) if w]

    bench = Bench(args, torch, jax)
    results = describe(args, mode, filters, torch, jax, gpu_name, device_name,
                       bench.jax_mem().keys(), argv)
    results["default_impl"] = DEFAULT_PALLAS  # report.py heads its tables with this row
    for warning in warnings:  # recorded (results["warnings"]) and printed, never hidden
        print(f"[bench] warning: {warning}", flush=True)
    print(f"[bench] {mode}: {len(cases)} cases on {gpu_name} ({jax.devices()[0]}), jax "
          f"{jax.__version__}, torch {torch.__version__}; writing {out_path}", flush=True)
    bench.bandwidth = results["bandwidth"] = bench.measure_bandwidth()
    bw = results["bandwidth"]
    print("[bench] copy bandwidth (read + write): " + ", ".join(
        f"{k[:-4]} {bw[k] / 1e12:.3f} TB/s" for k in bw if k.endswith("_Bps") and k != "used_Bps")
        + f"; roofline uses {bw['used'][:-4]}", flush=True)
    run_meta = {k: results[k] for k in RUN_KEYS}
    results["runs"] = [run_meta]
    earlier = {}  # --append: the previous rows of the cases this run re-measures
    if args.append and os.path.exists(out_path):
        earlier = merge_previous(results, out_path, device_name, cases, run_meta)
    run_index = len(results["runs"]) - 1
    if warnings:
        results["warnings"] = warnings
    write_json(out_path, results)

    group = None
    for case in cases:
        if (case.T, case.V) != group:
            group = (case.T, case.V)
            bench.new_size()
        elapsed = time.perf_counter() - t_start
        if args.budget_s is not None and elapsed > args.budget_s:
            row = dict(dataclasses.asdict(case))
            row.update(status=f"skipped: time budget ({args.budget_s:.0f} s) spent",
                       framework=None, run=run_index)
            results["rows"].append(keep_measured(row, earlier.get(case.key), run_index))
            continue
        row = bench.run_case(case)
        row["run"] = run_index
        row["roofline_Bps"] = bw["used_Bps"]
        row = keep_measured(row, earlier.get(case.key), run_index)
        results["rows"].append(row)
        print_row(row)
        results["elapsed_s"] = time.perf_counter() - t_start
        write_json(out_path, results)

    results["speedups"] = tables.speedups(results)
    results["complete"] = True
    results["elapsed_s"] = time.perf_counter() - t_start
    write_json(out_path, results)
    print()
    print(tables.text_table(results))
    print()
    print(tables.text_speedups(results))
    print(f"\n[bench] done in {results['elapsed_s']:.0f} s; results in {out_path}", flush=True)
    error = bench.impls.close()
    if error:
        print(f"[bench] warning: destroying Megatron's process group failed: {error}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
