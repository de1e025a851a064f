#!/usr/bin/env python3
"""Benchmark: log-prob (+ entropy) of softmax(logits / tau), against the HBM roofline and the anchors.

One run, one device, every implementation side by side (SPEC §7, §8, issue 5):

  jaxops-pallas   this project's op, Pallas kernels            (jax.jit)
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

    python benchmarks/bench.py --device-name h200 --quick --out $OUT/h200.json
    python benchmarks/bench.py --tiny                 # CPU: tiny sizes (CI runs this)
    python benchmarks/bench.py --dry-run --quick      # list the cases only
    python benchmarks/bench.py --filter impl=jaxops-*,torch-compile --filter dtype=bf16 --filter T=8192
    python benchmarks/bench.py --filter T=1024 --append --out $OUT/h200.json   # add rows

Modes: full (default on a GPU) = every combination at every size (224 cases; more than one
10-minute device call: split it with --filter and --append); --quick = every combination at
T = 8192, V = 151,936, then fp32 log-prob-only and bf16 with entropy at T = 32768, 1024 and
V_loc (98 cases, < 8 min incl. compiles, and a --budget-s guard that starts no case after
450 s); --tiny = CPU smoke run. The sizes run in priority order and the JSON is rewritten
after every case, so a timeout still leaves every finished row.

Measurement rules (all recorded in the JSON under "method"):

* Roofline = bytes that must move / copy bandwidth. Forward: T*V*itemsize (+ T*V for
  the bool mask). Forward+backward: three passes of the logits (read, read, write the
  gradient) + two reads of the mask. The bandwidth is measured in this run (bytes read +
  written): a torch device-to-device `copy_`, a torch elementwise scale and a jax.jit
  elementwise scale of a large array; the roofline uses the MAX of the three (the
  strictest roofline).
* Time: loop of N calls over rotating, fresh random input sets (2 sets when they fit in
  16 GB, else 1: the inputs are GBs, far beyond the 50 MB L2), then one synchronisation;
  time / N, median over R repetitions (throughput: host dispatch overlaps the device, the
  same for every implementation). JAX: `block_until_ready` on the last output, wall clock.
  torch-only implementations: CUDA events around the loop. The bridge (work on torch's and
  JAX's streams): wall clock around the loop + `torch.cuda.synchronize()`.
  N is chosen from a warm-up call so one repetition lasts ~target ms.
* Forward = inference forward (torch under `no_grad`, JAX: the jitted function alone), as
  when computing old / reference log-probs. Forward+backward = outputs and the gradient
  w.r.t. the logits for random cotangents of log-prob and entropy (JAX: `jax.vjp` inside
  one jit; torch: `torch.autograd.grad`). Megatron includes the `clone()` its callers do.
* Peak extra memory = peak allocation during one call minus what was live before it (the
  inputs): torch via `reset_peak_memory_stats` / `max_memory_allocated`; JAX via the
  compiled executable's buffer assignment (`memory_analysis()`: temp + output - alias),
  with the runtime `memory_stats()` delta as a cross-check (JAX cannot reset its peak, so
  that check is only informative when the process-wide peak rose during the call). The
  bridge: torch's peak delta + JAX's `bytes_in_use` / peak delta.
* JAX and PyTorch share the GPU: XLA_PYTHON_CLIENT_PREALLOCATE=false is set before JAX
  starts (and XLA_PYTHON_CLIENT_MEM_FRACTION=0.90 unless set), with the default BFC
  allocator: its pool grows but is never returned, so the torch-only implementations at
  the large sizes (T = 32768: 20 GB fp32 logits, ~100 GB for eager temporaries) run first
  of all, before JAX has allocated anything but the bandwidth test. The platform allocator would return
  memory but makes every allocation a synchronous cudaMalloc/cudaFree and would distort
  JAX's times; it is not used. Between cases everything is freed (del, gc,
  `torch.cuda.empty_cache()`); an OOM is recorded as "OOM" and the run continues.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import gc
import importlib.metadata
import inspect
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

IMPLS = ("jaxops-pallas", "jaxops-xla", "bridge", "jax-jit", "torch-compile", "torch-eager",
         "megatron")
TORCH_IMPLS = ("megatron", "torch-eager", "torch-compile")  # big sizes: run first (build_cases)
ANCHORS = ("jaxops-xla", "bridge", "jax-jit", "torch-compile", "torch-eager", "megatron")
DTYPES = ("float32", "bfloat16")
ITEMSIZE = {"float32": 4, "bfloat16": 2}
V_FULL, V_SHARD = 151_936, 151_936 // 8
MAIN_T, MAIN_V = 8192, V_FULL
MASK_THRESHOLD = 13  # keep mask = random byte < 13: ~5% kept (the target always counts)
MASK_DENSITY = MASK_THRESHOLD / 256
LOGIT_SCALE = 3.0  # logits ~ N(0, 3^2)
SCHEMA = 1


@dataclasses.dataclass(frozen=True)
class Case:
    impl: str
    dtype: str
    T: int
    V: int
    entropy: bool
    mask: bool

    @property
    def key(self):
        return (self.impl, self.dtype, self.T, self.V, self.entropy, self.mask)


def all_combos():
    return [(d, e, m) for d in DTYPES for e in (False, True) for m in (False, True)]


def size_groups(mode):
    """[(T, V, combos)] in priority order: the most important first."""
    if mode == "tiny":
        # Every implementation and code path once (both dtypes, entropy, mask), two sizes
        # for the plot, one vocabulary shard; Pallas runs in interpret mode (slow compiles).
        both = [("float32", False, False), ("bfloat16", True, True)]
        return [(32, 1000, both), (64, 1000, both), (32, 1000 // 8, [("float32", True, False)])]
    if mode == "quick":
        # One device call (< 9 min incl. compiles): everything at the headline size, then
        # two combos per other size (Megatron's and the entropy path), largest first.
        two = [("float32", False, False), ("bfloat16", True, False)]
        return [(MAIN_T, MAIN_V, all_combos()),
                (32768, V_FULL, two),
                (1024, V_FULL, two),
                (MAIN_T, V_SHARD, two)]
    return [(MAIN_T, MAIN_V, all_combos()),
            (MAIN_T, V_SHARD, all_combos()),
            (1024, V_FULL, all_combos()),
            (32768, V_FULL, all_combos())]


def roofline_bytes(dtype, T, V, mask):
    """(forward, forward+backward) bytes that must move."""
    logits = T * V * ITEMSIZE[dtype]
    mask_bytes = T * V if mask else 0
    return logits + mask_bytes, 3 * logits + 2 * mask_bytes


# ---------------------------------------------------------------------------- filters

_BOOL = {"1": True, "true": True, "yes": True, "y": True, "on": True,
         "0": False, "false": False, "no": False, "n": False, "off": False}
_DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "float32": "float32",
                  "bf16": "bfloat16", "bfloat16": "bfloat16"}


def parse_filters(specs):
    """['impl=jaxops-*,megatron', 'dtype=bf16', 'T=8192'] -> {key: [values]}."""
    filters = {}
    for spec in specs or []:
        for part in spec.split(";"):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise SystemExit(f"--filter: expected key=value[,value...], got {part!r}")
            key, values = part.split("=", 1)
            key = key.strip()
            if key not in ("impl", "dtype", "T", "V", "entropy", "mask"):
                raise SystemExit(f"--filter: unknown key {key!r} "
                                 "(impl, dtype, T, V, entropy, mask)")
            vals = [v.strip() for v in values.split(",") if v.strip()]
            if key == "dtype":
                vals = [_DTYPE_ALIASES.get(v.lower(), v) for v in vals]
            elif key in ("T", "V"):
                vals = [int(v) for v in vals]
            elif key in ("entropy", "mask"):
                vals = [_BOOL[v.lower()] for v in vals]
            filters.setdefault(key, []).extend(vals)
    return filters


def case_selected(case, filters):
    for key, vals in filters.items():
        value = getattr(case, key)
        if key == "impl":
            if not any(fnmatch.fnmatch(value, pattern) for pattern in vals):
                return False
        elif value not in vals:
            return False
    return True


def is_big(T, V):
    return T * V * 4 > 8 * 2**30  # fp32 logits over 8 GiB


def build_cases(mode, filters):
    """Cases in run order: size groups by priority, except that the torch-only cases of the
    big sizes come first of all, while JAX's memory pool is still small (module doc): they
    need tens of GB of temporaries, and JAX's pool never shrinks. Their torch.compile graphs
    (T dynamic) are the ones the later sizes reuse, so this costs no extra compiles."""
    cases = []
    for T, V, combos in size_groups(mode):
        for impl in IMPLS:
            for dtype, entropy, mask in combos:
                case = Case(impl, dtype, T, V, entropy, mask)
                if (mode == "tiny" and impl == "jaxops-pallas" and "impl" not in filters
                        and ((dtype, entropy, mask) != ("float32", False, False) or cases)):
                    continue  # interpret mode is slow (CPU): once; the op's tests cover it
                if case_selected(case, filters):
                    cases.append(case)
    front = [c for c in cases if c.impl in TORCH_IMPLS and is_big(c.T, c.V)]
    return front + [c for c in cases if c not in front]


# ---------------------------------------------------------------------------- helpers


def is_oom(exc):
    text = f"{type(exc).__name__} {exc}".lower()
    return any(s in text for s in ("out of memory", "resource_exhausted", "outofmemory",
                                   "resource exhausted", "failed to allocate"))


def short_error(exc, limit=300):
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


def _parse_kwarg(text):
    key, value = (s.strip() for s in text.split("=", 1))
    try:
        return key, json.loads(value.lower() if value in ("True", "False") else value)
    except ValueError:
        return key, value


def keep_measured(row, old, run_index):
    """--append: a case that this run skipped (time budget, a package missing on the device)
    keeps its earlier measured row rather than losing it, with a note saying so."""
    if old is None or old.get("status") != "ok" or not str(row.get("status")).startswith("skipped"):
        return row
    old = dict(old)
    old["note"] = f"kept from run {old.get('run', 0)}: run {run_index} was {row['status']}"
    print(f"[bench] {row['impl']} {row['dtype']} T={row['T']} V={row['V']}: {old['note']}",
          flush=True)
    return old


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
    except Exception:  # no git on the machine, or not a checkout
        pass
    return info


def package_version(name):
    try:
        return importlib.metadata.version(name)
    except Exception:
        return None


def slug(text):
    out = "".join(c.lower() if c.isalnum() else "-" for c in text)
    while "--" in out:
        out = out.replace("--", "-")
    return out.strip("-") or "device"


class Bench:
    """Holds the frameworks, the settings and the results; runs one case at a time."""

    def __init__(self, args, torch, jax):
        self.args = args
        self.torch = torch
        self.jax = jax
        import jax.numpy as jnp
        self.jnp = jnp
        self.on_gpu = args.on_gpu
        self.tdev = torch.device("cuda", 0) if self.on_gpu else torch.device("cpu")
        self.jdev = jax.devices()[0]
        self.tau = args.temperature
        self._megatron = None  # (fn, group) once initialised
        self._megatron_error = None
        self._bridge = None
        self._bridge_error = None
        self._compiled = {}  # torch.compile'd functions per (entropy, mask)
        self._generators = {}  # jitted JAX input generators per (shape, dtype, kind)
        self.seed = 0

    # --------------------------------------------------------------- data
    def next_seed(self):
        self.seed += 1
        return self.seed

    def n_sets(self, case):
        fwd_bytes, _ = roofline_bytes(case.dtype, case.T, case.V, case.mask)
        return 2 if 2 * fwd_bytes <= self.args.max_input_gb * 1e9 else 1

    def torch_inputs(self, case, requires_grad):
        torch = self.torch
        gen = torch.Generator(device=self.tdev).manual_seed(1000 + self.next_seed())
        dtype = getattr(torch, case.dtype)
        x = torch.randn((case.T, case.V), generator=gen, device=self.tdev, dtype=dtype)
        x.mul_(LOGIT_SCALE)
        x.requires_grad_(requires_grad)
        y = torch.randint(0, case.V, (case.T,), generator=gen, device=self.tdev,
                          dtype=torch.int64)
        m = None
        if case.mask:
            raw = torch.randint(0, 256, (case.T, case.V), generator=gen, device=self.tdev,
                                dtype=torch.uint8)
            m = raw < MASK_THRESHOLD
            del raw
        gl = torch.randn((case.T,), generator=gen, device=self.tdev, dtype=torch.float32)
        gh = torch.randn((case.T,), generator=gen, device=self.tdev, dtype=torch.float32)
        if case.impl == "torch-compile":
            # T varies from batch to batch in RL: compile with T dynamic, V static (one
            # graph per V, dtype and grad mode, reused across T; no recompile per T).
            import torch._dynamo as dynamo
            for t in (x, y, m):
                if t is not None:
                    dynamo.mark_dynamic(t, 0)
            for t in (x, m):
                if t is not None:
                    dynamo.mark_static(t, 1)
        return (x, y, m, gl, gh)

    def jax_inputs(self, case):
        jax, jnp = self.jax, self.jnp
        key = jax.random.key(2000 + self.next_seed())
        kx, ky, km, kg = jax.random.split(key, 4)
        dtype = jnp.dtype(case.dtype)
        shape = (case.T, case.V)
        gen = self._generators
        if (shape, dtype) not in gen:  # one compile per shape, not per call
            gen[(shape, dtype)] = jax.jit(
                lambda k: jax.random.normal(k, shape, dtype) * jnp.asarray(LOGIT_SCALE, dtype))
        if (shape, "mask") not in gen:  # random bytes: no [T, V] float32 temporary
            gen[(shape, "mask")] = jax.jit(
                lambda k: jax.random.bits(k, shape, jnp.uint8) < MASK_THRESHOLD)
        x = gen[(shape, dtype)](kx)
        y = jax.random.randint(ky, (case.T,), 0, case.V, jnp.int32)
        m = gen[(shape, "mask")](km) if case.mask else None
        gl, gh = jax.random.normal(kg, (2, case.T), jnp.float32)
        return jax.block_until_ready((x, y, m, gl, gh))

    # --------------------------------------------------------------- sync / memory
    def torch_sync(self):
        if self.on_gpu:
            self.torch.cuda.synchronize()

    def cleanup(self, full=True):
        """Free the device memory of dead objects. A full gc is needed after exceptions
        (tracebacks hold frames holding inputs); otherwise refcounting has freed them."""
        gc.collect() if full else gc.collect(1)
        if self.on_gpu:
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()

    def jax_mem(self):
        try:
            stats = self.jdev.memory_stats()
        except Exception:
            stats = None
        return stats or {}

    # --------------------------------------------------------------- timing
    def _choose_calls(self, est_s, n_sets):
        target = self.args.target_ms * 1e-3
        calls = math.ceil(target / max(est_s, 1e-7))
        calls = max(calls, n_sets, 2)
        calls = min(calls, self.args.max_calls)
        return max(calls - calls % n_sets, n_sets)  # every set equally often

    def time_loop(self, fn, arg_sets, kind):
        """Median per-call seconds of a loop of N calls; kind in {'jax', 'torch', 'wall'}."""
        n = len(arg_sets)
        sync = (lambda out: self.jax.block_until_ready(out)) if kind == "jax" else (
            lambda out: self.torch_sync())
        start = time.perf_counter()
        out = fn(*arg_sets[1 % n])
        sync(out)
        est = time.perf_counter() - start
        del out
        calls = self._choose_calls(est, n)
        use_events = kind == "torch" and self.on_gpu
        times = []
        for _ in range(self.args.reps):
            if use_events:
                torch = self.torch
                ev0 = torch.cuda.Event(enable_timing=True)
                ev1 = torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                ev0.record()
                for i in range(calls):
                    out = fn(*arg_sets[i % n])
                ev1.record()
                ev1.synchronize()
                times.append(ev0.elapsed_time(ev1) * 1e-3 / calls)
            else:
                if kind != "jax":
                    self.torch_sync()
                t0 = time.perf_counter()
                for i in range(calls):
                    out = fn(*arg_sets[i % n])
                sync(out)
                times.append((time.perf_counter() - t0) / calls)
            del out
        times.sort()
        return times[len(times) // 2], calls, times

    # --------------------------------------------------------------- implementations
    def torch_reference(self, x, y, m, with_entropy):
        """log_softmax(x.float() / tau) + gather + entropy; masked log-prob via masked_fill."""
        torch = self.torch
        z = x.float() / self.tau
        h = None
        if with_entropy or m is None:
            logp = torch.log_softmax(z, dim=-1)
        if with_entropy:
            h = -(logp.exp() * logp).sum(-1)
        if m is None:
            lp = logp.gather(-1, y[:, None]).squeeze(-1)
        else:
            cols = torch.arange(z.shape[-1], device=z.device)
            keep = m | (cols[None, :] == y[:, None])
            zm = z.masked_fill(~keep, float("-inf"))
            lp = zm.gather(-1, y[:, None]).squeeze(-1) - torch.logsumexp(zm, dim=-1)
        return lp, h

    def torch_compiled(self, entropy, mask):
        key = (entropy, mask)
        if key not in self._compiled:
            ref = self.torch_reference

            def fn(x, y, m):
                return ref(x, y, m, entropy)

            self._compiled[key] = self.torch.compile(fn, fullgraph=True)
        return self._compiled[key]

    def megatron(self):
        if self._megatron is None and self._megatron_error is None:
            try:
                torch = self.torch
                import torch.distributed as dist
                import warnings
                with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
                    warnings.simplefilter("ignore")
                    if not self.on_gpu:
                        # CPU (CI): Megatron's jit fuser is torch.compile (inductor, C++
                        # builds): far too slow for a smoke run; use its no-op fuser there.
                        import megatron.core.jit as mjit
                        mjit.disable_jit_fuser()
                    from megatron.core.fusions.fused_cross_entropy import (
                        fused_vocab_parallel_cross_entropy)
                if not dist.is_initialized():
                    if self.on_gpu:
                        torch.cuda.set_device(0)
                    fd, path = tempfile.mkstemp(prefix="bench-pg-")
                    os.close(fd)
                    os.unlink(path)
                    dist.init_process_group("nccl" if self.on_gpu else "gloo",
                                            init_method=f"file://{path}", rank=0, world_size=1)
                self._megatron = (fused_vocab_parallel_cross_entropy, dist.group.WORLD)
            except Exception as exc:  # not installed, no NCCL, ...
                self._megatron_error = short_error(exc)
        if self._megatron_error:
            raise RuntimeError(f"megatron-core not usable: {self._megatron_error}")
        return self._megatron

    def bridge(self):
        if self._bridge is None and self._bridge_error is None:
            try:
                import bridge as bridge_mod
                fn = bridge_mod.logprob_entropy
                params = inspect.signature(fn).parameters
                self._bridge = (fn, "temperature" in params)
            except Exception as exc:
                self._bridge_error = short_error(exc)
        return self._bridge

    def torch_forward_fn(self, case):
        """(x, y, m) -> (log_prob, entropy or None), for the torch-side implementations."""
        if case.impl == "torch-eager":
            return lambda x, y, m: self.torch_reference(x, y, m, case.entropy)
        if case.impl == "torch-compile":
            return self.torch_compiled(case.entropy, case.mask)
        if case.impl == "megatron":
            fused, group = self.megatron()
            T, V = case.T, case.V

            def fn(x, y, m):
                # Megatron mutates an fp32 input in place: callers pass a clone (timed here).
                loss = fused(x.clone().view(T, 1, V), y.view(T, 1), group)
                return -loss.view(T), None
            return fn
        if case.impl == "bridge":
            fn, takes_tau = self.bridge()
            extra = {"temperature": self.tau} if takes_tau else {}
            if not takes_tau and self.tau != 1.0:
                raise RuntimeError("bridge.logprob_entropy takes no temperature")

            extra.update(self.args.bridge_kwargs)

            def bridged(x, y, m):
                return fn(x, y, keep_mask=m, with_entropy=case.entropy,
                          entropy_grad=case.entropy, **extra)
            return bridged
        raise ValueError(case.impl)

    def jax_forward_fn(self, case):
        """(x, y, m) -> (log_prob, entropy or None), pure JAX (jitted by the caller)."""
        jax, jnp = self.jax, self.jnp
        tau = self.tau
        if case.impl in ("jaxops-pallas", "jaxops-xla"):
            import jaxops
            impl = case.impl.split("-")[1]
            config = self.args.pallas_config if impl == "pallas" else None

            def fn(x, y, m):
                return jaxops.logprob_entropy(
                    x, y, keep_mask=m, temperature=tau, with_entropy=case.entropy,
                    entropy_grad=case.entropy, implementation=impl, pallas_config=config)
            return fn
        if case.impl == "jax-jit":
            def naive(x, y, m):
                z = x.astype(jnp.float32) / tau
                h = None
                if case.entropy or m is None:
                    logp = jax.nn.log_softmax(z, axis=-1)
                if case.entropy:
                    h = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
                if m is None:
                    lp = jnp.take_along_axis(logp, y[:, None], axis=-1)[:, 0]
                else:
                    cols = jnp.arange(z.shape[-1], dtype=y.dtype)
                    keep = m | (cols[None, :] == y[:, None])
                    zm = jnp.where(keep, z, -jnp.inf)
                    lp = (jnp.take_along_axis(zm, y[:, None], axis=-1)[:, 0]
                          - jax.nn.logsumexp(zm, axis=-1))
                return lp, h
            return naive
        raise ValueError(case.impl)

    # --------------------------------------------------------------- one case
    def skip_reason(self, case):
        if case.impl == "megatron" and (case.entropy or case.mask):
            return "n/a: Megatron's fused CE has no entropy and no keep mask"
        if case.impl == "torch-compile" and self.args.tiny and not self.args.with_compile:
            return "skipped: torch.compile is not run in --tiny (slow on CPU; --with-compile)"
        if case.impl == "bridge" and self.bridge() is None:
            return f"skipped: bridge not importable ({self._bridge_error})"
        if case.impl == "megatron":
            try:
                self.megatron()
            except Exception as exc:
                return f"skipped: {exc}"
        return None

    def run_case(self, case):
        fwd_bytes, fb_bytes = roofline_bytes(case.dtype, case.T, case.V, case.mask)
        bw = self.bandwidth["used_Bps"]
        row = dict(dataclasses.asdict(case))
        row.update(
            framework="jax" if case.impl in ("jaxops-pallas", "jaxops-xla", "jax-jit") else "torch",
            fwd_bytes=fwd_bytes, fb_bytes=fb_bytes,
            fwd_roof_ms=fwd_bytes / bw * 1e3, fb_roof_ms=fb_bytes / bw * 1e3,
            grad_bytes=case.T * case.V * ITEMSIZE[case.dtype],
            status="ok", fwd_status=None, fb_status=None)
        reason = self.skip_reason(case)
        if reason:
            row.update(status=reason, fwd_status=reason, fb_status=reason)
            return row
        start = time.perf_counter()
        # What else holds the device (to read an OOM): JAX's pool never shrinks.
        jstats = self.jax_mem()
        row["jax_pool_bytes_at_start"] = jstats.get("pool_bytes", jstats.get("bytes_reserved"))
        if self.on_gpu:
            row["device_free_bytes_at_start"] = int(self.torch.cuda.mem_get_info()[0])
        failed = False
        try:
            if row["framework"] == "jax":
                self._run_jax(case, row)
            else:
                self._run_torch(case, row)
        except Exception as exc:  # input generation failed (OOM) or similar
            failed = True
            status = "OOM" if is_oom(exc) else f"error: {short_error(exc)}"
            if not is_oom(exc):
                traceback.print_exc()
            for phase in ("fwd", "fb"):
                if row.get(f"{phase}_status") is None:
                    row[f"{phase}_status"] = status
            del exc
        finally:
            self.cleanup(full=failed or "ok" not in (row["fwd_status"], row["fb_status"]))
        statuses = {row["fwd_status"], row["fb_status"]}
        row["status"] = "ok" if statuses == {"ok"} else (
            "OOM" if "OOM" in statuses else next(s for s in (row["fwd_status"], row["fb_status"])
                                                 if s != "ok"))
        for phase in ("fwd", "fb"):
            if row.get(f"{phase}_ms"):
                row[f"{phase}_x_roof"] = row[f"{phase}_ms"] / row[f"{phase}_roof_ms"]
        row["case_s"] = time.perf_counter() - start
        return row

    def _phase(self, row, phase, body):
        """Run one phase, recording OOM / errors in the row instead of raising."""
        try:
            body()
            row[f"{phase}_status"] = "ok"
        except Exception as exc:
            if is_oom(exc):
                row[f"{phase}_status"] = "OOM"
            else:
                traceback.print_exc()
                row[f"{phase}_status"] = f"error: {short_error(exc)}"
            del exc
            self.cleanup()

    def _run_jax(self, case, row):
        jax = self.jax
        fwd = self.jax_forward_fn(case)

        def fb(x, y, m, gl, gh):
            (lp, h), vjp = jax.vjp(lambda x: fwd(x, y, m), x)
            (g,) = vjp((gl, gh if case.entropy else None))
            return lp, h, g

        sets = [self.jax_inputs(case) for _ in range(self.n_sets(case))]
        row["n_input_sets"] = len(sets)
        row["mem_method"] = "xla-buffer-assignment"
        fwd_sets = [s[:3] for s in sets]

        def run(phase, fn, arg_sets):
            t0 = time.perf_counter()
            compiled = jax.jit(fn).lower(*arg_sets[0]).compile()
            row[f"{phase}_compile_s"] = time.perf_counter() - t0
            try:
                ma = compiled.memory_analysis()
                row[f"{phase}_peak_extra_bytes"] = int(
                    ma.temp_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes)
                row[f"{phase}_temp_bytes"] = int(ma.temp_size_in_bytes)
            except Exception as exc:
                row[f"{phase}_peak_extra_bytes"] = None
                row[f"{phase}_mem_note"] = short_error(exc, 120)
            out = compiled(*arg_sets[0])  # warm-up
            jax.block_until_ready(out)
            self._record_outputs(row, phase, out)
            del out
            before = self.jax_mem()
            out = compiled(*arg_sets[0])
            jax.block_until_ready(out)
            after = self.jax_mem()
            del out
            row[f"{phase}_runtime_extra_bytes"] = self._jax_runtime_extra(before, after)
            sec, calls, _ = self.time_loop(compiled, arg_sets, "jax")
            row[f"{phase}_ms"] = sec * 1e3
            row[f"{phase}_calls"] = calls

        self._phase(row, "fwd", lambda: run("fwd", fwd, fwd_sets))
        self._phase(row, "fb", lambda: run("fb", fb, sets))
        del sets, fwd_sets

    @staticmethod
    def _jax_runtime_extra(before, after):
        """Extra device bytes of one JAX call; None where memory_stats is unavailable."""
        if "bytes_in_use" not in before or "bytes_in_use" not in after:
            return None
        extra = after["bytes_in_use"] - before["bytes_in_use"]  # live outputs
        peak_b, peak_a = before.get("peak_bytes_in_use"), after.get("peak_bytes_in_use")
        if peak_b is not None and peak_a is not None and peak_a > peak_b:
            extra = max(extra, peak_a - before["bytes_in_use"])
        return int(extra)

    def _record_outputs(self, row, phase, out):
        """Means of the outputs: a cheap cross-implementation sanity check."""
        if phase != "fb":
            return
        try:
            lp, h = out[0], out[1]
            row["lp_mean"] = float(self._to_float(lp.mean()))
            row["h_mean"] = None if h is None else float(self._to_float(h.mean()))
        except Exception:
            pass

    @staticmethod
    def _to_float(value):
        if hasattr(value, "item"):
            return value.item()
        return float(value)

    def _run_torch(self, case, row):
        torch = self.torch
        fwd = self.torch_forward_fn(case)
        kind = "wall" if case.impl == "bridge" else "torch"

        def fwd_nograd(x, y, m, gl=None, gh=None):
            with torch.no_grad():
                return fwd(x, y, m)

        def fb(x, y, m, gl, gh):
            lp, h = fwd(x, y, m)
            outs, cots = [lp], [gl]
            if h is not None and case.entropy:
                outs.append(h)
                cots.append(gh)
            (g,) = torch.autograd.grad(outs, [x], cots)
            return lp.detach(), (None if h is None else h.detach()), g

        sets = [self.torch_inputs(case, requires_grad=True) for _ in range(self.n_sets(case))]
        row["n_input_sets"] = len(sets)
        row["mem_method"] = ("torch-allocator+jax-memory-stats" if case.impl == "bridge"
                             else "torch-allocator")
        self.torch_sync()

        def run(phase, fn):
            t0 = time.perf_counter()
            out = fn(*sets[0])  # compile / warm-up
            self.torch_sync()
            row[f"{phase}_first_call_s"] = time.perf_counter() - t0
            self._record_outputs(row, phase, out)
            del out
            out = fn(*sets[0])
            self.torch_sync()
            del out
            self.torch_sync()
            if self.on_gpu:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            jbefore = self.jax_mem() if case.impl == "bridge" else {}
            out = fn(*sets[0])
            self.torch_sync()
            extra = None
            if self.on_gpu:
                extra = torch.cuda.max_memory_allocated() - base
            if case.impl == "bridge":
                jextra = self._jax_runtime_extra(jbefore, self.jax_mem())
                row[f"{phase}_jax_side_bytes"] = jextra
                extra = None if extra is None else extra + (jextra or 0)
            row[f"{phase}_peak_extra_bytes"] = None if extra is None else int(extra)
            del out
            sec, calls, _ = self.time_loop(fn, sets, kind)
            row[f"{phase}_ms"] = sec * 1e3
            row[f"{phase}_calls"] = calls

        self._phase(row, "fwd", lambda: run("fwd", fwd_nograd))
        self._phase(row, "fb", lambda: run("fb", fb))
        del sets

    # --------------------------------------------------------------- bandwidth
    def measure_bandwidth(self):
        torch, jax, jnp = self.torch, self.jax, self.jnp
        n = (MAIN_T * MAIN_V) if not self.args.tiny else 1 << 22  # 5 GB fp32 on GPU
        moved = 2 * n * 4  # read + write
        out = {"elements": n, "bytes_moved_per_call": moved}
        reps, self.args.reps = self.args.reps, max(self.args.reps, 5)
        try:
            src = torch.randn((n,), device=self.tdev, dtype=torch.float32)
            dst = torch.empty_like(src)
            sec, _, _ = self.time_loop(lambda: dst.copy_(src), [()], "torch")
            out["torch_copy_Bps"] = moved / sec
            sec, _, _ = self.time_loop(lambda: torch.mul(src, 1.0000001, out=dst), [()], "torch")
            out["torch_scale_Bps"] = moved / sec
            del src, dst
            self.cleanup()
            a = jax.random.normal(jax.random.key(7), (n,), jnp.float32)
            scale = jax.jit(lambda a: a * jnp.float32(1.0000001))
            jax.block_until_ready(scale(a))
            sec, _, _ = self.time_loop(scale, [(a,)], "jax")
            out["jax_scale_Bps"] = moved / sec
            del a
        finally:
            self.args.reps = reps
            self.cleanup()
        measured = {k: v for k, v in out.items() if k.endswith("_Bps")}
        out["used"] = max(measured, key=measured.get)
        out["used_Bps"] = measured[out["used"]]
        out["rule"] = "roofline uses the max of the measured copy bandwidths (bytes read + written)"
        return out


# ---------------------------------------------------------------------------- output


def fmt(value, spec=".3f", none="-"):
    return none if value is None else format(value, spec)


def print_row(row):
    ent = "H" if row["entropy"] else "-"
    msk = "M" if row["mask"] else "-"
    head = f"{row['impl']:14s} {row['dtype']:8s} T={row['T']:<6d} V={row['V']:<6d} {ent}{msk}"
    if row["status"] != "ok" and not row.get("fwd_ms") and not row.get("fb_ms"):
        print(f"{head}  {row['status']}", flush=True)
        return
    gb = row.get("fb_peak_extra_bytes")
    print(f"{head}  fwd {fmt(row.get('fwd_ms'))} ms ({fmt(row.get('fwd_x_roof'), '.2f')}x roof)"
          f"  fwd+bwd {fmt(row.get('fb_ms'))} ms ({fmt(row.get('fb_x_roof'), '.2f')}x roof)"
          f"  peak extra fwd+bwd {fmt(None if gb is None else gb / 1e9, '.2f')} GB"
          + ("" if row["status"] == "ok" else f"  [{row['status']}]"), flush=True)


def write_json(path, results):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Implementations: " + ", ".join(IMPLS))
    parser.add_argument("--device-name", default=None,
                        help="results name, e.g. h200 (default: from the GPU name, or 'cpu')")
    parser.add_argument("--out", default=None,
                        help="results JSON (default benchmarks/results/<device-name>.json)")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny sizes (forced when there is no CUDA GPU)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer cases: all combos at T=8192, V=151936; two combos (fp32 "
                             "log-prob only, bf16 with entropy; no mask) at the other sizes "
                             "(fits one 10-minute device call)")
    parser.add_argument("--filter", action="append", default=[],
                        help="key=v1,v2 with key in impl (glob), dtype, T, V, entropy, mask; "
                             "repeat (or separate with ';') to AND them")
    parser.add_argument("--with-compile", action="store_true",
                        help="run torch.compile also in --tiny (slow on CPU)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (median over them)")
    parser.add_argument("--target-ms", type=float, default=None,
                        help="duration of one repetition (sets the calls per repetition)")
    parser.add_argument("--max-calls", type=int, default=None)
    parser.add_argument("--max-input-gb", type=float, default=16.0,
                        help="use 2 rotating input sets when they fit in this, else 1")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new case after this many seconds (rows say so)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="tau (1.0: Megatron, which takes none, computes the same thing)")
    parser.add_argument("--pallas-config", default="",
                        help="PallasConfig fields for jaxops-pallas, e.g. block_v=4096,num_warps=8")
    parser.add_argument("--bridge-kwargs", default="",
                        help="extra keyword arguments for bridge.logprob_entropy, e.g. "
                             "check_targets=False,implementation=pallas (default: none, as callers)")
    parser.add_argument("--append", action="store_true",
                        help="add to an existing --out file of the same device (rows measured "
                             "again replace the old ones, a case skipped in this run keeps its "
                             "earlier measured row; each row records its run)")
    parser.add_argument("--dry-run", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)

    # Environment before JAX starts (module doc): share the GPU with PyTorch.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")
    sys.path.insert(0, REPO)
    sys.path.insert(0, HERE)

    filters = parse_filters(args.filter)
    if args.dry_run:  # no GPU needed to list what a mode would run
        mode = "tiny" if args.tiny else ("quick" if args.quick else "full")
        cases = build_cases(mode, filters)
        for case in cases:
            print(case)
        print(f"{len(cases)} cases ({mode})")
        return 0
    t_start = time.perf_counter()
    import torch
    import jax

    args.on_gpu = torch.cuda.is_available() and jax.default_backend() == "gpu"
    if not args.on_gpu and not args.tiny:
        print("[bench] no CUDA GPU for both torch and jax: running --tiny", flush=True)
        args.tiny = True
    mode = "tiny" if args.tiny else ("quick" if args.quick else "full")
    defaults = {"tiny": (3, 2.0, 4, None), "quick": (7, 30.0, 50, 450),
                "full": (15, 60.0, 100, None)}[mode]
    args.reps = args.reps or defaults[0]
    args.target_ms = args.target_ms or defaults[1]
    args.max_calls = args.max_calls or defaults[2]
    if args.budget_s is None:
        args.budget_s = defaults[3]
    pallas_fields = dict(_parse_kwarg(p) for p in args.pallas_config.split(",") if p.strip())
    args.pallas_config = None
    args.bridge_kwargs = dict(_parse_kwarg(p) for p in args.bridge_kwargs.split(",") if p.strip())
    if pallas_fields:
        import jaxops
        args.pallas_config = jaxops.PallasConfig(**pallas_fields)

    cases = build_cases(mode, filters)

    if args.on_gpu:
        gpu_name = torch.cuda.get_device_name(0)
    else:
        gpu_name = platform.processor() or platform.machine() or "cpu"
    device_name = args.device_name or ("cpu" if not args.on_gpu else slug(gpu_name))
    out_path = args.out or os.path.join(HERE, "results", f"{device_name}.json")

    # torch.compile: one cache entry per (dtype, grad mode, shape class) per function; the
    # default limit (8) would silently fall back to eager.
    try:
        import torch._dynamo as dynamo
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(dynamo.config, name):
                setattr(dynamo.config, name, 1024)
    except Exception:
        pass

    bench = Bench(args, torch, jax)
    results = {
        "schema": SCHEMA,
        "device_name": device_name,
        "device": {
            "name": gpu_name,
            "jax_device": str(jax.devices()[0]),
            "jax_device_kind": getattr(jax.devices()[0], "device_kind", None),
            "platform": jax.default_backend(),
            "total_memory_bytes": (torch.cuda.get_device_properties(0).total_memory
                                   if args.on_gpu else None),
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git": git_info(),
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "jaxlib": package_version("jaxlib"),
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "triton": package_version("triton"),
            "megatron_core": package_version("megatron-core") or package_version("megatron_core"),
            "numpy": package_version("numpy"),
        },
        "command": [os.path.relpath(sys.argv[0], REPO) if sys.argv and sys.argv[0] else ""]
                   + list(sys.argv[1:] if argv is None else argv),
        "mode": mode,
        "env": {k: os.environ.get(k) for k in (
            "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
            "XLA_PYTHON_CLIENT_ALLOCATOR", "XLA_FLAGS", "PYTORCH_CUDA_ALLOC_CONF")},
        "settings": {
            "reps": args.reps, "target_ms": args.target_ms, "max_calls": args.max_calls,
            "max_input_gb": args.max_input_gb, "budget_s": args.budget_s,
            "temperature": args.temperature, "mask_density": MASK_DENSITY,
            "logits": f"N(0, {LOGIT_SCALE}^2) in the logits' dtype",
            "pallas_config": str(args.pallas_config),
            "bridge_kwargs": args.bridge_kwargs,
            "megatron_jit_fuser": ("torch.compile (Megatron's default)" if args.on_gpu
                                   else "disabled (CPU smoke run)"),
            "filters": {k: v for k, v in filters.items()},
        },
        "method": {
            "roofline": "bytes / max(measured copy bandwidths); fwd = T*V*itemsize (+T*V "
                        "mask), fwd+bwd = 3*T*V*itemsize (+2*T*V mask)",
            "timing": "median over reps of (loop of N calls on rotating fresh random input "
                      "sets, then one sync) / N. JAX: block_until_ready, wall clock; torch: "
                      "CUDA events around the loop; bridge: wall clock + "
                      "torch.cuda.synchronize()",
            "forward": "inference forward (torch.no_grad; the jitted function alone)",
            "torch.compile": "torch.compile(fullgraph=True), default mode; T marked dynamic "
                             "(mark_dynamic), V static (mark_static)",
            "fwd+bwd": "outputs + gradient for random cotangents (jax.vjp in one jit; "
                       "torch.autograd.grad); megatron includes the clone",
            "memory": "peak extra bytes of one call over what was live (inputs): torch "
                      "max_memory_allocated delta; JAX compiled memory_analysis temp+output-"
                      "alias (runtime memory_stats delta in *_runtime_extra_bytes, only "
                      "meaningful when the process peak rose); bridge: torch delta + JAX "
                      "bytes_in_use/peak delta",
            "jax_memory_stats_keys": sorted(bench.jax_mem().keys()),
        },
        "bandwidth": None,
        "rows": [],
        "complete": False,
    }
    print(f"[bench] {mode}: {len(cases)} cases on {gpu_name} ({jax.devices()[0]}), jax "
          f"{jax.__version__}, torch {torch.__version__}; writing {out_path}", flush=True)
    bench.bandwidth = results["bandwidth"] = bench.measure_bandwidth()
    bw = results["bandwidth"]
    print("[bench] copy bandwidth (read + write): " + ", ".join(
        f"{k[:-4]} {bw[k] / 1e12:.3f} TB/s" for k in bw if k.endswith("_Bps") and k != "used_Bps")
        + f"; roofline uses {bw['used'][:-4]}", flush=True)
    run_meta = {k: results[k] for k in ("date", "git", "versions", "command", "mode", "env",
                                        "settings", "bandwidth")}
    results["runs"] = [run_meta]
    earlier = {}  # --append: the previous rows of the cases this run re-measures
    if args.append and os.path.exists(out_path):
        # Add this run's rows to an earlier run's file (rows re-measured here replace the
        # old ones). The top-level metadata stays the first run's; every row names its run
        # and carries the bandwidth its roofline used, so each number stays traceable.
        with open(out_path) as f:
            prev = json.load(f)
        if prev.get("device_name") != device_name:
            raise SystemExit(f"--append: {out_path} is for {prev.get('device_name')!r}, "
                             f"not {device_name!r}")
        keys = {c.key for c in cases}
        old_runs = prev.get("runs") or [{k: prev.get(k) for k in run_meta}]
        for k in ("date", "git", "versions", "command", "mode", "env", "settings", "bandwidth",
                  "device", "method"):
            results[k] = prev.get(k, results[k])
        results["runs"] = old_runs + [run_meta]
        results["rows"] = []
        for r in prev.get("rows", []):
            key = (r["impl"], r["dtype"], r["T"], r["V"], r["entropy"], r["mask"])
            if key in keys:
                earlier[key] = r
            else:
                results["rows"].append(r)
        print(f"[bench] appending run {len(old_runs)} to {out_path} "
              f"({len(results['rows'])} earlier rows kept)", flush=True)
    run_index = len(results["runs"]) - 1
    write_json(out_path, results)

    group = None
    for case in cases:
        if (case.T, case.V) != group:
            group = (case.T, case.V)
            gc.collect()
            bench._generators.clear()  # their executables are all that JAX caches per size
        elapsed = time.perf_counter() - t_start
        if args.budget_s and elapsed > args.budget_s:
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

    import report
    results["speedups"] = report.speedups(results)
    results["complete"] = True
    results["elapsed_s"] = time.perf_counter() - t_start
    write_json(out_path, results)
    print()
    print(report.text_table(results))
    print()
    print(report.text_speedups(results))
    print(f"\n[bench] done in {results['elapsed_s']:.0f} s; results in {out_path}", flush=True)
    if bench._megatron is not None:
        try:
            import torch.distributed as dist
            dist.destroy_process_group()
        except Exception:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
