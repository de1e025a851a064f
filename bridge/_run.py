"""`bridge.logprob_entropy`'s engine: the work on real tensors, row windows, DLPack
hand-overs, the one collective (the pieces it shares with `_linear_run.py` are in
`_engine.py`).

Data flow of one call (R = ranks of the process group, K = packed statistics per token,
windows w = zero-copy row slices of a few power-of-two sizes, `_windows.py`):

    forward   per w: logits[w] --DLPack--> JAX: stats of this shard [K, b]
              R == 1: combined in the same jitted call -> outputs [n_out, b] --> torch
              R  > 1: stats --> torch [K, T], ONE all-gather -> [R, K, T] (O(T) floats),
                      per w: --> JAX: combine -> outputs [n_out, b] --> torch
    backward  torch allocates d logits [T, V_loc]; per w: logits[w] + stats[w] +
              incoming gradients[w] --> JAX --> the kernel writes d logits[w] in place
              (CUDA + Pallas; elsewhere JAX returns it). No collective.

On CUDA with one shard, the Mosaic kernels are launched from torch instead where they
apply (`_direct.py`). Stream order as in `_engine.py`: no host synchronisation by default.
"""

from __future__ import annotations

import numpy as np
import torch

from bridge import _direct, _dlpack, _jaxfns
from bridge._engine import (ForwardState, WindowPlan, big, forward_windows,
                            implementation_for, import_window, raw_targets, small,
                            stack_cotangents)
from bridge._windows import row_align, row_windows
from jaxops.backends import registry


class Plan(WindowPlan):
    """`logits [T, V_loc]` (and the mask, the targets) of one call, cut into row windows."""

    __slots__ = ("logits",)

    def __init__(self, logits, targets, keep_mask, implementation):
        dev = self.dev = _dlpack.device(logits.device)
        self.logits = self.split = big("logits", logits, dev)
        self.mask = None if keep_mask is None else big("keep_mask", keep_mask, dev)
        self.raw_targets, self.target_mode, self.words = raw_targets(targets)
        # "pallas" (the CUDA default) runs the kernels jaxops' policy picks, on either
        # route: the direct one (`_direct.applies`) where it applies, else through JAX.
        # Backward kernels that can store the gradient into torch's tensor there do
        # (`can_write_into`: one memory pool). The same kernels on every route give a
        # row the same bits whatever the route (docs/bridge.md).
        # A mask counts as bytes: the Mosaic kernels get a bool one as its uint8 view
        # (torch's bool is one byte, 0 or 1: zero-copy), so they pay no conversion.
        self.implementation, self.config = implementation_for(
            implementation, dev,
            num_vocab=logits.shape[-1], itemsize=logits.element_size(),
            mask_dtype=None if keep_mask is None else np.uint8)
        if self.implementation == registry.MOSAIC and self.mask is not None:
            self.mask = self.mask.view(torch.uint8)
        self.num_tokens, self.num_vocab = logits.shape
        smallest = 1 if keep_mask is not None else logits.element_size()
        self.windows = row_windows(self.num_tokens,
                                   row_align(self.num_vocab * smallest, dev.alignment))


# ---------------------------------------------------------------------------- forward

def forward(plan: Plan, inv_tau, with_entropy, group_name, rank, world, *,
            want_stats: bool):
    """-> (outputs [n_out, T] float32 torch, stats [R, K, T] torch or None, state for
    `backward`). On CUDA with one shard, "pallas" (the default) and "pallas_mosaic" take
    the direct route where it applies (`_direct.py`)."""
    if _direct.applies(plan, world, want_stats):
        outputs, state = _direct.forward(plan, inv_tau, with_entropy)
        return outputs, None, state
    fn = _jaxfns.local_forward(
        shard_index=rank, world=world, inv_tau=inv_tau, with_entropy=with_entropy,
        masked=plan.mask is not None, implementation=plan.implementation,
        config=plan.config, target_mode=plan.target_mode)
    inputs = [plan.window_inputs(w) for w in plan.windows]
    xfer = plan.dev.begin()
    views = [import_window(xfer, t) for t in inputs]
    return forward_windows(plan, xfer, views, fn, with_entropy, group_name, world,
                           want_stats=want_stats)


# --------------------------------------------------------------------------- backward

def backward(plan: Plan, state: ForwardState | None, stats, d_log_prob, d_entropy, inv_tau,
             with_entropy, entropy_grad, rank) -> torch.Tensor:
    """d loss / d logits [T, V_loc] in the logits' dtype, allocated by torch (no collective).

    `state`: the eager forward's JAX views, or None (the custom-op route: the inputs
    and the gathered `stats [R, K, T]` are imported again), or the direct route's."""
    if isinstance(state, _direct.State):
        return _direct.backward(state, d_log_prob, d_entropy, entropy_grad)
    dev = plan.dev
    d_out = stack_cotangents(d_log_prob, d_entropy)
    d_windows = [small(plan.rows(d_out, w), dev) for w in plan.windows]
    inputs = None if state is not None else [
        plan.window_inputs(w) + (small(stats[:, :, w.start:w.start + w.size], dev),)
        for w in plan.windows]
    # Kernels that can store through a torch-allocated buffer (the Triton backward);
    # elsewhere JAX allocates the gradient and torch copies the windows' pieces.
    can_write_into = dev.cuda and getattr(
        registry.kernels(plan.implementation), "can_write_into", None)
    write_through = bool(can_write_into)
    grad = torch.empty_like(plan.logits) if write_through else None
    xfer = dev.begin()  # JAX waits for every torch op above
    if state is None:
        imported = [import_window(xfer, t) for t in inputs]
        views, j_stats = [v[:3] for v in imported], [v[3] for v in imported]
    else:
        views, j_stats = state.views, state.stats
    static = dict(shard_index=rank, inv_tau=inv_tau, with_entropy=with_entropy,
                  entropy_grad=entropy_grad, masked=plan.mask is not None,
                  has_d_log_prob=d_log_prob is not None, has_d_entropy=d_entropy is not None,
                  implementation=plan.implementation, config=plan.config,
                  target_mode=plan.target_mode)
    done = None
    pieces = []  # (window, JAX-made gradient rows) where the kernel did not write into grad
    for w, v, s, d in zip(plan.windows, views, j_stats, d_windows):
        j_d = xfer.to_jax(d)
        if write_through and can_write_into(v[0], v[2], plan.config):
            fn = _jaxfns.local_backward(write_through=True, **static)
            done = fn(*v, s, j_d, xfer.to_jax(plan.rows(grad, w)))
        else:
            pieces.append((w, _jaxfns.local_backward(write_through=False, **static)(
                *v, s, j_d)))
    if len(pieces) == 1 and grad is None and len(plan.windows) == 1:
        return xfer.to_torch(pieces[0][1])
    # Exported only now that every window's JAX work is queued: a piece freed after
    # torch's copy is queued returns its memory to JAX, and a later window's kernel on
    # JAX's stream could take it before torch's stream has read it.
    for w, piece in pieces:
        if grad is None:
            grad = torch.empty_like(plan.logits)
        grad[w.start + w.skip:w.start + w.size] = xfer.to_torch(piece)[w.skip:]
    if done is not None:
        # torch's stream waits for the last window; JAX ran the windows in order on one
        # stream, so every in-place write is done before torch reads the gradient.
        xfer.to_torch(done)
    return grad
