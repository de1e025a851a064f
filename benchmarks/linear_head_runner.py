"""How benchmarks/linear_head.py measures one row: Run holds the frameworks and the inputs
of the current shape (made once per shape in torch, then copied for the JAX rows: the same
values on both sides) and fills a row's dict, per phase (forward, forward+backward), with
its compile or first-call time, median time and peak extra memory, or the OOM or error
that stopped it. The rules are in linear_head.py's docstring (and the JSON's "method");
what each row computes is in linear_head_impls.py. Stdlib only at import time.
"""

from __future__ import annotations

import gc
import math
import time
import traceback

from benchmarks import harness
from benchmarks.linear_head_impls import GEMM_ROWS, IMPLS, HeadImplementations


def nbytes(out):
    """Bytes of the arrays/tensors in a (nested) tuple; None entries count 0."""
    if out is None:
        return 0
    if isinstance(out, (tuple, list)):
        return sum(nbytes(o) for o in out)
    if hasattr(out, "element_size"):  # torch
        return out.numel() * out.element_size()
    return int(out.nbytes)


class Run:
    """Holds the frameworks and the inputs of the current shape; measures one row at a time."""

    def __init__(self, args, torch, jax):
        self.args, self.torch, self.jax = args, torch, jax
        self.jnp = jax.numpy
        self.on_gpu = args.device == "gpu"
        self.tdev = torch.device("cuda", 0) if self.on_gpu else torch.device("cpu")
        self.tdtype = getattr(torch, args.dtype)
        self.V = args.vocab
        self.shape = None  # (side, T, H) of the inputs held
        self.tin = self.jin = None
        self.impls = HeadImplementations(torch, jax, on_gpu=self.on_gpu, dtype=args.dtype,
                                         with_compile=args.with_compile)

    # ------------------------------------------------------------------ inputs
    def torch_inputs(self, T, H):
        """hidden [T, H] ~ N(0, 1), weight [V, H] ~ N(0, 4/H) (logits ~ N(0, 4): a spread
        softmax, entropy well below log V), targets, two fp32 cotangents. Seeded by the
        shape: both passes see the same values (the JAX pass copies them)."""
        torch = self.torch
        gen = torch.Generator(device=self.tdev).manual_seed(1000 * T + H)
        h = torch.randn((T, H), generator=gen, device=self.tdev, dtype=self.tdtype)
        w = torch.randn((self.V, H), generator=gen, device=self.tdev, dtype=self.tdtype)
        w.mul_(2.0 / math.sqrt(H))
        y = torch.randint(0, self.V, (T,), generator=gen, device=self.tdev)
        g1, g2 = torch.randn((2, T), generator=gen, device=self.tdev, dtype=torch.float32)
        return h.requires_grad_(), w.requires_grad_(), y, g1.clone(), g2.clone()

    def inputs(self, side, T, H):
        if self.shape == (side, T, H):
            return self.tin if side == "torch" else self.jin
        self.tin = self.jin = None
        self.cleanup()
        tin = self.torch_inputs(T, H)
        if side == "torch":
            self.tin = tin
        else:  # JAX-owned copies of the same values (DLPack import, then a real copy)
            jax, jnp = self.jax, self.jnp
            self.torch_sync()
            h, w, y, g1, g2 = (t.detach() for t in tin)
            views = [jax.dlpack.from_dlpack(t) for t in (h, w, y.int(), g1, g2)]
            jin = [jnp.array(v, copy=True) for v in views]
            self.jin = tuple(jax.block_until_ready(jin))
            del views, jin, tin
            self.cleanup()
        self.shape = (side, T, H)
        return self.tin if side == "torch" else self.jin

    # ------------------------------------------------------------------ helpers
    def torch_sync(self):
        if self.on_gpu:
            self.torch.cuda.synchronize()

    def cleanup(self):
        gc.collect()
        if self.on_gpu:
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()

    def jax_mem(self):
        try:
            return self.jax.devices()[0].memory_stats() or {}
        except Exception:  # no memory_stats on this backend: memory fields read None
            return {}

    def time_fn(self, fn, args, kind):
        a = self.args
        timing = harness.time_calls(
            fn, [args], reps=a.reps,
            calls=lambda est: harness.choose_calls(est, 1, a.target_ms * 1e-3, a.max_calls),
            sync=harness.block_jax if kind == "jax" else (lambda out: self.torch_sync()),
            before_rep=None if kind == "jax" else self.torch_sync,
            cuda_events=self.torch if kind == "torch" and self.on_gpu else None)
        return timing

    @staticmethod
    def record_means(row, out, negate=False):
        """Means of log-prob / entropy: the rows must agree (a cheap cross-check)."""
        try:
            lp, ent = out[0], out[1]
            lp_mean = float(lp.float().mean()) if hasattr(lp, "float") else float(lp.mean())
            row["lp_mean"] = -lp_mean if negate else lp_mean
            if ent is not None:
                row["h_mean"] = (float(ent.float().mean()) if hasattr(ent, "float")
                                 else float(ent.mean()))
        except Exception as exc:
            row["outputs_error"] = harness.short_error(exc)

    # ------------------------------------------------------------------ one row
    def run_row(self, spec):
        impl, T, H, entropy = spec["impl"], spec["T"], spec["H"], spec["entropy"]
        label, side, _ = IMPLS[impl]
        row = dict(impl=impl, label=label, framework=side, T=T, H=H, V=self.V,
                   dtype=self.args.dtype, entropy=entropy, status=None,
                   logits_bytes=T * self.V * harness.itemsize(self.args.dtype))
        reason = self.impls.skip_reason(impl)
        if reason:
            row.update(status=reason, fwd_status=reason, fb_status=reason)
            return row
        start = time.perf_counter()
        try:
            args = self.inputs(side, T, H)
            impls = self.impls
            fns = (impls.jax_fns if side == "jax" else impls.torch_fns)(impl, entropy)
            if impl == "liger":
                row["liger_reduction"] = impls.liger_reduction
            for phase, fn in zip(("fwd", "fb"), fns):
                self.phase(row, phase, fn, args, side)
        except Exception as exc:  # inputs or the functions could not be made
            status = "OOM" if harness.is_oom(exc) else f"error: {harness.short_error(exc)}"
            if status != "OOM":
                traceback.print_exc()
            for phase in ("fwd", "fb"):
                row.setdefault(f"{phase}_status", status)
            del exc
            self.tin = self.jin = None
            self.shape = None
            self.cleanup()
        statuses = [row.get("fwd_status"), row.get("fb_status")]
        row["status"] = "ok" if statuses == ["ok", "ok"] else next(
            s for s in statuses if s != "ok")
        row["row_s"] = time.perf_counter() - start
        return row

    def phase(self, row, phase, fn, args, side):
        timed = self.jax_phase if side == "jax" else self.torch_phase
        harness.run_phase(row, phase, lambda: timed(row, phase, fn, args), self.cleanup)

    def jax_phase(self, row, phase, fn, args):
        jax = self.jax
        t0 = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        row[f"{phase}_compile_s"] = time.perf_counter() - t0
        try:
            ma = compiled.memory_analysis()
            row[f"{phase}_temp_bytes"] = int(ma.temp_size_in_bytes)
            row[f"{phase}_output_bytes"] = int(ma.output_size_in_bytes)
            row[f"{phase}_alias_bytes"] = int(ma.alias_size_in_bytes)
            row[f"{phase}_extra_bytes"] = int(ma.temp_size_in_bytes)
        except Exception as exc:  # no memory analysis on this backend / version
            row[f"{phase}_mem_note"] = harness.short_error(exc, 120)
        out = compiled(*args)
        jax.block_until_ready(out)
        if phase == "fb" and row["impl"] not in GEMM_ROWS:
            self.record_means(row, out)
        del out
        timing = self.time_fn(compiled, args, "jax")
        row[f"{phase}_ms"] = timing.seconds * 1e3
        row[f"{phase}_calls"] = timing.calls
        row[f"{phase}_times_ms"] = [t * 1e3 for t in timing.times]

    def torch_phase(self, row, phase, fn, args):
        torch = self.torch
        through_bridge = row["impl"] in ("bridge-fused", "torch-bridge")
        t0 = time.perf_counter()
        out = fn(*args)  # compile / warm-up
        self.torch_sync()
        row[f"{phase}_first_call_s"] = time.perf_counter() - t0
        if phase == "fb" and row["impl"] not in GEMM_ROWS:
            self.record_means(row, out, negate=row["impl"] == "liger")
        del out
        self.cleanup()
        # the memory call: everything live now is the inputs (and caches)
        if self.on_gpu:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        ballast = self.jax_ballast() if through_bridge else None
        jbefore = self.jax_mem() if through_bridge else {}
        out = fn(*args)
        self.torch_sync()
        out_bytes = nbytes(out)
        row[f"{phase}_output_bytes"] = out_bytes
        if self.on_gpu:
            peak = torch.cuda.max_memory_allocated() - base
            row[f"{phase}_torch_peak_minus_inputs_bytes"] = int(peak)
            extra = peak
            if through_bridge:  # the JAX side: its outputs live in JAX's pool
                jafter = self.jax_mem()
                jextra, exact = self.jax_side(jbefore, jafter)
                row[f"{phase}_jax_side_bytes"] = jextra
                row[f"{phase}_jax_side_exact"] = exact
                extra = None if jextra is None else extra + jextra
            row[f"{phase}_extra_bytes"] = None if extra is None else int(extra - out_bytes)
        del out, ballast
        kind = "wall" if through_bridge else "torch"
        timing = self.time_fn(fn, args, kind)
        row[f"{phase}_ms"] = timing.seconds * 1e3
        row[f"{phase}_calls"] = timing.calls
        row[f"{phase}_times_ms"] = [t * 1e3 for t in timing.times]

    def jax_ballast(self):
        """Arrays that lift JAX's bytes in use to its process-wide peak so far (JAX
        cannot reset that peak): the next call's peak - in use before it is then exactly
        that call's. It takes no device memory beyond JAX's pool, which never shrinks
        below its peak anyway. None where memory_stats is unavailable or it fails."""
        stats = self.jax_mem()
        gap = stats.get("peak_bytes_in_use", 0) - stats.get("bytes_in_use", 0)
        if gap <= 0:
            return None
        # pieces of at most 1 GiB (no 32-bit index trouble), sizes in 64 MiB steps (few
        # distinct shapes to compile)
        step, piece = 64 * 2**20, 2**30
        total = -(-(gap + 2**20) // step) * step
        sizes = [piece] * (total // piece) + ([total % piece] if total % piece else [])
        try:
            return self.jax.block_until_ready(
                [self.jnp.zeros((n,), self.jnp.uint8) for n in sizes])
        except Exception:  # OOM: the JAX side is then a lower bound (jax_side_exact False)
            return None

    @staticmethod
    def jax_side(before, after):
        """(JAX bytes of one bridge call beyond what was in use before it, exact?): exact
        where JAX's in-use bytes had reached its peak before the call (jax_ballast), else
        the in-use delta, a lower bound."""
        if "bytes_in_use" not in before or "bytes_in_use" not in after:
            return None, None
        extra = after["bytes_in_use"] - before["bytes_in_use"]
        peak = after.get("peak_bytes_in_use")
        exact = peak is not None and before["bytes_in_use"] >= before.get("peak_bytes_in_use", 0)
        if exact:
            extra = max(extra, peak - before["bytes_in_use"])
        return int(extra), exact

