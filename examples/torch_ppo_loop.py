"""A PPO loop on a small vocab-parallel transformer policy, through the JAX bridge, checked
at every step against the same loop computed with Megatron-core's fused cross-entropy.

    python examples/torch_ppo_loop.py [--tp N] [--steps 50] [--max-tokens T] [--vocab V]
                                      [--device cpu|cuda] [--bug grad-scale]

N tensor-parallel ranks (CPU: gloo; CUDA: NCCL, one GPU per rank) each hold the whole
trunk (embedding, two transformer layers) and their vocabulary shard of the output layer,
as in Megatron's column-parallel LM head. Every micro-batch packs a different number of
response tokens T (uniform in [1, max-tokens], the first one the largest: token-budget
packing), and runs

    logits = hidden @ W_r^T / temperature                      # [T, V/N], this rank's shard
    log_prob, entropy = bridge.calculate_log_probs_and_entropy(
        logits, tokens, tp_group, with_entropy=True)           # slime's signature
    loss = -mean(min(ratio A, clip(ratio, 1 - eps, 1 + eps) A)) - beta * mean(entropy)

then the optimizer step with the bridge's gradients. At every step, on every rank, the
gradients of all model parameters are compared with the same loss computed by
  * float64 torch (the full vocabulary gathered): relative error <= 1e-5, and
  * Megatron's `fused_vocab_parallel_cross_entropy` for the log-prob (which rounds its
    gradient to bf16) + the float64 entropy: relative error <= 1e-2. Megatron's one bf16
    rounding (2^-9 per element of d logits) reaches the parameters through a linear map
    that can amplify it: 4.1e-3 was seen at one step of a CPU run; a semantic difference
    (sign, temperature, a missing term) is O(1).
Also checked: the bridge's compiled programs stay within a few per power-of-two row window
(forward and backward through JAX; on the direct route the statistics kernels and the
backward kernel, 3) and, on CUDA, no host synchronisation in the bridge's forward and
backward (torch's sync debug mode), and after the first steps neither JAX's memory pool
nor torch's live memory grows (within 1 MiB; torch's cache may take one more segment: at
most +25%).

Prints a line per step and a final "PPO loop OK" or "PPO loop MISMATCH"; exits non-zero on
a mismatch. `--bug grad-scale` scales the bridge's gradient by 1 + 5e-4 (the checks fail).
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

HIDDEN, LAYERS, HEADS = 64, 2, 4
TEMPERATURE, CLIP, ENTROPY_COEF = 0.8, 0.2, 0.01
WARMUP_STEPS = 10  # memory may grow while the first window sizes are compiled
# torch's caching allocator serves the whole loop (model, references, bridge): a new mix of
# block sizes can still make it reserve another segment after warm-up (seen once on the
# H200: +9% at step 33, flat afterwards). Live memory must stay within 1 MiB of its level
# after warm-up: torch's own one-off allocations land there (+448 KiB once at step 15 in
# one H200 run), a per-step leak of the loop's tensors does not fit.
RESERVED_SLACK = 1.25
LIVE_SLACK_BYTES = 2**20
MEGATRON_TOL = 1e-2  # see the module docstring
BUG_SIZE = 5e-4


class CopyToTensorParallel(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward (Megatron's
    copy_to_tensor_model_parallel_region): every rank's head shard adds its part of
    d hidden."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class Policy(torch.nn.Module):
    """Embedding + causal transformer trunk (replicated) + this rank's LM-head shard."""

    def __init__(self, vocab, max_len, rank, world):
        super().__init__()
        gen = torch.Generator().manual_seed(1234)  # the same model on every rank
        self.embed = torch.nn.Embedding(vocab, HIDDEN)
        self.pos = torch.nn.Embedding(max_len, HIDDEN)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(HIDDEN, HEADS, 4 * HIDDEN, dropout=0.0,
                                             batch_first=True, norm_first=True)
            for _ in range(LAYERS))
        self.norm = torch.nn.LayerNorm(HIDDEN)
        head = torch.randn(vocab, HIDDEN, generator=gen) / HIDDEN**0.5 * 4
        v_loc = vocab // world
        self.head = torch.nn.Parameter(head[rank * v_loc:(rank + 1) * v_loc].clone())
        with torch.no_grad():
            for p in list(self.embed.parameters()) + list(self.pos.parameters()) + \
                    list(self.layers.parameters()) + list(self.norm.parameters()):
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)

    def hidden(self, tokens):
        """tokens [T + 1] -> hidden states [T, H] predicting tokens[1:]."""
        x = tokens[:-1]
        positions = torch.arange(len(x), device=x.device)
        h = (self.embed(x) + self.pos(positions))[None]
        causal = torch.nn.Transformer.generate_square_subsequent_mask(len(x), device=x.device)
        for layer in self.layers:
            h = layer(h, src_mask=causal, is_causal=True)
        return self.norm(h[0])


