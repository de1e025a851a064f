"""`linear_logprob_entropy` for torch tensors: the output layer fused into the op.

`bridge.logprob_entropy(hidden @ weight.T, targets, ...)` without the `[T, V_loc]` logits:
JAX computes them `chunk_size` vocabulary columns at a time from DLPack views of torch's
`hidden` and `weight` (`jaxops/linear_staged.py`, `jaxops/linear.py`), folds them into the
row statistics and drops them; the backward recomputes each chunk and contracts its
`d logits` into `d hidden` and `d weight` (docs/design.md §10). A window takes the fused
Mosaic GPU kernels where `jaxops.linear_logprob_entropy` would (the default "pallas" on
Hopper+, bf16/fp16, no mask; `backends/mosaic/linear.py`): its forward as one fused kernel, and,
for windows of at most 4096 rows, its backward's d logits from the recomputing kernel.

Data flow of one call (R ranks, K packed statistics per token, row windows w of a few
power-of-two sizes as in `_run.py` / `_windows.py`):

    forward   weight --DLPack--> JAX once; per w: hidden[w] --> JAX: stats [K, b]
              R == 1: combined in the same jitted call -> outputs [n_out, b] --> torch
              R  > 1: stats --> torch [K, T], ONE all-gather -> [R, K, T],
                      per w: combine -> outputs --> torch
    backward  per w: hidden[w], weight, stats[w], incoming gradients[w] --> JAX -->
              d hidden[w] [b, H] (JAX-allocated, exported) and d weight:
                one window: d weight [V_loc, H] in weight's dtype --> torch, nothing more;
                several:    added into one fp32 [V_loc, H] accumulator that JAX carries
                            from window to window (donated: one copy alive), rounded
                            once to weight's dtype after the last --> torch.
              R > 1 with reduce_hidden_grad=True: one all-reduce of d hidden [T, H].

Windows and d weight. Unlike d logits, d weight is a sum over rows, so the rows that
the last window recomputes (it ends at row T and may start up to `size - new` rows
before the rows it is needed for, `_windows.py`) must not count twice: their incoming
gradients are zeroed in that window (an O(b) torch copy), so they add exactly 0.
What several windows cost over one pass over T (V_loc, H: weight's shape):
  * the recomputed rows, at most T/7 (none when T is a power of two, and one window
    covers T whenever T is a power of two <= 32,768): forward GEMM + backward's three;
  * each window reads the whole weight again, forward and backward (the GEMMs read
    it once per window instead of once per call);
  * d weight: one fp32 zero-fill of the accumulator (4 V_loc H bytes), one read +
    write of it per window (8 V_loc H bytes each), and for bf16/fp16 weights a rounding
    pass (6 V_loc H bytes): 34 V_loc H bytes for 3 windows against the one-window
    path's 2 -- 2.5 GB more at V_loc = 18,992, H = 4096, about 0.6 ms of H200
    bandwidth; and 4 V_loc H bytes of JAX memory for the accumulator while it lives.
  * d hidden comes back per window and is copied into one `[T, H]` tensor (O(T H)).

The engine -- windows, DLPack hand-overs, the all-gather -- is in `_linear_run.py`, as
`_run.py` is `logprob_entropy`'s; the checks are in `_checks.py`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from bridge import _checks, _linear_run
from bridge._autograd import first_order_backward

__all__ = ["linear_logprob_entropy"]


# ---------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------

def _empty_outputs(hidden, with_entropy):
    empty = hidden.new_empty((0,), dtype=torch.float32)
    return empty, (hidden.new_empty((0,), dtype=torch.float32) if with_entropy else None)


def _start_forward(hidden, weight, targets, keep_mask, inv_tau, with_entropy, chunk_size,
                   implementation, group_name, rank, world, *, check_every_call):
    """Checks, then the forward for T > 0: (outputs [n_out, T], state)."""
    plan = _linear_run.Plan(hidden, weight, targets, keep_mask, implementation,
                            chunk_size)  # local checks first
    if world > 1:
        # Not refused here, unlike in the plain op: a group whose backend names NCCL
        # with CPU tensors ("cpu:gloo,cuda:nccl" serves them through gloo).
        _checks.check_shards(
            group_name, {"T": hidden.shape[0], "H": hidden.shape[1], "V_loc": weight.shape[0]},
            hidden, every_call=check_every_call, refuse_nccl_off_cuda=False,
            expected="the same hidden [T, H] and an equal vocabulary shard weight [V_loc, H]")
    return _linear_run.forward(plan, inv_tau, with_entropy, chunk_size, group_name, rank,
                               world)


class _LinearFunction(torch.autograd.Function):
    """Eager autograd for `linear_logprob_entropy`. Keeps the forward's JAX views (each
    window's inputs and statistics) for the backward, which imports only the weight and
    the incoming gradients; the torch inputs are saved too, so autograd still detects
    in-place changes between forward and backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, keep_mask, inv_tau, with_entropy, entropy_grad,
                chunk_size, implementation, group_name, rank, world, reduce_hidden_grad,
                check_every_call):
        ctx.set_materialize_grads(False)
        ctx.params = (inv_tau, with_entropy, entropy_grad, chunk_size, rank, world,
                      group_name, reduce_hidden_grad)
        ctx.save_for_backward(hidden, weight, targets, keep_mask)
        if hidden.shape[0] == 0:
            ctx.state = None
            lp, ent = _empty_outputs(hidden, with_entropy)
        else:
            outputs, ctx.state = _start_forward(
                hidden, weight, targets, keep_mask, inv_tau, with_entropy, chunk_size,
                implementation, group_name, rank, world, check_every_call=check_every_call)
            lp, ent = outputs[0], (outputs[1] if with_entropy else None)
        if ent is not None and not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, d_log_prob, d_entropy):
        return first_order_backward(_linear_backward, ctx, d_log_prob, d_entropy,
                                    num_inputs=2)


