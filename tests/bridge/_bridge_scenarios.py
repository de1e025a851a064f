"""Scenario checks for the PyTorch bridge, shared by the CPU and CUDA tests.

One scenario = one call of the bridge on this rank's vocabulary shard, checked against
  * a float64 torch reference of docs/design.md §2 on the full (unsharded) logits: values,
    log-prob gradient, entropy gradient, combined gradient;
  * Megatron-core's `fused_vocab_parallel_cross_entropy` (unmasked, temperature 1):
    -loss vs log-prob, and its gradient vs ours after casting both to bf16;
and for the invariants: output shapes/dtypes, gradient dtype, no input modified.

The scenarios run in this process (TP = 1) or on every rank of a spawned group
(tests/bridge/_bridge_spawn.py). Nothing heavy is imported at module level: spawned
children import this module first.
"""

from __future__ import annotations

import dataclasses
import zlib

T_TOKENS = 7
V_LOCAL = 13  # columns per shard: not a power of two, not a multiple of any tile


@dataclasses.dataclass(frozen=True)
class Scenario:
    dtype: str  # "float32" | "bfloat16" | "float16"
    masked: bool
    entropy: str  # "off" | "fwd" (no gradient) | "grad"
    api: str = "slime"  # "slime" (calculate_log_probs_and_entropy) | "bridge"
    chunk_size: int = -1  # slime only
    temperature: float = 1.0  # bridge only

    @property
    def name(self):
        extra = f"chunk{self.chunk_size}" if self.api == "slime" else f"tau{self.temperature}"
        return (f"{self.api}-{self.dtype}-{'mask' if self.masked else 'nomask'}-"
                f"ent_{self.entropy}-{extra}")


def scenarios(full: bool = True) -> list[Scenario]:
    """full: every dtype x mask x entropy mode x chunking through the slime drop-in, plus
    temperature and float16 through bridge.logprob_entropy. Not full (for TP = 4, where
    four processes compile everything): float32 keeps every mask x entropy x chunking
    combination, bfloat16 two of them -- each new dtype/mask/entropy combination costs a
    JAX compile per process, chunking costs nothing."""
    out = []
    for dtype in ("float32", "bfloat16"):
        for masked in (False, True):
            for entropy in ("off", "fwd", "grad"):
                for chunk in (-1, 3):
                    if full or dtype == "float32" or (masked, entropy, chunk) in (
                            (False, "grad", -1), (True, "off", 3)):
                        out.append(Scenario(dtype, masked, entropy, "slime", chunk))
    out += [Scenario("float32", False, "grad", "bridge", temperature=0.7),
            Scenario("float16", True, "grad", "bridge", temperature=1.3),
            Scenario("bfloat16", True, "fwd", "bridge", temperature=0.7)]
    return out


# ---------------------------------------------------------------------------
# inputs and references
# ---------------------------------------------------------------------------

def make_inputs(sc: Scenario, world: int, device, seed: int = 0):
    """Full-vocabulary inputs, identical on every rank."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1000 + zlib.crc32(sc.name.encode()) % 997)
    T, V = T_TOKENS, world * V_LOCAL
    dtype = getattr(torch, sc.dtype)
    x = (torch.randn(T, V, generator=gen) * 2.0).to(dtype)
    y = torch.randint(0, V, (T,), generator=gen)
    y[0] = 0  # first shard
    y[1] = V - 1  # last shard
    mask = None
    if sc.masked:
        mask = torch.rand(T, V, generator=gen) < 0.3
        mask[2] = False  # only the target counts: log_prob = 0
        mask[3, y[3]] = False  # the target counts even with its bit off
        # a -inf logit the mask removes (allowed, docs/design.md §2)
        col = (int(y[4]) + 1) % V
        mask[4, col] = False
        x[4, col] = float("-inf")
    g_lp = torch.randn(T, generator=gen)
    g_h = torch.randn(T, generator=gen)
    mv = lambda t: None if t is None else t.to(device)  # noqa: E731
    return mv(x), mv(y), mv(mask), mv(g_lp), mv(g_h)


def small_inputs(T=5, V=11, dtype=None, seed=0, masked=False):
    """Logits `[T, V]` (requiring grad), targets and, with `masked`, a bool keep mask: the
    single-process tests' inputs (tests/bridge/test_bridge*.py)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, V, generator=gen) * 2).to(dtype or torch.float32).requires_grad_()
    y = torch.randint(0, V, (T,), generator=gen)
    mask = (torch.rand(T, V, generator=gen) < 0.4) if masked else None
    return x, y, mask


