"""Compilation in an RL run: a loop of varying T in fresh processes, cold and warm cache.

    python -m benchmarks.compile_cache [--device cpu|gpu] [--out FILE_OR_DIR] [--calls 40]
                                       [--threads N] [--runs cold,warm,warmup,warmup_warm]

A PPO-style loop (`--calls` forward+backward calls of `bridge.logprob_entropy`, T uniform
in [1, --max-tokens], fixed seed; entropy with its gradient) runs in a fresh Python
process three times, with `JAXOPS_CACHE_DIR` (docs/compilation.md) in a temporary folder:
  cold    an empty persistent cache: every window size is compiled as the loop meets it;
  warm    the same folder again, as a restarted run: programs come from the cache;
  warmup  another empty folder, `bridge.warmup(max_tokens, ...)` first, then the loop;
  warmup_warm  the same again with that folder: the warm-up loads every program.
(`--runs` picks some of them -- without warmup, warmup_warm takes the cold run's folder;
`--threads N` warms N window sizes at once.)
For each: process wall time, import time, the loop's time (the first pass: the sum of
the calls' times, each device-synchronised), programs compiled
(`bridge.compiled_programs()`), JAX's compile-time events and cache hits/misses, the
direct route's build seconds by phase (`bridge.diagnostics.kernel_build_times()`), every
call's (T, seconds, new programs) -- "one new window" is the median time of a call after
the first that added programs (its first call at a new window size) -- and a digest of
every call's results (taken outside the timing): the three runs must agree bit for bit.

--device cpu: V_loc = 64, float32 (the XLA route). --device gpu: V_loc = 18,992, bf16 on
the current CUDA device, the default implementation (`--implementation pallas_mosaic`
asks for the Mosaic kernels, launched directly from torch on Hopper). Results:
JSON at --out (default benchmarks/results/compile_cache_<device>.json; a directory gets
that file name), and a summary on stdout.
"""
if __name__ == "__main__" and not __package__:  # run by path: see benchmarks/__init__.py
    import os, sys  # noqa: E401
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

PRESETS = {"cpu": dict(vocab=64, dtype="float32"), "gpu": dict(vocab=18_992, dtype="bfloat16")}
_MARK = "COMPILE_CACHE_RESULT "
_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
           "/jax/core/compile/jaxpr_to_mlir_module_duration",
           "/jax/core/compile/backend_compile_duration")


def child(args) -> dict:
    """One fresh process's run (`args.child` = cold | warm | warmup)."""
    start = time.perf_counter()
    import torch

    import bridge  # first: JAX must start without preallocating
    import jax
    from bridge import diagnostics

    imported = time.perf_counter() - start
    durations = {e: 0.0 for e in _EVENTS}
    counts: dict = {}

    def on_duration(event, secs, **_):
        if event in durations:
            durations[event] += secs

    def on_event(event, **_):
        if "compilation_cache" in event:
            counts[event.rsplit("/", 1)[-1]] = counts.get(event.rsplit("/", 1)[-1], 0) + 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    dev = torch.device("cuda" if args.device == "gpu" else "cpu")
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    seq = torch.randint(1, args.max_tokens + 1, (args.calls,), generator=gen).tolist()
    on_dev = torch.Generator(device=dev).manual_seed(args.seed)  # [T, V] made in place
    big = torch.randn(args.max_tokens, args.vocab, generator=on_dev, device=dev) * 3
    big = big.to(dtype)
    targets = torch.randint(0, args.vocab, (args.max_tokens,), generator=on_dev, device=dev)
    cot = torch.randn(args.max_tokens, generator=on_dev, device=dev)
    out = {"mode": args.child, "import_s": imported}
    if args.child == "warmup":
        report = bridge.warmup(args.max_tokens, args.vocab, dtype=dtype, device=dev,
                               implementation=args.implementation, progress=False,
                               threads=args.threads)
        out["warmup"] = {"programs": report.programs, "seconds": report.seconds,
                         "windows": list(report.windows), "threads": args.threads,
                         "kernel_build": diagnostics.kernel_build_times()}
    calls = []
    digest = hashlib.sha256()  # of every call's results: runs must agree bit for bit
    loop_s = 0.0
    for T in seq:
        before, t0 = bridge.compiled_programs(), time.perf_counter()
        x = big[:T].detach().requires_grad_()  # a zero-copy row slice of torch's memory
        lp, h = bridge.logprob_entropy(x, targets[:T], implementation=args.implementation)
        (grad,) = torch.autograd.grad([lp, h], [x], [cot[:T], cot[:T]])
        sync()
        seconds = time.perf_counter() - t0
        loop_s += seconds
        calls.append([T, seconds, bridge.compiled_programs() - before])
        # (outside the timing) log_prob and entropy, and the gradient's bits summed exactly
        bits = grad.view(torch.int16 if grad.element_size() == 2 else torch.int32)
        for t in (lp, h, bits.sum(dtype=torch.int64)):
            digest.update(t.detach().cpu().numpy().tobytes())
    out["loop_s"] = loop_s
    out["digest"] = digest.hexdigest()
    out["loop_programs"] = sum(c[2] for c in calls)
    out["programs"] = bridge.compiled_programs()
    out["compile_events_s"] = {e.rsplit("/", 1)[-1]: round(s, 4) for e, s in durations.items()}
    out["cache_events"] = counts
    out["kernel_build"] = diagnostics.kernel_build_times()  # the warm-up's included
    out["calls"] = calls
    out["process_s"] = time.perf_counter() - start
    return out