def _linear_backward(ctx, d_log_prob, d_entropy):
    hidden, weight, _, _ = ctx.saved_tensors  # (raises if an input changed in place)
    (inv_tau, with_entropy, entropy_grad, chunk_size, rank, world, group_name,
     reduce_hidden_grad) = ctx.params
    want_d_hidden, want_d_weight = ctx.needs_input_grad[:2]
    nones = (None,) * 12
    if not (with_entropy and entropy_grad):
        d_entropy = None
    if d_log_prob is None and d_entropy is None:
        return (None, None) + nones
    if ctx.state is None:  # T = 0: nothing to compute, nothing to reduce
        return (torch.zeros_like(hidden) if want_d_hidden else None,
                torch.zeros_like(weight) if want_d_weight else None) + nones
    d_hidden, d_weight = _linear_run.backward(
        ctx.state, d_log_prob, d_entropy, inv_tau, with_entropy, entropy_grad, chunk_size,
        rank, want_d_hidden, want_d_weight)
    if d_hidden is not None and reduce_hidden_grad and world > 1:
        dist.all_reduce(d_hidden, group=_checks.resolve_group(group_name))
    return (d_hidden, d_weight) + nones


@torch.compiler.disable
def _apply_outside_compile(*args):
    """Under torch.compile the call is a graph break (no custom op for this one yet)."""
    return _LinearFunction.apply(*args)


# ---------------------------------------------------------------------------
# public entry point
# ---------------------------------------------------------------------------

