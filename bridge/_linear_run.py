"""`bridge.linear_logprob_entropy`'s engine: the work on real tensors, as `_run.py` is
the plain op's (the pieces both share are in `_engine.py`; the data flow of a call and
what its windows cost are in `linear.py`'s docstring).

Ordering is `_engine.py`'s: torch work before `begin()`, JAX after the first import, the
exports make torch's current stream wait. No host synchronisation by default.
"""

from __future__ import annotations

import numpy as np
import torch

from bridge import _dlpack, _linear_jaxfns
from bridge._engine import (ForwardState, WindowPlan, big, forward_windows,
                            implementation_for, import_window, raw_targets, small,
                            stack_cotangents)
from bridge._windows import row_align, row_windows
from jaxops.backends import registry
from jaxops.linear import chunk_columns


class Plan(WindowPlan):
    """`hidden [T, H]`, `weight [V_loc, H]` (and the mask, the targets) of one call, the
    rows cut into windows."""

    __slots__ = ("hidden", "weight", "fused_wanted")

    def __init__(self, hidden, weight, targets, keep_mask, implementation, chunk_size=None):
        dev = self.dev = _dlpack.device(hidden.device)
        self.hidden = self.split = big("hidden", hidden, dev)
        self.weight = big("weight", weight, dev)
        self.mask = None if keep_mask is None else big("keep_mask", keep_mask, dev)
        self.raw_targets, self.target_mode, self.words = raw_targets(targets)
        # As jaxops.linear_logprob_entropy decides: the kernels read fp32 logits one
        # vocabulary chunk at a time, and the mask as bool.
        chunk = chunk_columns(hidden.shape[0], weight.shape[0], chunk_size)
        self.implementation, self.config = implementation_for(
            implementation, dev, num_vocab=chunk, itemsize=4,
            mask_dtype=None if keep_mask is None else np.bool_)
        # The fused kernels as the JAX op takes them (its own config only names the
        # chunks' kernels); each window size then checks its shapes.
        self.fused_wanted = registry.fused_forward_wanted(*registry.resolve(
            implementation or None, "cuda" if dev.cuda else "cpu"))
        self.num_tokens, self.num_vocab = hidden.shape[0], weight.shape[0]
        # Every window must start aligned in hidden and in the mask; both alignments
        # are powers of two, so the larger serves both.
        align = row_align(hidden.shape[1] * hidden.element_size(), dev.alignment)
        if keep_mask is not None:
            align = max(align, row_align(self.num_vocab, dev.alignment))
        self.windows = row_windows(self.num_tokens, align)


def forward(plan: Plan, inv_tau, with_entropy, chunk_size, group_name, rank, world):
    """-> (outputs [n_out, T] float32 torch, ForwardState)."""
    fn = _linear_jaxfns.local_forward(
        shard_index=rank, world=world, inv_tau=inv_tau, with_entropy=with_entropy,
        masked=plan.mask is not None, implementation=plan.implementation,
        config=plan.config, target_mode=plan.target_mode, chunk_size=chunk_size,
        fused_wanted=plan.fused_wanted)
    inputs = [plan.window_inputs(w) for w in plan.windows]
    xfer = plan.dev.begin()
    j_weight = xfer.to_jax(plan.weight)  # the first import: an input of the first window
    views = [import_window(xfer, t) for t in inputs]
    outputs, _, state = forward_windows(
        plan, xfer, views, lambda hidden, targets, mask: fn(hidden, j_weight, targets, mask),
        with_entropy, group_name, world)
    return outputs, state


def backward(state: ForwardState, d_log_prob, d_entropy, inv_tau, with_entropy, entropy_grad,
             chunk_size, rank, want_d_hidden, want_d_weight):
    """-> (d hidden [T, H] in hidden's dtype (this rank's part) or None,
           d weight [V_loc, H] in weight's dtype or None). No collective."""
    plan, dev = state.plan, state.plan.dev
    d_out = stack_cotangents(d_log_prob, d_entropy)
    d_windows = []
    for w in plan.windows:
        d = plan.rows(d_out, w)
        if w.skip:
            # Rows an earlier window already did: a zero cotangent makes them add
            # exactly nothing to d weight (d hidden of these rows is discarded).
            d = d.clone()
            d[:w.skip] = 0
        d_windows.append(small(d, dev))
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