class GatherVocab(torch.autograd.Function):
    """All ranks' logit shards side by side, [T, V]. Every rank then computes the same
    loss from them, so the backward keeps this rank's columns of the gradient (a summing
    all-gather backward, as torch.distributed.nn's, would count every rank's copy)."""

    @staticmethod
    def forward(ctx, local, group):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        pieces = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        ctx.cols = slice(rank * local.shape[1], (rank + 1) * local.shape[1])
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.cols], None


def ppo_loss(log_prob, entropy, old_log_prob, advantages):
    ratio = torch.exp(log_prob.double() - old_log_prob)
    clipped = torch.clamp(ratio, 1 - CLIP, 1 + CLIP)
    policy = -torch.minimum(ratio * advantages, clipped * advantages).mean()
    return policy - ENTROPY_COEF * entropy.double().mean()


def flat(grads):
    return torch.cat([g.reshape(-1).double() for g in grads])


def rel_l2(a, b):
    return ((a - b).norm() / b.norm()).item()


def micro_batches(args):
    """(T, tokens [T + 1], advantages [T]) per step: the same on every rank."""
    gen = torch.Generator().manual_seed(args.seed)
    sizes = torch.randint(1, args.max_tokens + 1, (args.steps,), generator=gen).tolist()
    sizes[0] = args.max_tokens  # the largest first, as token-budget packing often does
    for T in sizes:
        tokens = torch.randint(0, args.vocab, (T + 1,), generator=gen)
        yield T, tokens, torch.randn(T, generator=gen, dtype=torch.float64)