def linear_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    process_group=None,
    keep_mask: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    chunk_size: Optional[int] = None,
    implementation: Optional[str] = None,
    reduce_hidden_grad: bool = False,
    check_targets: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`bridge.logprob_entropy(hidden @ weight.T, targets, ...)` without the logits.

    The output layer fused into the op: JAX computes the logits `chunk_size` vocabulary
    columns at a time (fp32 accumulation, kept in fp32), folds them into per-row
    statistics and drops them; the backward recomputes each chunk and contracts its
    d logits into d hidden and d weight. No `[T, V_loc]` tensor is ever stored, in torch or in JAX.

    Args:
      hidden: `[T, H]` float32, bfloat16 or float16, CPU or CUDA, contiguous: the input of
        the output layer. With a `process_group`, the same on every rank (the full
        sequence, as after Megatron's `copy_to_tensor_model_parallel_region` or, with
        sequence parallelism, `gather_from_sequence_parallel_region`).
      weight: `[V_loc, H]`, hidden's dtype and device, contiguous: logits = hidden @
        weight.T. With a `process_group` of R ranks, rank r's rows `[r * V_loc,
        (r + 1) * V_loc)` of the output layer (Megatron's ColumnParallelLinear weight).
      targets: `[T]` integer *global* token ids in `[0, R * V_loc)`, same device.
      process_group: the vocab-parallel `torch.distributed` group (NCCL for CUDA, gloo
        for CPU tensors), or None. The forward runs one all-gather of O(T) floats (plus
        a one-off check of T, H and V_loc across ranks the first time the group is seen).
      keep_mask, temperature, with_entropy, entropy_grad, implementation, check_targets:
        as for `bridge.logprob_entropy` (keep_mask is `[T, V_loc]`).
      chunk_size: vocabulary columns per chunk (any int >= 1); None:
        `jaxops.linear.default_chunk_size(b, V_loc)` for a window of b rows (fp32 logits
        of at most max(48 MiB, 1/24 of the window's bf16 logits), 128-column aligned).
        Extra memory per rank, in JAX's pool: about `b * chunk_size * 6` bytes for bf16
        (a chunk's fp32 logits and their gradient in bf16), the fp32 d hidden
        accumulator `b * H * 4`, and with several windows the fp32 d weight accumulator
        `V_loc * H * 4`; never `[T, V_loc]`.
      reduce_hidden_grad: what d hidden is with a process group of R > 1 ranks. The
        logits of every rank depend on all of `hidden`, so the true d hidden is the sum
        of the ranks' parts. Megatron's ColumnParallelLinear does that sum inside its
        own autograd (`allreduce_dgrad`, or the reduce-scatter mirroring its
        sequence-parallel all-gather); replacing the layer by this op, the caller
        supplies the input side.
        False (default): each rank gets its own part. Use it behind an autograd op that
        sums in its backward: `gather_from_sequence_parallel_region` (sequence
        parallelism; needed anyway to get all T tokens on every rank; backward:
        reduce-scatter) or `copy_to_tensor_model_parallel_region` (backward:
        all-reduce). Reducing here as well would count d hidden R times.
        True: the op all-reduces d hidden over the group (one `[T, H]` all-reduce in
        hidden's dtype, as Megatron's), for a `hidden` passed without such an op.
        Without a group (or R = 1) d hidden is complete either way.

    Any T works without recompiling: the rows are cut into zero-copy windows of a few
    power-of-two sizes (`bridge/_windows.py`), each compiled once; see this module's
    docstring for what the windows cost the d weight sum.

    Returns:
      `(log_prob [T] float32, entropy [T] float32 or None)`. Gradients flow to `hidden` and
      `weight` through torch autograd, in their dtypes (accumulated in float32, rounded
      once); a gradient that autograd does not need is not computed.
    """
    inv_tau, group_name, rank, world = _checks.validate_linear(
        hidden, weight, targets, keep_mask, temperature, with_entropy, entropy_grad,
        chunk_size, implementation, reduce_hidden_grad, process_group)
    chunk_size = None if chunk_size is None else int(chunk_size)
    compiling = torch.compiler.is_compiling()
    check_targets = check_targets and not compiling
    if check_targets:
        _checks.check_targets(targets, world * weight.shape[0])
    args = (hidden, weight, targets, keep_mask, inv_tau, with_entropy, entropy_grad,
            chunk_size, implementation or "", group_name, rank, world, reduce_hidden_grad,
            check_targets)
    if compiling:
        return _apply_outside_compile(*args)
    return _LinearFunction.apply(*args)
