"""The fused LM head against its GEMM floor and the unfused and third-party paths (issue 13).

    python -m benchmarks.linear_head [--quick] [--out FILE.json] [--cases 4096x4096,16384x4096]
                                     [--budget-s N] [--impls a,b,...] [--entropy both|on|off]
    python -m benchmarks.linear_head --device cpu --quick      # tiny shapes, float32 (CI)

Default run on one H200: about 5 minutes (288 s with Liger and verl), much of it compiles (torch.compile's first
graph alone ~30 s); --quick (T = H = 4096, with entropy): about 1 minute.

Per-token log-prob (and entropy) of softmax(hidden @ weight.T), bf16, V = 151,936, every
(T, H) of --cases (default T in {4096, 16384} x H in {4096, 8192}), with and without
entropy. Rows (--impls takes these keys):

  gemm-jax         the GEMMs the fused op needs, XLA/cuBLAS: forward hidden @ W^T;
                   forward+backward = forward, recompute (a second GEMM that XLA cannot
                   merge with the first: lax.optimization_barrier), d hidden, d weight.
                   FLOPs 2*T*H*V (forward) and 8*T*H*V (forward+backward).
  gemm-torch       the same four GEMMs with torch.matmul.
  jaxops-fused     jaxops.linear_logprob_entropy (jitted forward; jax.vjp forward+backward).
  bridge-fused     bridge.linear_logprob_entropy on torch tensors (autograd).
  jax-unfused      jnp.dot + jaxops.logprob_entropy (bf16 logits stored; no recompute).
  torch-bridge     torch.matmul + bridge.logprob_entropy.
  torch-compile    torch.matmul + torch.compile(log_softmax / gather / entropy).
  liger            Liger-Kernel's fused linear cross-entropy (reduction="none"): CE ONLY
                   (-log_prob, no entropy), one row per shape, next to the no-entropy rows.
  verl             verl's linear_cross_entropy (log-prob + entropy), if importable.
  liger-cute       Liger-Kernel's CuTe DSL Hopper kernel (LigerFusedScaledCrossEntropySM90
                   Function: per-token NLL, entropy on request, temperature): sm_90 and
                   bf16 only, needs the wheels liger-kernel, nvidia-cutlass-dsl(-libs-base),
                   apache-tvm-ffi; its host-syncing target check is switched off
                   (LIGER_SCALED_CE_SM90_VALIDATE_TARGETS=0), as ours never checks.

"x floor" divides by the faster of gemm-jax / gemm-torch at the same shape and phase, so
below 1.0 means fewer GEMMs than the fused op (the unfused paths do not recompute).
TFLOP/s is 8*T*H*V / (forward+backward time) for every row: the fused op's GEMM work per
second, i.e. the floor's rate divided by "x floor".

Measurement (also written to the JSON under "method"):
* Time: harness.time_calls, median of --reps repetitions of back-to-back calls (at least 2,
  ~--target-ms per repetition), after a compile/warm-up call and a memory call. JAX:
  block_until_ready, wall clock. torch-only rows: CUDA events. Rows through the bridge
  (work on JAX's and torch's streams): torch.cuda.synchronize, wall clock. One input set
  (the weight, 1.2-2.5 GB, is far larger than the 50 MB L2).
* Forward = inference (torch under no_grad, Liger on detached inputs so that it does not
  prepare gradients). Forward+backward returns d hidden and d weight for random
  cotangents of both outputs.
* Peak extra memory = what a call needs beyond its inputs AND its outputs (the gradients
  are the same for every row, and d weight alone is H/T of the logits' bytes):
  JAX rows: the executable's temp_size_in_bytes (buffer assignment); torch rows:
  max_memory_allocated - memory_allocated before the call - the outputs' bytes; rows
  through the bridge: that plus JAX's side from memory_stats, peak - in use before the
  call. JAX cannot reset its peak counter, so before that call a "ballast" array fills
  JAX's pool up to the process-wide peak so far: any allocation of the call then raises
  the peak, and peak - in use before is exactly the call's (jax_side_exact; where the
  ballast could not be made, the in-use delta, a lower bound, marked "*" in the table).
  "x logits" = that / (T * V * itemsize): the logits an unfused path stores (bf16: T*V*2).
* Errors and OOMs are recorded per row and phase; the run goes on. The JSON is rewritten
  after every row; --budget-s: no row starts after that many seconds.

This module is the command line, the run order, the derived columns and the table; the
rows (IMPLS) and their functions are in linear_head_impls.py, the measurement of one row
(inputs, timing, memory) in linear_head_runner.py.
"""