def _run_child(args, mode, cache_dir) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.compile_cache", "--child", mode,
           "--device", args.device, "--vocab", str(args.vocab), "--dtype", args.dtype,
           "--calls", str(args.calls), "--max-tokens", str(args.max_tokens),
           "--seed", str(args.seed), "--threads", str(args.threads)]
    if args.implementation:
        cmd += ["--implementation", args.implementation]
    env = dict(os.environ, JAXOPS_CACHE_DIR=cache_dir)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the bridge's own cache, in cache_dir
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"the {mode} process failed ({proc.returncode})")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARK)][-1]
    result = json.loads(line[len(_MARK):])
    result["wall_s"] = wall
    result["cache_files"] = _cache_files(cache_dir)
    return result


def _cache_files(cache_dir) -> dict:
    """Files per kind of entry (`<root>/<versions>/xla|mosaic`, bridge/_cache.py)."""
    counts = {}
    for path, _, files in os.walk(cache_dir):
        kind = os.path.basename(path)
        if kind in ("xla", "mosaic"):
            counts[kind] = counts.get(kind, 0) + len(files)
    return counts


def _new_window_s(run) -> float | None:
    """Median time of a call after the first that compiled (or loaded) programs."""
    times = [s for _, s, new in run["calls"][1:] if new]
    return statistics.median(times) if times else None


def _steady_s(run) -> float | None:
    times = [s for _, s, new in run["calls"] if not new]
    return statistics.median(times) if times else None


def summary(res) -> str:
    lines = [f"compile_cache on {res['device_name']} (V_loc {res['vocab']}, {res['dtype']}, "
             f"{res['calls']} calls, T in [1, {res['max_tokens']}]):"]
    for name, r in res["runs"].items():
        extra = (f", warm-up {r['warmup']['seconds']:.2f} s for {r['warmup']['programs']} "
                 f"programs" if "warmup" in r else "")
        first = r["calls"][0][1]
        nw = _new_window_s(r)
        build = r.get("kernel_build") or {}
        if build.get("built") or build.get("loaded"):
            extra += (f"; direct-route kernels: {build['built']} lowered "
                      f"({build['lower']:.2f} s), {build['loaded']} from the cache, "
                      f"compiled in {build['compile']:.2f} s")
        lines.append(
            f"  {name:<11} process {r['wall_s']:6.2f} s, loop {r['loop_s']:6.2f} s "
            f"(first call {first:.2f} s, new window {'-' if nw is None else f'{nw:.3f} s'}, "
            f"steady {1e3 * (_steady_s(r) or 0):.2f} ms), {r['loop_programs']} programs in "
            f"the loop{extra}; cache {r['cache_events']}")
    if res["ratio_loop"] is not None:
        lines.append(f"  warm/cold: loop {res['ratio_loop']:.2f}, "
                     f"process {res['ratio_process']:.2f}")
    lines.append(f"  results bit-identical in all runs: {res['identical']}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--out", default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=32_768)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--implementation", default=None)
    parser.add_argument("--threads", type=int, default=1,
                        help="window sizes the warm-up processes warm at once")
    parser.add_argument("--runs", default="cold,warm,warmup,warmup_warm",
                        help="which processes to run, comma-separated, in this order")
    parser.add_argument("--child", choices=("cold", "warm", "warmup"), default=None)
    args = parser.parse_args(argv)
    for key, value in PRESETS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.child:
        print(_MARK + json.dumps(child(args)), flush=True)
        return
    import jax
    import torch

    tmp = tempfile.mkdtemp(prefix="jaxops-compile-cache-")
    try:
        runs = {}
        wanted = args.runs.split(",")
        # warmup_warm warms up with a warm cache: warmup's folder, else the cold run's.
        warm_folder = "b" if "warmup" in wanted else "a"
        for label, mode, folder in (("cold", "cold", "a"), ("warm", "warm", "a"),
                                    ("warmup", "warmup", "b"),
                                    ("warmup_warm", "warmup", warm_folder)):
            if label not in wanted:
                continue
            runs[label] = _run_child(args, mode, os.path.join(tmp, folder))
            print(f"[compile_cache] {label}: loop {runs[label]['loop_s']:.2f} s, "
                  f"process {runs[label]['wall_s']:.2f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    device_name = (torch.cuda.get_device_name() if args.device == "gpu"
                   else platform.processor() or platform.machine())
    res = {"device": args.device, "device_name": device_name, "vocab": args.vocab,
           "dtype": args.dtype, "calls": args.calls, "max_tokens": args.max_tokens,
           "seed": args.seed, "implementation": args.implementation,
           "versions": {"python": platform.python_version(), "jax": jax.__version__,
                        "torch": torch.__version__},
           "runs": runs,
           "threads": args.threads,
           "ratio_loop": (runs["warm"]["loop_s"] / runs["cold"]["loop_s"]
                          if {"cold", "warm"} <= runs.keys() else None),
           "ratio_process": (runs["warm"]["wall_s"] / runs["cold"]["wall_s"]
                             if {"cold", "warm"} <= runs.keys() else None),
           "identical": len({r["digest"] for r in runs.values()}) == 1,
           "new_window_s": {m: _new_window_s(r) for m, r in runs.items()}}
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"compile_cache_{args.device}.json")
    if os.path.isdir(out):
        out = os.path.join(out, f"compile_cache_{args.device}.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(summary(res))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