def reference(x, y, mask, tau):
    """float64 log_prob and entropy of docs/design.md §2 (differentiable in x)."""
    import torch

    z = x.double() / tau
    lse = torch.logsumexp(z, -1)
    target = z.gather(1, y[:, None])[:, 0]
    if mask is None:
        log_prob = target - lse
    else:
        kept = mask.clone()
        kept[torch.arange(len(y)), y] = True
        log_prob = target - torch.logsumexp(torch.where(kept, z, float("-inf")), -1)
    log_p = z - lse[:, None]
    p = log_p.exp()
    entropy = -(p * torch.where(p > 0, log_p, torch.zeros_like(log_p))).sum(-1)
    return log_prob, entropy


def rel_err(a, b):
    a, b = a.double(), b.double()
    den = b.norm()
    return float((a - b).norm() / den) if den > 0 else float((a - b).norm())


def grad_tol(dtype) -> float:
    """docs/design.md §8: the gradient tolerance of tests/_oracle.py's one table."""
    from _oracle import grad_rtol

    return grad_rtol(dtype)


def load_megatron():
    """Megatron's fused CE, with its torch.compile fuser switched off (same math, eager:
    compiling it with inductor on a CPU would take minutes)."""
    import megatron.core.jit as mjit

    mjit.disable_jit_fuser()
    from megatron.core.fusions import fused_cross_entropy as fce

    return fce.fused_vocab_parallel_cross_entropy


# ---------------------------------------------------------------------------
# one scenario
# ---------------------------------------------------------------------------