if __name__ == "__main__" and not __package__:  # run by path: see benchmarks/__init__.py
    import os, sys  # noqa: E401
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

# stdlib only at import time: JAX starts later, in main()
from benchmarks import harness  # noqa: E402
from benchmarks.linear_head_impls import (FIXED_ENTROPY, GEMM_ROWS, IMPLS,  # noqa: E402
                                          TABLE_ORDER)
from benchmarks.linear_head_runner import Run  # noqa: E402

GPU_V = 151_936
GPU_CASES = "4096x4096,16384x4096,4096x8192,16384x8192"
CPU_V, CPU_CASE = 1000, (64, 32)  # --device cpu: tiny shapes, float32


def parse_cases(text):
    """"4096x4096,16384x4096" -> [(4096, 4096), (16384, 4096)] (T x H)."""
    cases = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            t, h = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: expected TxH, e.g. 4096x4096")
        if t < 1 or h < 1:
            raise argparse.ArgumentTypeError(f"{part!r}: T and H must be >= 1")
        cases.append((t, h))
    return cases


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--device", choices=("gpu", "cpu"), default=None,
        help="gpu (default when torch and JAX see a CUDA GPU) or cpu: T=64, H=32, V=1000, "
             "float32, whatever --cases says")
    add("--quick", action="store_true",
        help="one small case: T=4096, H=4096 (cpu: the tiny one), with entropy only")
    add("--cases", type=parse_cases, default=None, help=f"TxH list (default {GPU_CASES})")
    add("--entropy", choices=("both", "on", "off"), default=None,
        help="with/without entropy (default both; --quick: on)")
    add("--impls", default=None, help="comma list of rows to run (default all): "
                                       + ",".join(IMPLS))
    add("--vocab", type=int, default=None, help=f"V (default {GPU_V}; cpu {CPU_V})")
    add("--reps", type=int, default=3, help="repetitions, the median is reported")
    add("--target-ms", type=float, default=50.0, help="length of one repetition")
    add("--max-calls", type=int, default=5, help="calls per repetition at most")
    add("--budget-s", type=harness.budget_seconds, default=480.0,
        help="start no row after this many seconds ('none': no budget)")
    add("--with-compile", action="store_true", help="run torch.compile also on the CPU (slow)")
    add("--out", default=None,
        help="results JSON (default benchmarks/results/linear_head_<device>.json)")
    return parser


def row_specs(args):
    """Every row of the run, in run order: shape by shape (a spent --budget-s then leaves
    whole shapes), torch-side rows first, then JAX rows (one input copy alive at a time).
    Each spec: dict(impl, T, H, entropy)."""
    specs = []
    for T, H in args.cases:
        for side in ("torch", "jax"):
            for impl in args.impls:
                _, impl_side, per_entropy = IMPLS[impl]
                if impl_side != side:
                    continue
                entropies = args.entropies if per_entropy else [FIXED_ENTROPY.get(impl)]
                specs.extend(dict(impl=impl, T=T, H=H, entropy=e) for e in entropies)
    return specs


# ---------------------------------------------------------------------- report


def add_derived(rows):
    """x floor (the faster GEMM floor row at the same shape and phase), TFLOP/s at the
    fused op's GEMM work (2*T*H*V forward, 8*T*H*V forward+backward), x logits."""
    floors = {}
    for r in rows:
        if r["impl"] in GEMM_ROWS:
            for phase in ("fwd", "fb"):
                ms = r.get(f"{phase}_ms")
                key = (r["T"], r["H"], phase)
                if ms and (key not in floors or ms < floors[key][0]):
                    floors[key] = (ms, r["impl"])
    for r in rows:
        for phase, flops in (("fwd", 2), ("fb", 8)):
            ms = r.get(f"{phase}_ms")
            floor = floors.get((r["T"], r["H"], phase))
            r[f"{phase}_floor_ms"] = floor[0] if floor else None
            r[f"{phase}_floor_impl"] = floor[1] if floor else None
            r[f"{phase}_x_floor"] = ms / floor[0] if ms and floor else None
            r[f"{phase}_tflops"] = flops * r["T"] * r["H"] * r["V"] / (ms * 1e9) if ms else None
            extra = r.get(f"{phase}_extra_bytes")
            r[f"{phase}_x_logits"] = None if extra is None else extra / r["logits_bytes"]
    return rows


