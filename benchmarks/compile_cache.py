"""Compilation in an RL run: a loop of varying T in fresh processes, cold and warm cache.

    python -m benchmarks.compile_cache [--device cpu|gpu] [--out FILE_OR_DIR] [--calls 40]

A PPO-style loop (`--calls` forward+backward calls of `bridge.logprob_entropy`, T uniform
in [1, --max-tokens], fixed seed; entropy with its gradient) runs in a fresh Python
process three times, each with its own `JAXOPS_CACHE_DIR` (docs/compilation.md):
  cold    an empty persistent cache: every window size is compiled as the loop meets it;
  warm    the same directory again, as a restarted run: programs come from the cache;
  warmup  an empty cache, `bridge.warmup(max_tokens, ...)` first, then the loop.
For each: process wall time, import time, the loop's wall time (the first pass, device-
synchronised after every call), programs compiled (`bridge.compiled_programs()`), JAX's
compile-time events and cache hits/misses, and every call's (T, seconds, new programs),
from which "one new window" = the median time of a call after the first that added
programs (its first call at a new window size).

--device cpu: V_loc = 64, float32 (the XLA route). --device gpu: V_loc = 18,992, bf16 on
the current CUDA device (the default "pallas": the direct route on Hopper). Results:
JSON at --out (default benchmarks/results/compile_cache_<device>.json; a directory gets
that file name), and a summary on stdout.
"""
if __name__ == "__main__" and not __package__:  # run by path: see benchmarks/__init__.py
    import os, sys  # noqa: E401
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import argparse  # noqa: E402
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
    big = (torch.randn(args.max_tokens, args.vocab, generator=gen) * 3).to(dev, dtype)
    targets = torch.randint(0, args.vocab, (args.max_tokens,), generator=gen).to(dev)
    cot = torch.randn(args.max_tokens, generator=gen).to(dev)
    out = {"mode": args.child, "import_s": imported}
    if args.child == "warmup":
        report = bridge.warmup(args.max_tokens, args.vocab, dtype=dtype, device=dev,
                               implementation=args.implementation, progress=False)
        out["warmup"] = {"programs": report.programs, "seconds": report.seconds,
                         "windows": list(report.windows)}
    calls = []
    loop_start = time.perf_counter()
    for T in seq:
        before, t0 = bridge.compiled_programs(), time.perf_counter()
        x = big[:T].detach().requires_grad_()  # a zero-copy row slice of torch's memory
        lp, h = bridge.logprob_entropy(x, targets[:T], implementation=args.implementation)
        torch.autograd.grad([lp, h], [x], [cot[:T], cot[:T]])
        sync()
        calls.append([T, time.perf_counter() - t0, bridge.compiled_programs() - before])
    out["loop_s"] = time.perf_counter() - loop_start
    out["loop_programs"] = sum(c[2] for c in calls)
    out["programs"] = bridge.compiled_programs()
    out["compile_events_s"] = {e.rsplit("/", 1)[-1]: round(s, 4) for e, s in durations.items()}
    out["cache_events"] = counts
    out["calls"] = calls
    out["process_s"] = time.perf_counter() - start
    return out


def _run_child(args, mode, cache_dir) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.compile_cache", "--child", mode,
           "--device", args.device, "--vocab", str(args.vocab), "--dtype", args.dtype,
           "--calls", str(args.calls), "--max-tokens", str(args.max_tokens),
           "--seed", str(args.seed)]
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
    cold, warm, wu = res["runs"]["cold"], res["runs"]["warm"], res["runs"]["warmup"]
    lines = [f"compile_cache on {res['device_name']} (V_loc {res['vocab']}, {res['dtype']}, "
             f"{res['calls']} calls, T in [1, {res['max_tokens']}]):"]
    for name, r in (("cold", cold), ("warm", warm), ("warmup", wu)):
        extra = (f", warm-up {r['warmup']['seconds']:.2f} s for {r['warmup']['programs']} "
                 f"programs" if "warmup" in r else "")
        first = r["calls"][0][1]
        nw = _new_window_s(r)
        lines.append(
            f"  {name:<6} process {r['wall_s']:6.2f} s, loop {r['loop_s']:6.2f} s "
            f"(first call {first:.2f} s, new window {'-' if nw is None else f'{nw:.3f} s'}, "
            f"steady {1e3 * (_steady_s(r) or 0):.2f} ms), {r['loop_programs']} programs in "
            f"the loop{extra}; cache {r['cache_events']}")
    lines.append(f"  warm/cold: loop {res['ratio_loop']:.2f}, process {res['ratio_process']:.2f}")
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
        for mode, folder in (("cold", "a"), ("warm", "a"), ("warmup", "b")):
            runs[mode] = _run_child(args, mode, os.path.join(tmp, folder))
            print(f"[compile_cache] {mode}: loop {runs[mode]['loop_s']:.2f} s, "
                  f"process {runs[mode]['wall_s']:.2f} s", file=sys.stderr, flush=True)
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
           "ratio_loop": runs["warm"]["loop_s"] / runs["cold"]["loop_s"],
           "ratio_process": runs["warm"]["wall_s"] / runs["cold"]["wall_s"],
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
