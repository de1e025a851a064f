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
"""

if __name__ == "__main__" and not __package__:  # run by path: see benchmarks/__init__.py
    import os, sys  # noqa: E401
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

from benchmarks import harness  # noqa: E402  stdlib only: JAX starts later, in main()

GPU_V = 151_936
GPU_CASES = "4096x4096,16384x4096,4096x8192,16384x8192"
CPU_V, CPU_CASE = 1000, (64, 32)  # --device cpu: tiny shapes, float32

# key -> (label, side: whose inputs it takes, per_entropy: False = one row per shape)
IMPLS = {
    "bridge-fused": ("bridge.linear_logprob_entropy", "torch", True),
    "torch-bridge": ("unfused: torch.matmul + bridge.logprob_entropy", "torch", True),
    "gemm-torch": ("GEMM floor: torch.matmul", "torch", False),
    "torch-compile": ("unfused: torch.matmul + torch.compile(log_softmax, entropy)", "torch",
                      True),
    "liger": ("Liger fused linear CE (CE only: -log_prob, no entropy)", "torch", False),
    "verl": ("verl linear_cross_entropy", "torch", False),
    "liger-cute": ("Liger CuTe fused scaled CE (sm_90, bf16)", "torch", True),
    "gemm-jax": ("GEMM floor: JAX/XLA dot", "jax", False),
    "jaxops-fused": ("jaxops.linear_logprob_entropy", "jax", True),
    "jax-unfused": ("unfused: jnp.dot + jaxops.logprob_entropy", "jax", True),
}
TABLE_ORDER = ("gemm-jax", "gemm-torch", "jaxops-fused", "bridge-fused", "jax-unfused",
               "torch-bridge", "torch-compile", "liger", "liger-cute", "verl")
GEMM_ROWS = ("gemm-jax", "gemm-torch")
# The entropy flag a one-per-shape row is listed under: Liger computes -log_prob only;
# verl always computes entropy; the GEMMs have none (None).
FIXED_ENTROPY = {"liger": False, "verl": True}


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


def nbytes(out):
    """Bytes of the arrays/tensors in a (nested) tuple; None entries count 0."""
    if out is None:
        return 0
    if isinstance(out, (tuple, list)):
        return sum(nbytes(o) for o in out)
    if hasattr(out, "element_size"):  # torch
        return out.numel() * out.element_size()
    return int(out.nbytes)



def liger_cute_function():
    """Liger-Kernel's CuTe DSL Hopper fused linear cross-entropy (an autograd Function:
    apply(hidden [T, H], weight [V, H], target [T] int64, temperature, ignore_index,
    m_tiles_per_cluster, return_entropy) -> nll [T] (, entropy [T]))."""
    import os

    os.environ.setdefault("LIGER_SCALED_CE_SM90_VALIDATE_TARGETS", "0")
    from liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90 import (
        LigerFusedScaledCrossEntropySM90Function)
    return LigerFusedScaledCrossEntropySM90Function


def verl_linear_cross_entropy():
    """verl's `linear_cross_entropy` (its Triton kernels need only torch and triton). verl's
    package `__init__` imports Ray and tensordict, which a GPU box without a network may
    lack: if the plain import fails, the kernel's two modules are loaded from an installed
    verl with the packages above them left uninitialised and `verl.utils.device` reduced
    to the four CUDA queries the kernels ask for."""
    try:
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy
        return linear_cross_entropy
    except ImportError:
        pass
    import importlib.util
    import sys
    import types

    import torch

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("verl is not installed")
    root = list(spec.submodule_search_locations)[0]
    for name, path in [("verl", root), ("verl.utils", os.path.join(root, "utils"))]:
        if name not in sys.modules or not hasattr(sys.modules[name], "__path__"):
            package = types.ModuleType(name)
            package.__path__ = [path]
            sys.modules[name] = package
    device = types.ModuleType("verl.utils.device")
    device.is_cuda_available = torch.cuda.is_available()
    device.get_device_name = lambda: "cuda"
    device.get_device_capability = lambda: torch.cuda.get_device_capability()
    device.get_torch_device = lambda: torch.cuda
    sys.modules.setdefault("verl.utils.device", device)
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy
    return linear_cross_entropy


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
        self._compiled = {}  # torch.compile'd statistics per entropy flag
        self._liger = None

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

    # ------------------------------------------------------------------ the rows
    def skip_reason(self, impl):
        if impl == "torch-compile" and not self.on_gpu and not self.args.with_compile:
            return "skipped: torch.compile is not run on the CPU (slow; --with-compile)"
        if impl == "liger":
            try:
                import liger_kernel  # noqa: F401
            except Exception as exc:
                return f"skipped: liger_kernel not importable ({harness.short_error(exc, 120)})"
            if not self.on_gpu:
                return "skipped: Liger's kernels are Triton, CUDA only"
        if impl == "liger-cute":
            try:
                liger_cute_function()
            except Exception as exc:
                return ("skipped: Liger's CuTe kernel not importable "
                        f"({harness.short_error(exc, 120)})")
            if not self.on_gpu or self.torch.cuda.get_device_capability() != (9, 0):
                return "skipped: Liger's CuTe kernel runs on sm_90 (Hopper) GPUs only"
            if self.args.dtype != "bfloat16":
                return "skipped: Liger's CuTe kernel takes bf16 only"
        if impl == "verl":
            try:
                verl_linear_cross_entropy()
            except Exception as exc:
                return f"skipped: verl not importable ({harness.short_error(exc, 120)})"
        return None

    def torch_fns(self, impl, entropy):
        """(forward, forward+backward) of torch inputs (h, w, y, g1, g2); each returns
        (log_prob, entropy or None, [d hidden, d weight]) -- the GEMM rows their GEMMs'
        results; Liger its per-token CE (the log-prob's negative)."""
        torch = self.torch

        def grads(outs, h, w, g1, g2):
            outs = [o for o in outs if o is not None]
            return torch.autograd.grad(outs, [h, w], [g1, g2][:len(outs)])

        def from_op(op):  # op(h, w, y) -> (lp, ent or None)
            def fwd(h, w, y, g1, g2):
                with torch.no_grad():
                    return op(h, w, y)

            def fb(h, w, y, g1, g2):
                lp, ent = op(h, w, y)
                dh, dw = grads([lp, ent], h, w, g1, g2)
                return lp.detach(), None if ent is None else ent.detach(), dh, dw
            return fwd, fb

        if impl == "gemm-torch":
            def fwd(h, w, y, g1, g2):
                with torch.no_grad():
                    return (torch.matmul(h, w.t()),)

            def fb(h, w, y, g1, g2):  # no autograd: exactly the four GEMMs
                with torch.no_grad():
                    logits = torch.matmul(h, w.t())
                    again = torch.matmul(h, w.t())  # the recompute
                    dh = torch.matmul(again, w)
                    del again
                    dw = torch.matmul(logits.t(), h)
                    return dh, dw
            return fwd, fb
        if impl == "bridge-fused":
            import bridge
            return from_op(lambda h, w, y: bridge.linear_logprob_entropy(
                h, w, y, with_entropy=entropy))
        if impl == "torch-bridge":
            import bridge
            return from_op(lambda h, w, y: bridge.logprob_entropy(
                torch.matmul(h, w.t()), y, with_entropy=entropy))
        if impl == "torch-compile":
            stats = self.compiled_stats(entropy)

            def op(h, w, y):
                logits = torch.matmul(h, w.t())
                # T changes from batch to batch in RL: T dynamic, one graph per grad mode
                torch._dynamo.mark_dynamic(logits, 0)
                torch._dynamo.mark_dynamic(y, 0)
                return stats(logits, y)
            return from_op(op)
        if impl == "verl":
            linear_cross_entropy = verl_linear_cross_entropy()
            return from_op(lambda h, w, y: tuple(linear_cross_entropy(h, w, y, 1.0, "none")))
        if impl == "liger-cute":
            function = liger_cute_function()

            def op(h, w, y):
                out = function.apply(h, w, y.long(), 1.0, -100, 1, entropy)
                nll, ent = out if entropy else (out, None)
                return -nll, ent
            return from_op(op)
        if impl == "liger":
            loss_fn = self.liger()

            def fwd(h, w, y, g1, g2):  # detached: Liger would prepare gradients otherwise
                with torch.no_grad():
                    return loss_fn(w.detach(), h.detach(), y), None

            def fb(h, w, y, g1, g2):
                loss = loss_fn(w, h, y)
                cot = g1 if loss.dim() else torch.ones((), device=loss.device)
                dh, dw = torch.autograd.grad([loss], [h, w], [cot])
                return loss.detach(), None, dh, dw
            return fwd, fb
        raise ValueError(impl)

    def compiled_stats(self, entropy):
        """torch.compile of the plain statistics on fp32 logits / tau (tau = 1 here)."""
        if entropy not in self._compiled:
            torch = self.torch
            import torch._dynamo  # noqa: F401  mark_dynamic in torch_fns

            def stats(logits, y):
                x = logits.float() / 1.0
                logp = torch.log_softmax(x, dim=-1)
                lp = logp.gather(-1, y[:, None]).squeeze(-1)
                ent = -(logp.exp() * logp).sum(-1) if entropy else None
                return lp, ent
            self._compiled[entropy] = torch.compile(stats, fullgraph=True)
        return self._compiled[entropy]

    def liger(self):
        if self._liger is None:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
            try:  # per-token losses: the log-prob an RL loss needs
                self._liger = LigerFusedLinearCrossEntropyLoss(reduction="none")
                self.liger_reduction = "none"
            except (AssertionError, TypeError, ValueError):  # an older Liger: sum only
                self._liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")
                self.liger_reduction = "sum"
        return self._liger

    def jax_fns(self, impl, entropy):
        """(forward, forward+backward) of JAX inputs (h, w, y, g1, g2), like torch_fns."""
        import jaxops
        jax, jnp = self.jax, self.jnp

        if impl == "gemm-jax":
            def fwd(h, w, y, g1, g2):
                return jnp.dot(h, w.T)

            def fb(h, w, y, g1, g2):
                logits = jnp.dot(h, w.T)
                # the recompute: the barrier hides that its input is h, so XLA cannot
                # merge the two identical GEMMs (CSE)
                again = jnp.dot(jax.lax.optimization_barrier(h), w.T)
                return jnp.dot(again, w), jnp.dot(logits.T, h)  # d hidden, d weight
            return fwd, fb

        if impl == "jaxops-fused":
            def op(h, w, y):
                return jaxops.linear_logprob_entropy(h, w, y, with_entropy=entropy)
        elif impl == "jax-unfused":
            def op(h, w, y):
                return jaxops.logprob_entropy(jnp.dot(h, w.T), y, with_entropy=entropy)
        else:
            raise ValueError(impl)

        def fwd(h, w, y, g1, g2):
            return op(h, w, y)

        def fb(h, w, y, g1, g2):
            def f(h, w):
                lp, ent = op(h, w, y)
                return (lp, ent) if entropy else lp
            out, vjp = jax.vjp(f, h, w)
            dh, dw = vjp((g1, g2) if entropy else g1)
            lp, ent = out if entropy else (out, None)
            return lp, ent, dh, dw
        return fwd, fb

    # ------------------------------------------------------------------ one row
    def run_row(self, spec):
        impl, T, H, entropy = spec["impl"], spec["T"], spec["H"], spec["entropy"]
        label, side, _ = IMPLS[impl]
        row = dict(impl=impl, label=label, framework=side, T=T, H=H, V=self.V,
                   dtype=self.args.dtype, entropy=entropy, status=None,
                   logits_bytes=T * self.V * harness.itemsize(self.args.dtype))
        reason = self.skip_reason(impl)
        if reason:
            row.update(status=reason, fwd_status=reason, fb_status=reason)
            return row
        start = time.perf_counter()
        try:
            args = self.inputs(side, T, H)
            fns = (self.jax_fns if side == "jax" else self.torch_fns)(impl, entropy)
            if impl == "liger":
                row["liger_reduction"] = self.liger_reduction
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
        try:
            if side == "jax":
                self.jax_phase(row, phase, fn, args)
            else:
                self.torch_phase(row, phase, fn, args)
            row[f"{phase}_status"] = "ok"
        except Exception as exc:
            if harness.is_oom(exc):
                row[f"{phase}_status"] = "OOM"
            else:
                traceback.print_exc()
                row[f"{phase}_status"] = f"error: {harness.short_error(exc)}"
            del exc
            self.cleanup()

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