def run_scenario(sc: Scenario, *, group, meg_group, rank: int, world: int, device,
                 megatron=None, seed: int = 0, implementation=None):
    """Raise AssertionError (naming what failed) unless the bridge matches.
    `implementation`: passed to `bridge.logprob_entropy` (the slime drop-in has none)."""
    import torch
    from _oracle import VALUE_RTOL

    import bridge

    x_full, y, mask_full, g_lp, g_h = make_inputs(sc, world, device, seed)
    cols = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    x = x_full[:, cols].contiguous().requires_grad_()
    mask = None if mask_full is None else mask_full[:, cols].contiguous()
    snapshot = [t.clone() for t in (x.detach(), y) + ((mask,) if mask is not None else ())]
    with_entropy = sc.entropy != "off"
    entropy_grad = sc.entropy == "grad"
    tau = sc.temperature

    def call():
        if sc.api == "slime":
            lp, h = bridge.calculate_log_probs_and_entropy(
                x, y, group, with_entropy=with_entropy, chunk_size=sc.chunk_size,
                log_prob_keep_mask=mask, with_entropy_grad=entropy_grad)
            assert lp.shape == (T_TOKENS, 1), f"slime log_prob shape {tuple(lp.shape)}"
            return lp[:, 0], h
        return bridge.logprob_entropy(
            x, y, process_group=group, keep_mask=mask, temperature=tau,
            with_entropy=with_entropy, entropy_grad=entropy_grad,
            implementation=implementation)

    lp, h = call()
    # --- reference on the full vocabulary, float64 --------------------------------
    xr = x_full.double().requires_grad_()
    lp_ref, h_ref = reference(xr, y, mask_full, tau)
    finite = x_full[torch.isfinite(x_full)].float()
    atol = VALUE_RTOL * max(1.0, float(finite.abs().max()) / tau)

    def close(name, got, want, tol):
        err = float((got.double() - want.double()).abs().max())
        assert err <= tol, f"{name}: max abs error {err:.3g} > {tol:.3g}"

    assert lp.dtype == torch.float32 and lp.shape == (T_TOKENS,), (lp.dtype, lp.shape)
    close("log_prob vs float64 reference", lp.detach(), lp_ref.detach(), atol)
    if sc.masked:
        # log p = 0 exactly in real arithmetic; the kernels reach it up to fp32 rounding of
        # the shared exponentials (docs/design.md §8's bound, taken on this row alone).
        row = x_full[2][torch.isfinite(x_full[2])].float()
        row_tol = VALUE_RTOL * max(1.0, float(row.abs().max()) / tau)
        assert abs(float(lp[2].detach())) <= row_tol, \
            f"row keeping only its target: {float(lp[2].detach())} (bound {row_tol:.3g})"
    if with_entropy:
        assert h is not None and h.dtype == torch.float32 and h.shape == (T_TOKENS,)
        close("entropy vs float64 reference", h.detach(), h_ref.detach(), atol)
        assert h.requires_grad == entropy_grad, f"entropy requires_grad {h.requires_grad}"
    else:
        assert h is None, "entropy must be None with with_entropy=False"

    # --- gradients ------------------------------------------------------------------
    def ref_grad(out):
        (g,) = torch.autograd.grad(out, xr, retain_graph=True)
        return g[:, cols]

    # Both cotangents are always passed when entropy has a gradient (zeros for the one
    # not under test), so each configuration compiles one backward.
    zeros = torch.zeros_like(g_lp)
    outs = [lp, h] if entropy_grad else [lp]

    def grad(g_lp_, g_h_):
        (g,) = torch.autograd.grad(outs, x, [g_lp_, g_h_] if entropy_grad else [g_lp_],
                                   retain_graph=True)
        assert g.dtype == x.dtype, f"gradient dtype {g.dtype} != logits {x.dtype}"
        return g

    d_lp = grad(g_lp, zeros)
    err = rel_err(d_lp, ref_grad((lp_ref * g_lp).sum()))
    assert err <= grad_tol(sc.dtype), f"log-prob gradient: relative error {err:.3g}"
    if entropy_grad:
        err = rel_err(grad(zeros, g_h), ref_grad((h_ref * g_h).sum()))
        assert err <= grad_tol(sc.dtype), f"entropy gradient: relative error {err:.3g}"
        err = rel_err(grad(g_lp, g_h), ref_grad((lp_ref * g_lp + h_ref * g_h).sum()))
        assert err <= grad_tol(sc.dtype), f"combined gradient: relative error {err:.3g}"
    elif with_entropy:
        # forward-only entropy: using it in a loss must not change the gradient
        assert not h.requires_grad
        (d_total,) = torch.autograd.grad((lp * g_lp).sum() + (h * g_h).sum(), x,
                                         retain_graph=True)
        assert torch.equal(d_total, d_lp), "entropy without gradient changed the gradient"

    # --- Megatron-core (no mask, temperature 1) -----------------------------------------
    if megatron is not None and not sc.masked and tau == 1.0:
        xm = x.detach().float().clone()[:, None, :].requires_grad_()  # it mutates fp32 input
        loss = megatron(xm, y[:, None], meg_group)
        close("log_prob vs Megatron -loss", lp.detach(), -loss[:, 0].detach(), atol)
        loss.backward(-g_lp[:, None])
        meg = xm.grad[:, 0, :]
        ours, want = d_lp.to(torch.bfloat16), meg.to(torch.bfloat16)
        # Megatron rounds its gradient to bf16; two correct fp32 gradients may round to
        # neighbouring bf16 values, so allow one bf16 ulp (adjacent bit patterns) and no
        # more. Anything larger is a real difference.
        ulps = (ours.view(torch.int16).int() - want.view(torch.int16).int()).abs()
        diff = (ours.float() - want.float()).abs()
        bad = (ulps > 1) & (diff > 1e-7)
        assert not bool(bad.any()), (
            f"log-prob gradient vs Megatron (bf16): {int(bad.sum())} element(s) differ by "
            f"more than one bf16 ulp, max {float(diff.max()):.3g}")

    # --- inputs untouched -----------------------------------------------------------------
    after = [x.detach(), y] + ([mask] if mask is not None else [])
    for before, now in zip(snapshot, after):
        assert torch.equal(before, now), "an input tensor was modified"
