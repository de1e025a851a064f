"""bench.py's engine: one case at a time (timing, peak memory; its inputs are made by
inputs.py), and the copy bandwidth the roofline divides by.

Measurement rules (all recorded in the JSON under "method"):

* Roofline = bytes that must move (harness.roofline_bytes) / copy bandwidth. Forward:
  T*V*itemsize (+ T*V for the bool mask). Forward+backward: three passes of the logits
  (read, read, write the gradient) + two reads of the mask. The bandwidth is measured in
  this run (bytes read + written): a torch device-to-device `copy_`, a torch elementwise
  scale and a jax.jit elementwise scale of a large array; the roofline uses the MAX of
  the three (the strictest roofline).
* Time (harness.time_calls): loop of N calls over rotating, fresh random input sets (2
  sets when they fit in 16 GB, else 1: the inputs are GBs, far beyond the 50 MB L2), then
  one synchronisation; time / N, median over R repetitions (throughput: host dispatch
  overlaps the device, the same for every implementation). JAX: `block_until_ready` on
  the last output, wall clock. torch-only implementations: CUDA events around the loop.
  The bridge (work on torch's and JAX's streams): wall clock around the loop +
  `torch.cuda.synchronize()`. N is chosen from a warm-up call so one repetition lasts
  ~target ms.
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
  allocator: its pool grows but is never returned, so the implementations that allocate
  from torch's pool (the torch-only ones and the bridge) at the large sizes (T = 32768:
  20 GB fp32 logits, ~100 GB for eager temporaries) run first of all, before JAX has
  allocated anything but the bandwidth test. The platform allocator would return memory
  but makes every allocation a synchronous cudaMalloc/cudaFree and would distort JAX's
  times; it is not used. Between cases everything is freed (del, gc,
  `torch.cuda.empty_cache()`); an OOM is recorded as "OOM" and the run continues.
* Memory held by the bench itself: a case's peak is its inputs, one call's outputs (the
  gradient) and the implementation's own temporaries. The timing loop drops a call's
  outputs before the next call (harness.time_calls), the [T, V] inputs are made in row
  blocks (no full-size temporaries: inputs.py's `block_rows`), nothing of a case outlives
  it, and each row records what was still allocated when it started
  (`jax_live_bytes_at_start`, and `torch_allocated_bytes_at_start` on a GPU: both ~0) next
  to JAX's pool and the free device memory. Byte arithmetic at fp32 T = 32,768,
  V = 151,936 (T*V = 4.98e9): logits 19.9 GB, gradient 19.9 GB, bool mask 5.0 GB.
  Forward+backward holds logits + 1 gradient = 39.8 GB, what the op alone needs; with the
  previous call's gradient alive while the next call allocates its own, and the input
  generation's full-size temporaries (JAX's random bits, torch's uint8 mask bytes), it
  would hold 59.7 GB and more. JAX's pool (BFC, never returned) still keeps the regions
  earlier cases grew (the bandwidth test's 2 x 5 GB, the headline size's) next to that;
  `jax_pool_bytes_at_start` and `device_free_bytes_at_start` show them.
"""

from __future__ import annotations

import dataclasses
import gc
import time
import traceback
import warnings

from benchmarks import harness
from benchmarks.cases import JAX_IMPLS, MAIN_T, MAIN_V
from benchmarks.harness import is_oom, itemsize, roofline_bytes, roofline_ms, short_error
from benchmarks.impls import Implementations
from benchmarks.inputs import CaseInputs