def _f(value, spec):
    return "-" if value is None else format(value, spec)


def markdown(results):
    """One table per shape: rows in TABLE_ORDER, entropy on before off."""
    rows = results["rows"]
    lines = []
    shapes = []
    for r in rows:
        if (r["T"], r["H"]) not in shapes:
            shapes.append((r["T"], r["H"]))
    for T, H in shapes:
        here = [r for r in rows if (r["T"], r["H"]) == (T, H)]
        logits = here[0]["logits_bytes"]
        lines += [f"T = {T:,}, H = {H:,}, V = {here[0]['V']:,}, {here[0]['dtype']} "
                  f"(logits {logits / 2**30:.2f} GiB; floor TFLOP/s at 8*T*H*V)", "",
                  "| implementation | entropy | fwd ms | fwd+bwd ms | x GEMM floor (fwd / fwd+bwd) "
                  "| TFLOP/s (fwd+bwd) | peak extra GiB (fwd / fwd+bwd) "
                  "| x logits (fwd / fwd+bwd) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        order = {k: i for i, k in enumerate(TABLE_ORDER)}
        here.sort(key=lambda r: (order[r["impl"]], r["entropy"] is False))
        for r in here:
            ent = {None: "-", True: "yes", False: "no"}[r["entropy"]]
            if r["impl"] == "liger":
                ent = "CE only"
            if not r.get("fwd_ms") and not r.get("fb_ms"):
                lines.append(f"| {r['label']} | {ent} | {r['status']} | | | | | |")
                continue

            def cell(phase, key, spec, scale=1.0):
                v = r.get(f"{phase}_{key}")
                text = "-" if v is None else format(v * scale, spec)
                if key in ("extra_bytes", "x_logits") and r.get(f"{phase}_jax_side_exact") is False:
                    text += "*"
                st = r.get(f"{phase}_status")
                return text if st in ("ok", None) else ("OOM" if st == "OOM" else "error")

            lines.append(
                f"| {r['label']} | {ent} | {cell('fwd', 'ms', '.2f')} | {cell('fb', 'ms', '.2f')} "
                f"| {cell('fwd', 'x_floor', '.2f')} / {cell('fb', 'x_floor', '.2f')} "
                f"| {cell('fb', 'tflops', '.0f' if (r.get('fb_tflops') or 0) >= 10 else '.3g')} "
                f"| {cell('fwd', 'extra_bytes', '.2f', 2**-30)} / "
                f"{cell('fb', 'extra_bytes', '.2f', 2**-30)} "
                f"| {cell('fwd', 'x_logits', '.3f')} / {cell('fb', 'x_logits', '.3f')} |")
        lines.append("")
    lines.append("x GEMM floor: / the faster of the two GEMM-floor rows (forward: 1 GEMM; "
                 "forward+backward: 4 incl. the recompute; the unfused rows run 3). Peak extra: "
                 "beyond inputs and outputs. *: the bridge's JAX side is a lower bound (JAX's "
                 "in-use bytes could not be lifted to its peak before the call).")
    return "\n".join(lines)


def versions(torch, jax):
    out = {"python": platform.python_version(), "jax": jax.__version__,
           "jaxlib": harness.package_version("jaxlib"), "torch": torch.__version__}
    for name in ("liger-kernel", "triton", "verl", "jax-cuda13-plugin", "jax-cuda12-plugin"):
        out[name] = harness.package_version(name)
    return out


METHOD = {
    "time": "harness.time_calls: median of reps repetitions of >= 2 back-to-back calls after "
            "a warm-up and a memory call; JAX block_until_ready wall clock, torch-only CUDA "
            "events, bridge rows torch.cuda.synchronize wall clock; one input set",
    "forward": "inference: torch no_grad, Liger on detached inputs; JAX the jitted function",
    "forward_backward": "outputs + d hidden, d weight for random cotangents of both outputs",
    "gemm_floor": "fwd hidden@W^T; fwd+bwd forward, recompute (optimization_barrier against "
                  "CSE in XLA), d hidden = logits@W, d weight = logits^T@hidden; outputs in "
                  "the inputs' dtype",
    "x_floor": "time / the faster of gemm-jax and gemm-torch at the same shape and phase",
    "tflops": "2*T*H*V / fwd time, 8*T*H*V / fwd+bwd time for every row",
    "extra_bytes": "beyond inputs and outputs: JAX temp_size_in_bytes; torch "
                   "max_memory_allocated - allocated before - output bytes; bridge rows + "
                   "JAX memory_stats peak - in use before, after a ballast array lifted the "
                   "in-use bytes to the process peak (jax_side_exact)",
    "x_logits": "extra_bytes / (T * V * itemsize)",
    "order": "shape by shape; per shape torch-side rows, then JAX rows",
}


def main(argv=None):
    args = build_parser().parse_args(argv)
    t_start = time.perf_counter()
    # Before JAX starts: share the GPU with torch (benchmarks/runner.py's doc), or CPU only.
    if args.device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")
    import torch
    import jax

    if args.device is None:
        args.device = ("gpu" if torch.cuda.is_available() and jax.default_backend() == "gpu"
                       else "cpu")
        if args.device == "cpu":
            print("[linear_head] no CUDA GPU for both torch and JAX: --device cpu", flush=True)
    if args.device == "gpu" and not torch.cuda.is_available():
        raise SystemExit("--device gpu: torch sees no CUDA GPU")
    on_gpu = args.device == "gpu"
    args.dtype = "bfloat16" if on_gpu else "float32"
    args.vocab = args.vocab or (GPU_V if on_gpu else CPU_V)
    if args.cases is None:
        args.cases = ([(4096, 4096)] if args.quick else parse_cases(GPU_CASES)) if on_gpu \
            else [CPU_CASE]
    args.entropies = {"both": [True, False], "on": [True], "off": [False]}[
        args.entropy or ("on" if args.quick else "both")]
    args.impls = list(IMPLS) if not args.impls else [s.strip() for s in args.impls.split(",")
                                                     if s.strip()]
    unknown = [i for i in args.impls if i not in IMPLS]
    if unknown:
        raise SystemExit(f"--impls: unknown {unknown}; choose from {list(IMPLS)}")
    device_name = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    out_path = args.out or os.path.join(harness.HERE, "results",
                                        f"linear_head_{harness.slug(device_name)}.json")

    run = Run(args, torch, jax)
    specs = row_specs(args)
    results = {
        "script": "benchmarks/linear_head.py", "argv": sys.argv[1:] if argv is None else argv,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": harness.git_info(),
        "versions": versions(torch, jax), "device": device_name, "device_kind": args.device,
        "dtype": args.dtype, "V": args.vocab, "cases": [list(c) for c in args.cases],
        "entropies": args.entropies, "impls": args.impls,
        "settings": {"reps": args.reps, "target_ms": args.target_ms,
                     "max_calls": args.max_calls, "budget_s": args.budget_s},
        "method": METHOD, "notes": [
            "liger: cross-entropy only (-log_prob), no entropy: listed with the no-entropy rows",
            "verl: linear_cross_entropy is run only where `verl` imports"],
        "rows": [], "complete": False}
    print(f"[linear_head] {device_name}, {args.dtype}, V = {args.vocab:,}, cases "
          f"{args.cases}, {len(specs)} rows -> {out_path}", flush=True)
    for spec in specs:
        elapsed = time.perf_counter() - t_start
        if elapsed > args.budget_s:
            label = IMPLS[spec["impl"]][0]
            reason = f"skipped: time budget ({args.budget_s:.0f} s) spent"
            row = dict(spec, label=label, framework=IMPLS[spec["impl"]][1], V=args.vocab,
                       dtype=args.dtype, status=reason, fwd_status=reason, fb_status=reason,
                       logits_bytes=spec["T"] * args.vocab * harness.itemsize(args.dtype))
        else:
            row = run.run_row(spec)
        results["rows"].append(row)
        add_derived(results["rows"])
        results["elapsed_s"] = time.perf_counter() - t_start
        harness.write_json(out_path, results)
        ent = {None: "", True: " +H", False: " -H"}[row["entropy"]]
        print(f"[{time.perf_counter() - t_start:6.1f} s] {row['impl']:13s} T={row['T']} "
              f"H={row['H']}{ent}: fwd {_f(row.get('fwd_ms'), '.2f')} ms, fwd+bwd "
              f"{_f(row.get('fb_ms'), '.2f')} ms, extra "
              f"{_f(row.get('fb_extra_bytes') and row['fb_extra_bytes'] / 2**30, '.2f')} GiB"
              f"  [{row['status']}]", flush=True)
    results["complete"] = True
    results["elapsed_s"] = time.perf_counter() - t_start
    harness.write_json(out_path, results)
    print()
    print(markdown(results))
    print(f"\nwrote {out_path} ({results['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
