"""`linear_logprob_entropy` for torch tensors: the output layer fused into the op.

`bridge.logprob_entropy(hidden @ weight.T, targets, ...)` without the `[T, V_loc]` logits:
JAX computes them `chunk_size` vocabulary columns at a time from DLPack views of torch's
`hidden` and `weight` (`jaxops/linear_staged.py`, `jaxops/linear.py`), folds them into the
row statistics and drops them; the backward recomputes each chunk and contracts its
`d logits` into `d hidden` and `d weight` (docs/design.md §10). A window takes the fused
Mosaic GPU kernels where `jaxops.linear_logprob_entropy` would (the default "pallas" on
Hopper+, bf16/fp16, no mask; `linear_mosaic.py`): its forward as one fused kernel, and,
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

Ordering is `_run.py`'s: torch work before `begin()`, JAX after the first import, the
exports make torch's current stream wait. No host synchronisation by default.
"""

from __future__ import annotations

import numbers
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from bridge import _checks, _dlpack, _linear_jaxfns, _run
from bridge._autograd import first_order_backward
from bridge._jaxfns import combine as combine_fn
from bridge._run import IMPLEMENTATIONS, check_shareable
from bridge._windows import row_align, row_windows
from bridge.op import LOGIT_DTYPES, _check_flag, _check_tensor, _group_info, _inv_temperature
from jaxops import implementations, staged
from jaxops.linear import chunk_columns, fused_forward_wanted

__all__ = ["linear_logprob_entropy"]


# ---------------------------------------------------------------------------
# validation (all of it before any kernel runs)
# ---------------------------------------------------------------------------

def _check_same_device(name, t, hidden):
    if t.device != hidden.device:
        raise ValueError(f"{name} is on {t.device} but hidden on {hidden.device}; "
                         "put them on the same device")


