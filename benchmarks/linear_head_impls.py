"""The rows of benchmarks/linear_head.py and what each computes: IMPLS (the --impls keys,
their labels, whose inputs they take, one row per entropy flag or one per shape) with the
table order and the entropy flag of the one-per-shape rows; HeadImplementations, which
builds a row's forward and forward+backward functions on torch or JAX inputs and says why a
row cannot run here; and the loaders of the third-party kernels (Liger's CuTe kernel,
verl's). Stdlib only at import time: torch and JAX are handed in. How a row is timed and
its memory measured is in linear_head_runner.py.
"""

from __future__ import annotations

import os

from benchmarks import harness

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



class HeadImplementations:
    """The rows' functions, and what they reuse from shape to shape (torch.compile'd
    statistics per entropy flag, Liger's loss module)."""

    def __init__(self, torch, jax, on_gpu, dtype, with_compile):
        self.torch, self.jax = torch, jax
        self.jnp = jax.numpy
        self.on_gpu = on_gpu
        self.dtype = dtype  # "bfloat16" or "float32"
        self.with_compile = with_compile  # torch.compile on the CPU too
        self._compiled = {}  # torch.compile'd statistics per entropy flag
        self._liger = None
        self.liger_reduction = None  # "none" (per token) or "sum" (an older Liger)

    def skip_reason(self, impl):
        if impl == "torch-compile" and not self.on_gpu and not self.with_compile:
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
            if self.dtype != "bfloat16":
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
