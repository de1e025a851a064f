"""A PyTorch PPO policy-loss step on vocab-sharded logits, through the JAX bridge, checked
against the same step computed with Megatron-core's fused cross-entropy.

    python examples/torch_ppo.py [--tp N] [--tokens T] [--vocab V] [--bug {grad-scale,temperature}]

Spawns N tensor-parallel ranks (CPU: gloo, N = 2; CUDA: NCCL, N = 2 with two or more GPUs,
else N = 1). Every rank holds the columns [r V/N, (r + 1) V/N) of the fp32 logits (bf16
model logits divided by the rollout temperature, as slime passes them) and runs one PPO step:

    log_prob, entropy = bridge.calculate_log_probs_and_entropy(
        logits, tokens, tp_group, with_entropy=True)          # slime's signature
    ratio = exp(log_prob - old_log_prob)
    loss  = -mean(min(ratio A, clip(ratio, 1 - eps, 1 + eps) A)) - beta * mean(entropy)
    loss.backward()

and the same step with `-fused_vocab_parallel_cross_entropy(...)` for the log-prob and a
reference entropy (the full vocabulary gathered on every rank, float64). Checks, on every rank:

- log-prob and entropy within 1e-5 * max(1, max|x|) of the reference values, the loss within
  1e-5 * max(1, |loss|);
- the policy-gradient part of d loss / d logits, compared in bf16 with Megatron's (which rounds
  its gradient to bf16): at most 1% of the elements differ, none by more than 1 bf16 ulp
  (beyond 1e-6 * max|g|);
- the entropy part of the gradient against the float64 reference: relative error <= 1e-5;
- the whole step's gradient against Megatron's step (policy gradient + reference entropy
  gradient): relative error <= 4e-3, one bf16 rounding.

Prints one line per check and a final "PPO step matches Megatron" or "PPO step MISMATCH" line;
exits non-zero on a mismatch. `--bug` injects an error to show that the checks catch it.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing it
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _tp_ranks  # noqa: E402  (examples/, on sys.path when a script here runs)

TEMPERATURE = 0.8
CLIP = 0.2
ENTROPY_COEF = 0.01
BF16_MAX_MISMATCH = 0.01
BF16_ATOL_REL = 1e-6
BUG_SIZE = 5e-4


# ----------------------------------------------------------------------------- data

def make_batch(tokens, vocab, seed=0):
    """The same global batch on every rank (CPU generator, float64 where it is a reference)."""
    gen = torch.Generator().manual_seed(seed)
    # "LM-like" logits: each row its own scale, so entropies span ~0 to several nats.
    scale = 4.0 + 6.0 * torch.rand(tokens, 1, generator=gen)
    model_logits = (scale * torch.randn(tokens, vocab, generator=gen)).to(torch.bfloat16)
    logits = model_logits.float() / TEMPERATURE  # what slime hands to the op
    # Tokens sampled from the policy, as a rollout would (Gumbel-max).
    uniform = torch.rand(tokens, vocab, generator=gen).clamp_(min=1e-30)
    targets = torch.argmax(logits - torch.log(-torch.log(uniform)), dim=-1)
    ref_log_prob = torch.log_softmax(logits.double(), -1).gather(-1, targets[:, None])[:, 0]
    # Old log-probs a little off the current ones, so that some ratios are clipped.
    old_log_prob = ref_log_prob + 0.1 * torch.randn(tokens, generator=gen, dtype=torch.float64)
    advantages = torch.randn(tokens, generator=gen, dtype=torch.float64)
    return logits, targets, old_log_prob, advantages


def policy_loss(log_prob, old_log_prob, advantages):
    ratio = torch.exp(log_prob.double() - old_log_prob)
    clipped = torch.clamp(ratio, 1 - CLIP, 1 + CLIP)
    return -torch.minimum(ratio * advantages, clipped * advantages).mean()


def entropy_float64(full_logits):
    """Entropy of softmax over the full vocabulary, float64, differentiable."""
    x = full_logits.double()
    log_p = torch.log_softmax(x, -1)
    return -(log_p.exp() * log_p).sum(-1)


# ----------------------------------------------------------------------------- comparisons

def bf16_ordered(t):
    """bf16 values as integers ordered like the reals (differences count ulps)."""
    bits = t.float().to(torch.bfloat16).view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def bf16_parity(candidate, megatron):
    """(share of elements not identical in bf16, count more than 1 ulp apart beyond atol)."""
    ulps = (bf16_ordered(candidate) - bf16_ordered(megatron)).abs()
    atol = BF16_ATOL_REL * megatron.abs().max()
    far = (ulps > 1) & ((candidate.double() - megatron.double()).abs() > atol)
    return (ulps != 0).double().mean().item(), int(far.sum())


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ----------------------------------------------------------------------------- one rank

def run_rank(rank, world, device, args):
    import warnings

    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*is deprecated")
    import bridge  # before anything starts JAX (GPU memory policy)
    import megatron.core.jit as megatron_jit

    # Megatron wraps its fused functions in torch.compile at import; switch that off first:
    # the same arithmetic, eager (compiling with inductor on a CPU takes minutes).
    megatron_jit.disable_jit_fuser()
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    tp_group = dist.new_group(list(range(world)))
    logits, targets, old_log_prob, advantages = make_batch(args.tokens, args.vocab, args.seed)
    v_loc = args.vocab // world
    shard = slice(rank * v_loc, (rank + 1) * v_loc)
    local = logits[:, shard].contiguous().to(device)
    targets_d = targets.to(device)
    old_d, adv_d = old_log_prob.to(device), advantages.to(device)
    scale = max(1.0, logits.abs().max().item())

    def bridge_step(part):
        """(log_prob, entropy, loss, grad) for loss = "pg", "entropy" or "step"."""
        x = local.clone().requires_grad_()
        inp = x * (1 + BUG_SIZE) if args.bug == "temperature" else x
        log_prob, entropy = bridge.calculate_log_probs_and_entropy(
            inp, targets_d, tp_group, with_entropy=True)
        log_prob = log_prob[:, 0]  # slime returns [T, 1]
        pg = policy_loss(log_prob, old_d, adv_d)
        ent = entropy.double().mean()
        loss = {"pg": pg, "entropy": ent, "step": pg - ENTROPY_COEF * ent}[part]
        loss.backward()
        grad = x.grad * (1 + BUG_SIZE) if args.bug == "grad-scale" else x.grad
        return log_prob.detach(), entropy.detach(), loss.detach(), grad

    start = time.perf_counter()
    lp_a, h_a, pg_a, g_pg_a = bridge_step("pg")
    _, _, _, g_h_a = bridge_step("entropy")
    _, _, step_a, g_step_a = bridge_step("step")
    bridge_s = time.perf_counter() - start

    # The same step with Megatron's fused CE (on a clone: it overwrites fp32 input) ...
    x_m = local.clone().requires_grad_()
    loss_m = fused_vocab_parallel_cross_entropy(
        x_m.clone().unsqueeze(1), targets_d.unsqueeze(1), tp_group)
    lp_m = -loss_m[:, 0]
    pg_m = policy_loss(lp_m, old_d, adv_d)
    pg_m.backward()
    # ... and a reference entropy: the full vocabulary gathered on every rank, float64.
    pieces = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(pieces, local, group=tp_group)
    full = torch.cat(pieces, dim=1).cpu().requires_grad_()
    h_ref = entropy_float64(full)
    h_ref.mean().backward()
    g_h_ref = full.grad[:, shard].to(device)
    ref_log_prob = torch.log_softmax(full.detach().double(), -1).gather(
        -1, targets[:, None])[:, 0].to(device)
    step_m = pg_m.detach() - ENTROPY_COEF * h_ref.detach().mean().to(device)
    g_step_m = x_m.grad.double() - ENTROPY_COEF * g_h_ref

    checks = []

    def check(name, value, limit, ok=None):
        checks.append((name, value, limit, bool(value <= limit) if ok is None else ok))

    tol = 1e-5 * scale
    check("log_prob vs Megatron, max abs", (lp_a.double() - lp_m.detach().double()).abs().max().item(), tol)
    check("log_prob vs float64, max abs", (lp_a.double() - ref_log_prob).abs().max().item(), tol)
    check("entropy vs float64, max abs", (h_a.double() - h_ref.detach().to(device)).abs().max().item(), tol)
    check("PPO loss vs Megatron step, abs", abs(step_a.item() - step_m.item()),
          1e-5 * max(1.0, abs(step_m.item())))
    mismatch, far = bf16_parity(g_pg_a, x_m.grad)
    check("policy grad vs Megatron in bf16: share not identical", mismatch, BF16_MAX_MISMATCH)
    check("policy grad vs Megatron in bf16: elements > 1 ulp apart", far, 0)
    check("entropy grad vs float64, rel L2", rel_l2(g_h_a, g_h_ref), 1e-5)
    check("step grad vs Megatron step, rel L2", rel_l2(g_step_a, g_step_m), 4e-3)
    return {"rank": rank, "checks": checks, "bridge_s": bridge_s,
            "h_range": (h_ref.min().item(), h_ref.max().item()), "max_abs_x": scale}


# ----------------------------------------------------------------------------- main

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--tp", type=int, default=None,
                        help="tensor-parallel ranks (default: 2 on CPU; 2 on CUDA with >= 2 GPUs, else 1)")
    parser.add_argument("--tokens", type=int, default=512 if cuda else 256)
    parser.add_argument("--vocab", type=int, default=151_936 if cuda else 32_768)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if cuda else "cpu")
    parser.add_argument("--bug", choices=("grad-scale", "temperature"), default=None,
                        help=f"inject an error of relative size {BUG_SIZE:g} into the bridge's "
                             "gradient or its input (the checks must fail)")
    args = parser.parse_args(argv)
    _tp_ranks.resolve_tp(parser, args)

    if _tp_ranks.megatron_missing():
        return 2
    start = time.perf_counter()
    print(f"PPO step: {args.tokens} tokens, vocabulary {args.vocab} split over TP = {args.tp} "
          f"({args.device}, {'nccl' if args.device == 'cuda' else 'gloo'})"
          + (f"; injected bug: {args.bug} x (1 + {BUG_SIZE:g})" if args.bug else ""), flush=True)
    results = _tp_ranks.run_ranks(run_rank, args)

    ok = True
    names = [c[0] for c in results[0]["checks"]]
    for i, name in enumerate(names):
        per_rank = [r["checks"][i] for r in results]
        worst = max(c[1] for c in per_rank)
        passed = all(c[3] for c in per_rank)
        ok &= passed
        print(f"  {'ok  ' if passed else 'FAIL'} {name:<55s} {worst:.2e}  (limit {per_rank[0][2]:.0e})")
    h_lo = min(r["h_range"][0] for r in results)
    h_hi = max(r["h_range"][1] for r in results)
    elapsed = time.perf_counter() - start
    print(f"  row entropies {h_lo:.2f} to {h_hi:.2f} nats, max|x| {results[0]['max_abs_x']:.1f}; "
          f"bridge: 3 forward+backward calls in {max(r['bridge_s'] for r in results):.2f} s on rank 0..{args.tp - 1}")
    if ok:
        print(f"PPO step matches Megatron (TP = {args.tp}, {args.device}) in {elapsed:.0f} s")
        return 0
    print(f"PPO step MISMATCH against Megatron (TP = {args.tp}, {args.device})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