def validate(hidden, weight, targets, keep_mask, temperature, with_entropy, entropy_grad,
             chunk_size, implementation, reduce_hidden_grad, process_group):
    """Raise TypeError/ValueError for a bad call; return (inv_tau, group name, rank, world)."""
    _check_tensor("hidden", hidden)
    _check_tensor("weight", weight)
    _check_tensor("targets", targets)
    if hidden.dim() != 2:
        raise ValueError(f"hidden must have shape [T, H], got {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must have shape [V_loc, H], got {tuple(weight.shape)}")
    num_tokens, hidden_size = hidden.shape
    num_vocab = weight.shape[0]
    if hidden_size < 1 or num_vocab < 1:
        raise ValueError(f"hidden [T, H] = {tuple(hidden.shape)} and weight [V_loc, H] = "
                         f"{tuple(weight.shape)} need H >= 1 and V_loc >= 1")
    if weight.shape[1] != hidden_size:
        raise ValueError(f"weight [V_loc, H] = {tuple(weight.shape)} does not match hidden "
                         f"[T, H] = {tuple(hidden.shape)}: H must agree")
    if hidden.dtype not in LOGIT_DTYPES:
        raise TypeError(f"hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"hidden and weight must have the same dtype, got {hidden.dtype} "
                        f"and {weight.dtype}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"targets must hold integer token ids, got dtype {targets.dtype}")
    if targets.dim() != 1 or targets.shape[0] != num_tokens:
        raise ValueError(f"targets must have shape [T] = [{num_tokens}] to match hidden "
                         f"{tuple(hidden.shape)}, got {tuple(targets.shape)}")
    _check_same_device("weight", weight, hidden)
    _check_same_device("targets", targets, hidden)
    if keep_mask is not None:
        _check_tensor("keep_mask", keep_mask)
        if keep_mask.dtype != torch.bool:
            raise TypeError(f"keep_mask must be a bool tensor, got dtype {keep_mask.dtype}")
        if keep_mask.shape != (num_tokens, num_vocab):
            raise ValueError(f"keep_mask must have shape [T, V_loc] = "
                             f"[{num_tokens}, {num_vocab}], got {tuple(keep_mask.shape)}")
        _check_same_device("keep_mask", keep_mask, hidden)
    if hidden.device.type not in ("cpu", "cuda"):
        raise ValueError(f"the bridge supports CPU and CUDA tensors, got {hidden.device}")
    _check_flag("with_entropy", with_entropy)
    _check_flag("entropy_grad", entropy_grad)
    _check_flag("reduce_hidden_grad", reduce_hidden_grad)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(
            chunk_size, numbers.Integral) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
    if implementation not in (None, *IMPLEMENTATIONS):
        raise ValueError(
            f"implementation must be None or one of {IMPLEMENTATIONS}, got {implementation!r}")
    inv_tau = _inv_temperature(temperature)
    check_shareable("hidden", hidden)
    check_shareable("weight", weight)
    if keep_mask is not None:
        check_shareable("keep_mask", keep_mask)
    return (inv_tau, *_group_info(process_group))


_checked_groups: set = set()


def check_shards(group, group_name, hidden, weight, *, every_call: bool):
    """Every rank must pass the same T, H and V_loc: one small all-gather with a host
    sync on a group's first call (and on every call when `every_call`), as
    `_run.check_shards` does for the plain op."""
    if group_name in _checked_groups and not every_call:
        return
    world = dist.get_world_size(group)
    backend = str(dist.get_backend(group)).lower()
    device = hidden.device if hidden.device.type == "cuda" and "gloo" not in backend \
        else torch.device("cpu")
    mine = torch.tensor([hidden.shape[0], hidden.shape[1], weight.shape[0]],
                        dtype=torch.int64, device=device)
    every = torch.empty(world * 3, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine, group=group)
    shapes = [tuple(s) for s in every.view(world, 3).tolist()]
    if len(set(shapes)) != 1:
        listing = ", ".join(f"rank {r}: T={s[0]}, H={s[1]}, V_loc={s[2]}"
                            for r, s in enumerate(shapes))
        raise ValueError(
            "every rank of the vocab-parallel group must pass the same hidden [T, H] and "
            f"an equal vocabulary shard weight [V_loc, H]; got {listing}")
    _checked_groups.add(group_name)


# ---------------------------------------------------------------------------
# the work on real tensors
# ---------------------------------------------------------------------------

class Plan:
    """One call's torch inputs on one device, cut into row windows (torch views)."""

    __slots__ = ("dev", "hidden", "weight", "mask", "raw_targets", "target_mode", "words",
                 "windows", "implementation", "config", "num_tokens", "num_vocab",
                 "fused_wanted")

    def __init__(self, hidden, weight, targets, keep_mask, implementation, chunk_size=None):
        dev = self.dev = _dlpack.device(hidden.device)
        self.hidden = _run.big("hidden", hidden, dev)
        self.weight = _run.big("weight", weight, dev)
        self.mask = None if keep_mask is None else _run.big("keep_mask", keep_mask, dev)
        self.raw_targets, self.target_mode, self.words = _run._raw_targets(targets, dev)
        # As jaxops.linear_logprob_entropy decides: the kernels read fp32 logits one
        # vocabulary chunk at a time, and the mask as bool.
        chunk = chunk_columns(hidden.shape[0], weight.shape[0], chunk_size)
        self.implementation, self.config = _run.implementation_for(
            implementation, dev, num_vocab=chunk, itemsize=4,
            mask_dtype=None if keep_mask is None else np.bool_)
        # The fused kernels as the JAX op takes them (its own config only names the
        # chunks' kernels); each window size then checks its shapes.
        self.fused_wanted = fused_forward_wanted(*implementations.resolve(
            implementation or None, "cuda" if dev.cuda else "cpu"))
        self.num_tokens, self.num_vocab = hidden.shape[0], weight.shape[0]
        # Every window must start aligned in hidden and in the mask; both alignments
        # are powers of two, so the larger serves both.
        align = row_align(hidden.shape[1] * hidden.element_size(), dev.alignment)
        if keep_mask is not None:
            align = max(align, row_align(self.num_vocab, dev.alignment))
        self.windows = row_windows(self.num_tokens, align)

    def rows(self, t, w, per_token=1):
        return t[w.start * per_token:(w.start + w.size) * per_token]

    def window_inputs(self, w):
        """Torch tensors of window w that JAX imports: (hidden, targets words, mask)."""
        return (self.rows(self.hidden, w),
                _run.small(self.rows(self.raw_targets, w, self.words), self.dev),
                None if self.mask is None else self.rows(self.mask, w))


def _import(xfer, tensors):
    return tuple(None if t is None else xfer.to_jax(t) for t in tensors)


class ForwardState:
    """What the backward reuses: the JAX views of each window's inputs and each
    window's statistics `[R, K, b]` (the backward imports the weight again)."""

    __slots__ = ("plan", "views", "stats")

    def __init__(self, plan, views, stats):
        self.plan, self.views, self.stats = plan, views, stats


def forward(plan: Plan, inv_tau, with_entropy, chunk_size, group_name, rank, world):
    """-> (outputs [n_out, T] float32 torch, ForwardState)."""
    masked = plan.mask is not None
    fn = _linear_jaxfns.local_forward(
        shard_index=rank, world=world, inv_tau=inv_tau, with_entropy=with_entropy,
        masked=masked, implementation=plan.implementation, config=plan.config,
        target_mode=plan.target_mode, chunk_size=chunk_size, fused_wanted=plan.fused_wanted)
    inputs = [plan.window_inputs(w) for w in plan.windows]
    xfer = plan.dev.begin()
    j_weight = xfer.to_jax(plan.weight)  # the first import: an input of the first window
    views = [_import(xfer, t) for t in inputs]
    if world == 1:
        results = [fn(v[0], j_weight, v[1], v[2]) for v in views]
        outputs = _run.assemble(plan, [xfer.to_torch(o) for o, _ in results],
                                (1 + with_entropy,))
        return outputs, ForwardState(plan, views, [s for _, s in results])

    num_stats = staged.num_packed(with_entropy, masked)
    packed = _run.assemble(plan, [xfer.to_torch(fn(v[0], j_weight, v[1], v[2]))
                                  for v in views], (num_stats,))
    flat = torch.empty((world * num_stats, plan.num_tokens), dtype=torch.float32,
                       device=packed.device)
    dist.all_gather_into_tensor(flat, packed, group=_run.resolve_group(group_name))  # the one
    stats = flat.view(world, num_stats, plan.num_tokens)
    stat_windows = [_run.small(stats[:, :, w.start:w.start + w.size], plan.dev)
                    for w in plan.windows]
    xfer.resync()  # JAX waits (on the GPU) for the all-gather and the copies above
    combine = combine_fn(num_vocab=plan.num_vocab, with_entropy=with_entropy, masked=masked,
                         target_mode=plan.target_mode)
    j_stats = [xfer.to_jax(s) for s in stat_windows]
    outputs = _run.assemble(plan, [xfer.to_torch(combine(s, v[1]))
                                   for s, v in zip(j_stats, views)], (1 + with_entropy,))
    return outputs, ForwardState(plan, views, j_stats)


def backward(state: ForwardState, d_log_prob, d_entropy, inv_tau, with_entropy, entropy_grad,
             chunk_size, rank, want_d_hidden, want_d_weight):
    """-> (d hidden [T, H] in hidden's dtype (this rank's part) or None,
           d weight [V_loc, H] in weight's dtype or None). No collective."""
    plan, dev = state.plan, state.plan.dev
    grads = [g for g in (d_log_prob, d_entropy) if g is not None]
    d_out = (torch.stack(grads, dim=1) if len(grads) == 2 else grads[0].unsqueeze(1)).float()
    d_windows = []
    for w in plan.windows:
        d = plan.rows(d_out, w)
        if w.skip:
            # Rows an earlier window already did: a zero cotangent makes them add
            # exactly nothing to d weight (d hidden of these rows is discarded).
            d = d.clone()
            d[:w.skip] = 0
        d_windows.append(_run.small(d, dev))
    xfer = dev.begin()  # JAX waits for every torch op above
    # The weight again (not the forward's view): as this call's first import it is an
    # input of its first computation, which orders that after torch's stream.
    j_weight = xfer.to_jax(plan.weight)
    j_d = [xfer.to_jax(d) for d in d_windows]
    # One window: d weight comes out in its dtype, with no fp32 accumulator at all.
    mode = None if not want_d_weight else (
        "direct" if len(plan.windows) == 1 else "accumulate")
    fn = _linear_jaxfns.local_backward(
        shard_index=rank, inv_tau=inv_tau, with_entropy=with_entropy,
        entropy_grad=entropy_grad, masked=plan.mask is not None,
        has_d_log_prob=d_log_prob is not None, has_d_entropy=d_entropy is not None,
        implementation=plan.implementation, config=plan.config,
        target_mode=plan.target_mode, chunk_size=chunk_size,
        want_d_hidden=want_d_hidden, d_weight_mode=mode, fused_wanted=plan.fused_wanted)
    acc = _linear_jaxfns.zero_accumulator()(j_weight) if mode == "accumulate" else None
    pieces = []
    for v, s, d in zip(state.views, state.stats, j_d):
        d_hidden_w, d_weight_w = fn(v[0], j_weight, v[1], v[2], s, d, acc)
        acc = d_weight_w if mode == "accumulate" else None
        pieces.append(d_hidden_w)
    d_weight = None
    if mode == "direct":
        d_weight = xfer.to_torch(d_weight_w)
    elif mode == "accumulate":
        if plan.weight.dtype != torch.float32:
            acc = _linear_jaxfns.round_accumulator(dtype=_jax_dtype(plan.weight.dtype))(acc)
        d_weight = xfer.to_torch(acc)
    d_hidden = None
    if want_d_hidden:
        # Every JAX computation is queued before any exported piece can be freed.
        pieces = [xfer.to_torch(p) for p in pieces]
        if len(pieces) == 1 and plan.windows[0].size == plan.num_tokens:
            d_hidden = pieces[0]
        else:
            d_hidden = plan.hidden.new_empty(plan.hidden.shape)
            for w, piece in zip(plan.windows, pieces):
                d_hidden[w.start + w.skip:w.start + w.size] = piece[w.skip:]
    return d_hidden, d_weight


def _jax_dtype(dtype: torch.dtype):
    import jax.numpy as jnp

    return {torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}[dtype]


# ---------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------

def _empty_outputs(hidden, with_entropy):
    empty = hidden.new_empty((0,), dtype=torch.float32)
    return empty, (hidden.new_empty((0,), dtype=torch.float32) if with_entropy else None)


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
            plan = Plan(hidden, weight, targets, keep_mask, implementation, chunk_size)
            if world > 1:
                check_shards(_run.resolve_group(group_name), group_name, hidden, weight,
                             every_call=check_every_call)
            outputs, ctx.state = forward(plan, inv_tau, with_entropy, chunk_size,
                                         group_name, rank, world)
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
    d_hidden, d_weight = backward(ctx.state, d_log_prob, d_entropy, inv_tau, with_entropy,
                                  entropy_grad, chunk_size, rank, want_d_hidden,
                                  want_d_weight)
    if d_hidden is not None and reduce_hidden_grad and world > 1:
        dist.all_reduce(d_hidden, group=_run.resolve_group(group_name))
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
    inv_tau, group_name, rank, world = validate(
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