class Bench:
    """Holds the frameworks, the settings and the implementations; runs one case at a time."""

    def __init__(self, args, torch, jax):
        self.args = args
        self.torch = torch
        self.jax = jax
        self.jnp = jax.numpy
        self.on_gpu = args.on_gpu
        self.tdev = torch.device("cuda", 0) if self.on_gpu else torch.device("cpu")
        self.jdev = jax.devices()[0]
        self.impls = Implementations(torch, jax, tau=args.temperature, on_gpu=self.on_gpu,
                                     pallas_config=args.pallas_config,
                                     mosaic_config=args.mosaic_config,
                                     bridge_kwargs=args.bridge_kwargs)
        self.inputs = CaseInputs(torch, jax, self.tdev, args.max_input_gb)
        self.bandwidth = None  # measure_bandwidth()

    def new_size(self):
        """Between sizes: the input generators' executables are all JAX caches per size."""
        gc.collect()
        self.inputs.clear()

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

    def jax_live_bytes(self):
        """Bytes of the JAX arrays alive now (jax.live_arrays); None if unavailable."""
        try:
            return int(sum(a.nbytes for a in self.jax.live_arrays()))
        except Exception:  # an old JAX without live_arrays: the row says None
            return None

    def jax_mem(self):
        """The device's memory_stats(); {} where the backend has none (e.g. some CPUs)."""
        try:
            stats = self.jdev.memory_stats()
        except Exception:  # unsupported here: memory rows then read None, by design
            stats = None
        return stats or {}

    # --------------------------------------------------------------- timing
    def time_loop(self, fn, arg_sets, kind, reps=None):
        """harness.time_calls for kind 'jax' (block_until_ready, wall clock), 'torch'
        (CUDA events on a GPU) or 'wall' (torch.cuda.synchronize, wall clock)."""
        target_s, max_calls = self.args.target_ms * 1e-3, self.args.max_calls
        timing = harness.time_calls(
            fn, arg_sets, reps=reps or self.args.reps,
            calls=lambda est: harness.choose_calls(est, len(arg_sets), target_s, max_calls),
            sync=self.jax.block_until_ready if kind == "jax" else lambda out: self.torch_sync(),
            before_rep=None if kind == "jax" else self.torch_sync,
            cuda_events=self.torch if kind == "torch" and self.on_gpu else None)
        return timing.seconds, timing.calls

    # --------------------------------------------------------------- one case
    def skip_reason(self, case):
        if case.impl == "megatron" and (case.entropy or case.mask):
            return "n/a: Megatron's fused CE has no entropy and no keep mask"
        if case.impl == "torch-compile" and self.args.tiny and not self.args.with_compile:
            return "skipped: torch.compile is not run in --tiny (slow on CPU; --with-compile)"
        if case.impl == "megatron":
            try:
                self.impls.megatron()
            except Exception as exc:
                return f"skipped: {exc}"
        return None

    def run_case(self, case):
        fwd_bytes, fb_bytes = roofline_bytes(case.dtype, case.T, case.V, case.mask)
        bw = self.bandwidth["used_Bps"]
        row = dict(dataclasses.asdict(case))
        row.update(
            framework="jax" if case.impl in JAX_IMPLS else "torch",
            fwd_bytes=fwd_bytes, fb_bytes=fb_bytes,
            fwd_roof_ms=roofline_ms(fwd_bytes, bw), fb_roof_ms=roofline_ms(fb_bytes, bw),
            grad_bytes=case.T * case.V * itemsize(case.dtype),
            status="ok", fwd_status=None, fb_status=None)
        reason = self.skip_reason(case)
        if reason:
            row.update(status=reason, fwd_status=reason, fb_status=reason)
            return row
        start = time.perf_counter()
        # What else holds the device (to read an OOM): JAX's pool never shrinks.
        jstats = self.jax_mem()
        row["jax_pool_bytes_at_start"] = jstats.get("pool_bytes", jstats.get("bytes_reserved"))
        # What the bench still holds from earlier cases (should be ~0: runner.py's doc).
        row["jax_live_bytes_at_start"] = self.jax_live_bytes()
        if self.on_gpu:
            row["device_free_bytes_at_start"] = int(self.torch.cuda.mem_get_info()[0])
            row["torch_allocated_bytes_at_start"] = int(self.torch.cuda.memory_allocated())
        failed = False
        try:
            if row["framework"] == "jax":
                self._run_jax(case, row)
            else:
                self._run_torch(case, row)
        except Exception as exc:  # input generation failed (OOM), a broken bridge, ...
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
        harness.run_phase(row, phase, body, self.cleanup)

    def _run_jax(self, case, row):
        jax = self.jax
        fwd = self.impls.jax_forward_fn(case)

        def fb(x, y, m, gl, gh):
            (lp, h), vjp = jax.vjp(lambda x: fwd(x, y, m), x)
            (g,) = vjp((gl, gh if case.entropy else None))
            return lp, h, g

        sets = [self.inputs.jax_inputs(case) for _ in range(self.inputs.n_sets(case))]
        row["n_input_sets"] = len(sets)
        row["mem_method"] = "xla-buffer-assignment"
        fwd_sets = [s[:3] for s in sets]

        def run(phase, fn, arg_sets):
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                # Recorded in the row: e.g. a Pallas backend that cannot take a shape
                # warns and computes the call with XLA, which the row must not hide.
                warnings.simplefilter("always")
                compiled = jax.jit(fn).lower(*arg_sets[0]).compile()
            row[f"{phase}_compile_s"] = time.perf_counter() - t0
            if caught:
                row[f"{phase}_warnings"] = sorted({str(w.message)[:300] for w in caught})
                for text in row[f"{phase}_warnings"]:
                    print(f"[bench] {case.impl} {phase}: warning: {text}", flush=True)
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
            sec, calls = self.time_loop(compiled, arg_sets, "jax")
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
        """Means of the outputs: a cheap cross-implementation sanity check. A failure to
        read them is recorded in the row (outputs_error) and printed."""
        if phase != "fb":
            return
        try:
            lp, h = out[0], out[1]
            row["lp_mean"] = float(self._to_float(lp.mean()))
            row["h_mean"] = None if h is None else float(self._to_float(h.mean()))
        except Exception as exc:
            row["outputs_error"] = short_error(exc)
            print(f"[bench] {row['impl']} {row['dtype']} T={row['T']} V={row['V']}: "
                  f"could not read the outputs' means: {row['outputs_error']}", flush=True)

    @staticmethod
    def _to_float(value):
        if hasattr(value, "item"):
            return value.item()
        return float(value)

    def _run_torch(self, case, row):
        torch = self.torch
        fwd = self.impls.torch_forward_fn(case)
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

        sets = [self.inputs.torch_inputs(case, requires_grad=True)
                for _ in range(self.inputs.n_sets(case))]
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
            sec, calls = self.time_loop(fn, sets, kind)
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
        reps = max(self.args.reps, 5)
        try:
            src = torch.randn((n,), device=self.tdev, dtype=torch.float32)
            dst = torch.empty_like(src)
            sec, _ = self.time_loop(lambda: dst.copy_(src), [()], "torch", reps)
            out["torch_copy_Bps"] = moved / sec
            sec, _ = self.time_loop(lambda: torch.mul(src, 1.0000001, out=dst), [()], "torch",
                                    reps)
            out["torch_scale_Bps"] = moved / sec
            del src, dst
            self.cleanup()
            a = jax.random.normal(jax.random.key(7), (n,), jnp.float32)
            scale = jax.jit(lambda a: a * jnp.float32(1.0000001))
            jax.block_until_ready(scale(a))
            sec, _ = self.time_loop(scale, [(a,)], "jax", reps)
            out["jax_scale_Bps"] = moved / sec
            del a
        finally:
            self.cleanup()
        measured = {k: v for k, v in out.items() if k.endswith("_Bps")}
        out["used"] = max(measured, key=measured.get)
        out["used_Bps"] = measured[out["used"]]
        out["rule"] = "roofline uses the max of the measured copy bandwidths (bytes read + written)"
        return out


def fmt(value, spec=".3f", none="-"):
    return none if value is None else format(value, spec)


def print_row(row):
    ent = "H" if row["entropy"] else "-"
    msk = "M" if row["mask"] else "-"
    head = f"{row['impl']:20s} {row['dtype']:8s} T={row['T']:<6d} V={row['V']:<6d} {ent}{msk}"
    if row["status"] != "ok" and not row.get("fwd_ms") and not row.get("fb_ms"):
        print(f"{head}  {row['status']}", flush=True)
        return
    gb = row.get("fb_peak_extra_bytes")
    print(f"{head}  fwd {fmt(row.get('fwd_ms'))} ms ({fmt(row.get('fwd_x_roof'), '.2f')}x roof)"
          f"  fwd+bwd {fmt(row.get('fb_ms'))} ms ({fmt(row.get('fb_x_roof'), '.2f')}x roof)"
          f"  peak extra fwd+bwd {fmt(None if gb is None else gb / 1e9, '.2f')} GB"
          + ("" if row["status"] == "ok" else f"  [{row['status']}]"), flush=True)
