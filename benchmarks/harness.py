"""The measurement harness every benchmark script shares.

* `roofline_bytes`: the bytes that must move (the one copy of the formula).
* `time_calls`: the one timing loop (warm-up, then the median of device-synchronised
  repetitions of back-to-back calls over rotating input sets).
* Small CLI and result-writing helpers: `PallasConfig` / `MosaicConfig` and keyword-argument
  parsing, `write_json`, the commit and package versions a result records.

Standard library only at import time: JAX and PyTorch are the callers' to import (a
script decides when JAX starts, e.g. after `XLA_PYTHON_CLIENT_PREALLOCATE` is set).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import math
import os
import subprocess
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/
REPO = os.path.dirname(HERE)
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---------------------------------------------------------------------------- roofline


def itemsize(dtype):
    """Bytes per element of a dtype or its name ("bfloat16", jnp.bfloat16's dtype, ...)."""
    name = getattr(dtype, "name", None) or str(dtype)
    if name not in ITEMSIZE:
        import numpy as np
        return np.dtype(name).itemsize
    return ITEMSIZE[name]


def roofline_bytes(dtype, T, V, mask):
    """(forward, forward+backward) bytes that must move for [T, V] logits of `dtype` (a
    dtype or its name): the forward reads the logits once (+ the bool mask, one byte per
    element); forward+backward moves them three times (read, read, write the gradient) +
    two reads of the mask. O(T) traffic (targets, outputs) is not counted."""
    logits = T * V * itemsize(dtype)
    mask_bytes = T * V if mask else 0
    return logits + mask_bytes, 3 * logits + 2 * mask_bytes


def roofline_ms(nbytes, bandwidth_Bps):
    """Milliseconds to move `nbytes` at `bandwidth_Bps` bytes per second."""
    return nbytes / bandwidth_Bps * 1e3


# ---------------------------------------------------------------------------- timing


@dataclasses.dataclass(frozen=True)
class Timing:
    seconds: float  # median over the repetitions of the per-call time
    calls: int  # calls per repetition
    times: tuple  # per-call seconds of every repetition, sorted


def choose_calls(est_s, n_sets, target_s, max_calls):
    """Calls per repetition so that one lasts ~target_s (a call taking est_s), at least 2
    and n_sets, at most max_calls, a multiple of n_sets (every set equally often)."""
    calls = math.ceil(target_s / max(est_s, 1e-7))
    calls = max(calls, n_sets, 2)
    calls = min(calls, max_calls)
    return max(calls - calls % n_sets, n_sets)


def time_calls(fn, arg_sets=((),), *, reps, calls, sync, warmup=1, before_rep=None,
               cuda_events=None):
    """Median per-call time of `reps` repetitions of `calls` back-to-back calls.

    fn(*arg_sets[i % len(arg_sets)]) is call i: the calls rotate over the input sets
    (fresh inputs, far larger than the caches, when the caller makes several). First
    `warmup` calls (starting on the set the timed loop does not start on), then
    `sync(last output)`; `calls` may be a function of the per-call seconds of that
    warm-up (e.g. `choose_calls`). Each repetition: `before_rep()` if given, then the
    loop, timed on the wall clock up to `sync(last output)` (which must wait for the
    device), or, with `cuda_events=torch`, by CUDA events recorded around the loop on
    the current stream. The median is the middle of the sorted times (the upper one of
    the two middles for an even `reps`).

    Memory: the previous call's outputs are dropped before the next call starts (`out =
    None` first), so one call's outputs are alive at a time. (`out = fn(...)` alone keeps
    the old outputs until the new call has allocated its own: a forward+backward at fp32
    T = 32,768, V = 151,936 then holds two 19.9 GB gradients.) Dropping a reference makes no
    device synchronisation: JAX and torch free stream-ordered."""
    n = len(arg_sets)
    out = None
    start = time.perf_counter()
    for i in range(warmup):
        out = None
        out = fn(*arg_sets[(1 + i) % n])
    sync(out)
    est = (time.perf_counter() - start) / max(warmup, 1)
    out = None
    if callable(calls):
        calls = calls(est)
    times = []
    for _ in range(reps):
        if before_rep is not None:
            before_rep()
        if cuda_events is not None:
            ev0 = cuda_events.cuda.Event(enable_timing=True)
            ev1 = cuda_events.cuda.Event(enable_timing=True)
            ev0.record()
            for i in range(calls):
                out = None
                out = fn(*arg_sets[i % n])
            ev1.record()
            ev1.synchronize()
            times.append(ev0.elapsed_time(ev1) * 1e-3 / calls)
        else:
            t0 = time.perf_counter()
            for i in range(calls):
                out = None
                out = fn(*arg_sets[i % n])
            sync(out)
            times.append((time.perf_counter() - t0) / calls)
        out = None  # free the last outputs before the next repetition
    times.sort()
    return Timing(times[len(times) // 2], calls, tuple(times))


def mean_call_us(fn, calls, sync):
    """Mean µs per call of `calls` back-to-back calls of `fn`, device-synchronised
    (`sync()`) before the first and after the last: host and device time together, as
    a training loop sees them."""
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def block_jax(out):
    """`sync` for JAX outputs: wait until they are computed."""
    import jax
    jax.block_until_ready(out)


# ---------------------------------------------------------------------------- errors


def is_oom(exc):
    text = f"{type(exc).__name__} {exc}".lower()
    return any(s in text for s in ("out of memory", "resource_exhausted", "outofmemory",
                                   "resource exhausted", "failed to allocate"))


def short_error(exc, limit=300):
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


def run_phase(row, phase, body, cleanup):
    """Run one timed phase, recording "ok", "OOM" or the error in `row[phase_status]`
    instead of raising. `cleanup` runs after the except block on failure: until that
    block ends, the traceback's frames (holding the phase's outputs) are alive."""
    try:
        body()
        row[f"{phase}_status"] = "ok"
        return
    except Exception as exc:
        if is_oom(exc):
            row[f"{phase}_status"] = "OOM"
        else:
            traceback.print_exc()
            row[f"{phase}_status"] = f"error: {short_error(exc)}"
        del exc
    cleanup()


# ---------------------------------------------------------------------------- CLI

BOOL = {"1": True, "true": True, "yes": True, "y": True, "on": True,
        "0": False, "false": False, "no": False, "n": False, "off": False}


def parse_kwargs(text):
    """"a=1,b=True,c=pallas" -> {"a": 1, "b": True, "c": "pallas"} (JSON values, else strings)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, value = (s.strip() for s in part.split("=", 1))
        try:
            out[key] = json.loads(value.lower() if value in ("True", "False") else value)
        except ValueError:
            out[key] = value
    return out


def pallas_config(pairs, cls=None):
    """{"block_v": "1024", "prefetch": "1"} (or "block_v=1024,prefetch=1") -> PallasConfig
    (or `cls`, e.g. jaxops.backends.mosaic.config.MosaicConfig: the same rules for both backends'
    configs): on/off fields take 0/1 (or true/false, yes/no), the others integers; `none`
    leaves a field to its automatic choice."""
    import jaxops
    cls = cls or jaxops.PallasConfig
    if isinstance(pairs, str):
        pairs = dict(kv.split("=", 1) for kv in filter(None, pairs.split(",")))
    flags = {f.name for f in dataclasses.fields(cls) if "bool" in str(f.type)}

    def value(key, text):
        text = text.strip().lower()
        if text in ("none", "null"):
            return None  # the field's automatic choice
        if key in flags:
            return BOOL[text] if text in BOOL else bool(int(text))
        return int(text)

    return cls(**{k.strip(): value(k.strip(), v) for k, v in pairs.items()})


def mosaic_config(pairs):
    """As `pallas_config`, for the Mosaic GPU kernels' MosaicConfig."""
    from jaxops.backends.mosaic.config import MosaicConfig
    return pallas_config(pairs, MosaicConfig)


def parse_pallas_configs(text):
    """"block_v=2048,num_warps=4;prefetch=1" -> [PallasConfig, ...]."""
    return [pallas_config(item) for item in filter(None, text.split(";"))]


def budget_seconds(text):
    """argparse type of --budget-s: seconds >= 0 (0: start no case at all), or `none`
    (no budget; returned as math.inf)."""
    if text.strip().lower() in ("none", "inf", "off"):
        return math.inf
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected seconds >= 0 (0 starts no case) or 'none' (no budget)")
    return value


# ---------------------------------------------------------------------------- results


def write_json(path, obj):
    """Write `obj` (indent 1, newline at the end) atomically: a reader, or a run killed
    by a timeout, sees the old file or the new one, never half of one."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def run_case_table(description, cases, run_case, after_case=None):
    """The command line of the scripts that time one row per case: `--out FILE.json`
    (rewritten after every case, {"rows": [...]}) and `--quick` (`cases(quick)` picks
    the cases); each row is printed as one JSON line when done. `after_case()`: run
    after each case (e.g. to free cached device memory)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rows = []
    for case in cases(args.quick):
        rows.append(run_case(*case))
        print(json.dumps(rows[-1]), flush=True)
        if args.out:
            write_json(args.out, dict(rows=rows))
        if after_case is not None:
            after_case()
    return rows


def git_info():
    """The commit measured. BENCH_GIT_COMMIT wins: a device machine's copy of the tree
    may carry a stale .git (its HEAD is then not the tree that runs)."""
    info = {"commit": os.environ.get("BENCH_GIT_COMMIT"), "dirty": None}
    if info["commit"]:
        return info
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10)
        if commit.returncode == 0:
            info["commit"] = commit.stdout.strip()
            status = subprocess.run(["git", "-C", REPO, "status", "--porcelain",
                                     "--untracked-files=no"], capture_output=True, text=True,
                                    timeout=10)
            info["dirty"] = bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError) as exc:  # no git on the machine
        info["error"] = short_error(exc)
    return info


def package_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def slug(text):
    out = "".join(c.lower() if c.isalnum() else "-" for c in text)
    while "--" in out:
        out = out.replace("--", "-")
    return out.strip("-") or "device"