def run_rank(rank, world, device, args):
    import warnings

    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*is deprecated")
    import bridge  # before anything starts JAX (GPU memory policy)
    import megatron.core.jit as megatron_jit
    from bridge import diagnostics

    megatron_jit.disable_jit_fuser()  # Megatron's fused CE, eager (same arithmetic)
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    tp_group = dist.new_group(list(range(world)))
    model = Policy(args.vocab, args.max_tokens + 1, rank, world).to(device)
    params = [p for p in model.parameters()]
    optimizer = torch.optim.Adam(params, lr=1e-3)
    cuda = device.type == "cuda"
    jax_device = diagnostics.jax_device(device) if cuda else None
    # programs per power-of-two window size. Through JAX: forward and backward, + the
    # combine after the all-gather when the vocabulary is split. The direct route (one
    # shard on a Hopper GPU): the statistics kernels (partials + finish, or one kernel
    # where V_loc is a single vocabulary chunk) and the backward kernel.
    direct = cuda and world == 1 and diagnostics.direct_route_ready()
    per_window = 3 if direct or world > 1 else 2
    bound = per_window * (max(args.max_tokens - 1, 1).bit_length() + 1)
    compiled_before = diagnostics.compiled_programs()
    log, failures, reserved = [], [], []

    def train_step(T, tokens, advantages):
        """One micro-batch: sets each parameter's .grad to the bridge's gradient and returns
        (loss, error vs float64, error vs Megatron). Its [T, ...] tensors die on return."""
        tokens, advantages = tokens.to(device), advantages.to(device)
        targets = tokens[1:]
        hidden = CopyToTensorParallel.apply(model.hidden(tokens), tp_group)
        logits = (hidden @ model.head.T) / TEMPERATURE  # [T, V_loc] fp32, as slime passes it
        with torch.no_grad():  # the rollout's log-probs: a little off the current policy
            full = GatherVocab.apply(logits.detach(), tp_group)
            rollout = torch.log_softmax(full.double(), -1).gather(-1, targets[:, None])[:, 0]
            old_log_prob = rollout + 0.1 * torch.randn_like(rollout)

        # the bridge (the loop's own gradients)
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        try:
            log_prob, entropy = bridge.calculate_log_probs_and_entropy(
                logits, targets, tp_group, with_entropy=True)
            loss = ppo_loss(log_prob[:, 0], entropy, old_log_prob, advantages)
            grads = torch.autograd.grad(loss, [logits], retain_graph=True)[0]
            if args.bug == "grad-scale":
                grads = grads * (1 + BUG_SIZE)
            g_bridge = torch.autograd.grad(logits, params, grads, retain_graph=True)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")

        # float64 reference and Megatron, on the same logits
        full = GatherVocab.apply(logits, tp_group).double()
        log_p = torch.log_softmax(full, -1)
        lp64 = log_p.gather(-1, targets[:, None])[:, 0]
        h64 = -(log_p.exp() * log_p).sum(-1)
        g_ref = torch.autograd.grad(ppo_loss(lp64, h64, old_log_prob, advantages), params,
                                    retain_graph=True)
        lp_meg = -fused_vocab_parallel_cross_entropy(
            logits.clone().unsqueeze(1), targets.unsqueeze(1), tp_group)[:, 0]
        g_meg = torch.autograd.grad(ppo_loss(lp_meg, h64, old_log_prob, advantages), params)

        for p, g in zip(params, g_bridge):
            p.grad = g
        return (float(loss.detach()), rel_l2(flat(g_bridge), flat(g_ref)),
                rel_l2(flat(g_bridge), flat(g_meg)))

    for step, (T, tokens, advantages) in enumerate(micro_batches(args)):
        loss, err_ref, err_meg = train_step(T, tokens, advantages)
        compiled = diagnostics.compiled_programs() - compiled_before
        optimizer.step()
        mem = None
        if cuda:
            stats = jax_device.memory_stats() or {}
            mem = (torch.cuda.memory_reserved(device),
                   stats.get("pool_bytes", stats.get("bytes_reserved", 0)),
                   torch.cuda.memory_allocated(device))
            reserved.append(mem)
        windows = len(diagnostics.row_windows(T))
        log.append((step, T, windows, loss, err_ref, err_meg, compiled, mem))
        if err_ref > 1e-5:
            failures.append(f"step {step} (T = {T}): d params vs float64 {err_ref:.2e} > 1e-5")
        if err_meg > MEGATRON_TOL:
            failures.append(f"step {step} (T = {T}): d params vs Megatron {err_meg:.2e} "
                            f"> {MEGATRON_TOL}")
        if compiled > bound:
            failures.append(f"step {step}: {compiled} programs compiled (bound {bound})")
    if cuda:  # after warm-up: JAX's pool and torch's live memory flat, torch's cache bounded
        settled = reserved[WARMUP_STEPS - 1]
        for step, mem in enumerate(reserved[WARMUP_STEPS:], WARMUP_STEPS):
            if (mem[1] > settled[1] or mem[2] > settled[2] + LIVE_SLACK_BYTES
                    or mem[0] > RESERVED_SLACK * settled[0]):
                failures.append(
                    f"step {step}: memory grew after warm-up: JAX pool {settled[1]} -> "
                    f"{mem[1]} B, torch live {settled[2]} -> {mem[2]} B, torch reserved "
                    f"{settled[0]} -> {mem[0]} B (limits: JAX flat, live +1 MiB, reserved "
                    f"x{RESERVED_SLACK})")
    return {"rank": rank, "log": log, "failures": failures}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--tp", type=int, default=None,
                        help="tensor-parallel ranks (default: 2 on CPU; on CUDA 2 with >= 2 "
                             "GPUs, else 1)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=1024 if cuda else 128)
    parser.add_argument("--vocab", type=int, default=8192 if cuda else 512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if cuda else "cpu")
    parser.add_argument("--bug", choices=("grad-scale",), default=None)
    args = parser.parse_args(argv)
    _tp_ranks.resolve_tp(parser, args)
    if args.device == "cuda" and args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps on CUDA")
    if _tp_ranks.megatron_missing():
        return 2

    start = time.perf_counter()
    print(f"PPO loop: {args.steps} micro-batches of 1..{args.max_tokens} tokens, vocabulary "
          f"{args.vocab} over TP = {args.tp} ({args.device})"
          + (f"; injected bug: {args.bug}" if args.bug else ""), flush=True)
    results = _tp_ranks.run_ranks(run_rank, args)
    print(" step     T  windows      loss  d params vs f64  vs Megatron  programs"
          + ("  MiB: torch reserved / live, JAX pool" if args.device == "cuda" else ""))
    for rows in zip(*(r["log"] for r in results)):
        step, T, windows, loss, _, _, compiled, mem = rows[0]
        err_ref = max(r[4] for r in rows)
        err_meg = max(r[5] for r in rows)
        line = (f"{step:5d} {T:5d} {windows:8d} {loss:9.4f} {err_ref:16.2e} {err_meg:12.2e} "
                f"{compiled:9d}")
        if mem is not None:
            line += f"  {mem[0] / 2**20:10.0f} / {mem[2] / 2**20:.0f}, {mem[1] / 2**20:.1f}"
        print(line)
    failures = [f for r in results for f in r["failures"]]
    for f in failures[:20]:
        print("  FAIL", f)
    elapsed = time.perf_counter() - start
    if failures:
        print(f"PPO loop MISMATCH (TP = {args.tp}, {args.device}): {len(failures)} failed checks")
        return 1
    print(f"PPO loop OK: {args.steps} steps match float64 and Megatron (TP = {args.tp}, "
          f"{args.device}) in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
