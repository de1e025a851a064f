"""`logprob_entropy` for torch tensors: the public function, the custom op and its autograd.

The work itself -- row windows, DLPack hand-overs, the one all-gather -- is in
`_run.py`, as `_linear_run.py` is `linear_logprob_entropy`'s; the checks, all of them
before any kernel runs, are in `_checks.py`. Saved between forward and backward: the
input tensors (references, no copies) and the gathered statistics, O(R K T) floats --
never a [T, V] softmax.

Two routes into the same implementation:
* `torch.ops.jaxops_bridge.logprob_entropy_fwd/_bwd`, a `torch.library.custom_op` pair
  with fake implementations and registered autograd: used under `torch.compile` (and
  whenever `USE_CUSTOM_OP_IN_EAGER` is True); passes `torch.library.opcheck`.
* a plain `torch.autograd.Function` in eager mode, because the custom-op dispatch layers
  cost tens of microseconds of Python per call (see benchmarks/bridge_overhead.py); it
  also keeps the forward's JAX views of its inputs for the backward.
"""

from __future__ import annotations

from typing import Optional

import torch

from bridge import _checks, _run
from bridge._autograd import first_order_backward
from jaxops import staged

USE_CUSTOM_OP_IN_EAGER = False


# ---------------------------------------------------------------------------
# the implementation on real tensors (both routes)
# ---------------------------------------------------------------------------

def _empty_outputs(logits, with_entropy, masked, world):
    num_stats = staged.num_packed(with_entropy, masked)
    return (logits.new_empty((0,), dtype=torch.float32),
            logits.new_empty((0,), dtype=torch.float32),
            logits.new_empty((world, num_stats, 0), dtype=torch.float32))


def _start_forward(logits, targets, keep_mask, inv_tau, with_entropy, implementation,
                   group_name, rank, world, *, want_stats, check_every_call=False):
    """Checks, then the forward for T > 0: (outputs [n_out, T], stats or None, state)."""
    plan = _run.Plan(logits, targets, keep_mask, implementation)  # local checks first
    if world > 1:
        _checks.check_shards(
            group_name, {"T": logits.shape[0], "V_loc": logits.shape[1]}, logits,
            every_call=check_every_call,
            expected="logits of the same shape [T, V_loc] (equal vocabulary shards, rank r "
                     "holding columns [r * V_loc, (r + 1) * V_loc))")
    return _run.forward(plan, inv_tau, with_entropy, group_name, rank, world,
                        want_stats=want_stats)


def forward_impl(logits, targets, keep_mask, inv_tau: float, with_entropy: bool,
                 implementation: str, group_name: str, rank: int, world: int):
    """-> (log_prob [T] f32, entropy [T] f32 (or [0]), gathered stats [R, K, T] f32)."""
    if logits.shape[0] == 0:
        return _empty_outputs(logits, with_entropy, keep_mask is not None, world)
    outputs, stats, _ = _start_forward(logits, targets, keep_mask, inv_tau, with_entropy,
                                       implementation, group_name, rank, world,
                                       want_stats=True)
    # A custom op's outputs must not share memory: entropy gets its own (O(T) copy).
    entropy = (outputs[1].clone() if with_entropy
               else logits.new_empty((0,), dtype=torch.float32))
    return outputs[0], entropy, stats


def backward_impl(logits, targets, keep_mask, gathered, d_log_prob, d_entropy,
                  inv_tau: float, with_entropy: bool, entropy_grad: bool,
                  implementation: str, rank: int):
    """-> d loss / d logits [T, V_loc] in the logits' dtype (no collective)."""
    if not (with_entropy and entropy_grad):
        d_entropy = None
    if logits.shape[0] == 0 or (d_log_prob is None and d_entropy is None):
        return torch.zeros_like(logits)
    plan = _run.Plan(logits, targets, keep_mask, implementation)
    return _run.backward(plan, None, gathered, d_log_prob, d_entropy, inv_tau, with_entropy,
                         entropy_grad, rank)


# ---------------------------------------------------------------------------
# route 1: torch.library custom ops (torch.compile, opcheck)
# ---------------------------------------------------------------------------

@torch.library.custom_op("jaxops_bridge::logprob_entropy_fwd", mutates_args=())
def logprob_entropy_fwd(
    logits: torch.Tensor, targets: torch.Tensor, keep_mask: Optional[torch.Tensor],
    inv_tau: float, with_entropy: bool, entropy_grad: bool, implementation: str,
    group_name: str, rank: int, world: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_prob [T], entropy [T] or [0], gathered stats [R, K, T]), all float32."""
    del entropy_grad  # only used by the autograd registration
    return forward_impl(logits, targets, keep_mask, inv_tau, with_entropy,
                        implementation, group_name, rank, world)


@logprob_entropy_fwd.register_fake
def _(logits, targets, keep_mask, inv_tau, with_entropy, entropy_grad, implementation,
      group_name, rank, world):
    num_tokens = logits.shape[0]
    num_stats = staged.num_packed(with_entropy, keep_mask is not None)
    f32 = torch.float32
    return (logits.new_empty((num_tokens,), dtype=f32),
            logits.new_empty((num_tokens if with_entropy else 0,), dtype=f32),
            logits.new_empty((world, num_stats, num_tokens), dtype=f32))


@torch.library.custom_op("jaxops_bridge::logprob_entropy_bwd", mutates_args=())
def logprob_entropy_bwd(
    logits: torch.Tensor, targets: torch.Tensor, keep_mask: Optional[torch.Tensor],
    gathered: torch.Tensor, d_log_prob: Optional[torch.Tensor],
    d_entropy: Optional[torch.Tensor], inv_tau: float, with_entropy: bool,
    entropy_grad: bool, implementation: str, rank: int,
) -> torch.Tensor:
    """d loss / d logits [T, V_loc] in the logits' dtype."""
    return backward_impl(logits, targets, keep_mask, gathered, d_log_prob, d_entropy,
                         inv_tau, with_entropy, entropy_grad, implementation, rank)


@logprob_entropy_bwd.register_fake
def _(logits, targets, keep_mask, gathered, d_log_prob, d_entropy, inv_tau, with_entropy,
      entropy_grad, implementation, rank):
    return torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    (logits, targets, keep_mask, inv_tau, with_entropy, entropy_grad, implementation,
     _group_name, rank, _world) = inputs
    _, entropy, gathered = output
    ctx.save_for_backward(logits, targets, keep_mask, gathered)
    ctx.mark_non_differentiable(gathered)
    if not (with_entropy and entropy_grad):
        ctx.mark_non_differentiable(entropy)
    ctx.set_materialize_grads(False)
    ctx.params = (inv_tau, with_entropy, entropy_grad, implementation, rank)


def _op_backward(ctx, d_log_prob, d_entropy, _d_gathered):
    logits, targets, keep_mask, gathered = ctx.saved_tensors
    inv_tau, with_entropy, entropy_grad, implementation, rank = ctx.params
    if not (with_entropy and entropy_grad):
        d_entropy = None
    if d_log_prob is None and d_entropy is None:
        return (None,) * 10
    d_logits = logprob_entropy_bwd(logits, targets, keep_mask, gathered, d_log_prob,
                                   d_entropy, inv_tau, with_entropy, entropy_grad,
                                   implementation, rank)
    return (d_logits,) + (None,) * 9


logprob_entropy_fwd.register_autograd(_op_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------
# route 2: eager autograd.Function (same implementation, fewer dispatch layers)
# ---------------------------------------------------------------------------

def _eager_backward(ctx, d_log_prob, d_entropy):
    logits, _, _ = ctx.saved_tensors  # (raises if an input changed in place)
    inv_tau, with_entropy, entropy_grad, rank = ctx.params
    nones = (None,) * 3
    if not (with_entropy and entropy_grad):
        d_entropy = None
    if d_log_prob is None and d_entropy is None:
        return (None,) + nones
    if ctx.state is None:
        return (torch.zeros_like(logits),) + nones
    state = ctx.state
    return (_run.backward(state.plan, state, None, d_log_prob, d_entropy, inv_tau,
                          with_entropy, entropy_grad, rank),) + nones


class _EagerFunction(torch.autograd.Function):
    """The eager route. Besides skipping the custom-op dispatch layers it keeps the JAX
    views made in the forward (logits, targets, mask, statistics per row window) for the
    backward, which then imports only the incoming gradients and the gradient buffer.
    The torch inputs are saved too, so autograd still detects in-place changes between
    forward and backward.

    Host time per call counts here (tens of µs per call at small T): the non-tensor
    arguments travel as one tuple, `forward(ctx, ...)` rather than a separate
    setup_context (with which Function.apply binds the arguments through
    inspect.signature on every call), and the guard against double backward is set
    up only when the backward itself is being differentiated (create_graph=True)."""

    @staticmethod
    def forward(ctx, logits, targets, keep_mask, call):
        (inv_tau, with_entropy, entropy_grad, implementation, group_name, rank, world,
         check_every_call) = call
        ctx.set_materialize_grads(False)
        ctx.params = (inv_tau, with_entropy, entropy_grad, rank)
        ctx.save_for_backward(logits, targets, keep_mask)
        if logits.shape[0] == 0:
            ctx.state = None
            lp, ent, _ = _empty_outputs(logits, with_entropy, keep_mask is not None, world)
        else:
            outputs, _, ctx.state = _start_forward(
                logits, targets, keep_mask, inv_tau, with_entropy, implementation,
                group_name, rank, world, want_stats=False, check_every_call=check_every_call)
            lp, ent = outputs[0], (outputs[1] if with_entropy else None)
        if ent is not None and not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, d_log_prob, d_entropy):
        return first_order_backward(_eager_backward, ctx, d_log_prob, d_entropy,
                                    num_inputs=1)


# ---------------------------------------------------------------------------
# public entry point
# ---------------------------------------------------------------------------

def logprob_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    process_group=None,
    keep_mask: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    implementation: Optional[str] = None,
    check_targets: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token log-prob of `targets` and entropy of softmax(logits / temperature).

    Args:
      logits: `[T, V_loc]` float32, bfloat16 or float16, CPU or CUDA, contiguous. With a
        `process_group` of R ranks this is rank r's vocabulary shard, columns
        `[r * V_loc, (r + 1) * V_loc)`; every rank passes the same T and V_loc. Shared
        with JAX without a copy (never modified).
      targets: `[T]` integer *global* token ids in `[0, R * V_loc)`, same device.
      process_group: the vocab-parallel `torch.distributed` group (NCCL for CUDA, gloo
        for CPU tensors), or None. The forward runs one all-gather of O(T) floats (plus
        a one-off check of V_loc across ranks the first time the group is seen); the
        backward none.
      keep_mask: optional `[T, V_loc]` bool: the log-prob is renormalised over the kept
        tokens plus the target (which always counts); entropy stays over the full
        vocabulary.
      temperature: a Python number > 0; logits / temperature in float32 in the kernel.
      with_entropy: False: entropy is None and no entropy work is done.
      entropy_grad: False: entropy is returned but is constant for autograd.
      implementation: None ("pallas" on CUDA, "xla" on CPU), "pallas", "pallas_triton",
        "pallas_mosaic" (Mosaic GPU kernels, Hopper+), all three in interpret mode on CPU
        (slow, for tests), or "xla". In eager mode on one shard (no process group, or a
        group of one) of an sm_90+ GPU, "pallas" and "pallas_mosaic" launch the Mosaic
        kernels from torch without JAX's runtime (`bridge/_direct.py`): on the H200 2-3x
        less time per call than through JAX up to T = 8192 and as fast at T = 32,768.
        "pallas" runs the kernels jaxops' policy picks for V_loc, dtype and mask on
        every route (Mosaic on Hopper where TMA tiles V_loc, else Triton); through JAX
        either backward writes the gradient into torch's memory.
      check_targets: opt-in checks that cost a host sync per call: raise ValueError for
        targets outside the vocabulary (`bridge.check_targets`) and, with a process
        group, for ranks passing different T. Off by default (no host sync): an
        out-of-range id then gives a NaN log-prob in its row -- never a plausible
        number -- and ranks must pass the same T, as for Megatron's cross-entropy.
        Under `torch.compile` the checks are skipped.

    Any T works without recompiling: the rows are cut into zero-copy windows of a few
    power-of-two sizes (`bridge/_windows.py`), each compiled once.

    Returns:
      `(log_prob [T] float32, entropy [T] float32 or None)`. Gradients flow to `logits`
      through torch autograd, in the logits' dtype (accumulated in float32, rounded once).
    """
    inv_tau, group_name, rank, world = _checks.validate_logits(
        logits, targets, keep_mask, temperature, with_entropy, entropy_grad,
        process_group, implementation)
    implementation = implementation or ""
    compiling = torch.compiler.is_compiling()
    check_targets = check_targets and not compiling
    if check_targets:
        _checks.check_targets(targets, world * logits.shape[1])
    if compiling or USE_CUSTOM_OP_IN_EAGER:
        log_prob, entropy, _ = logprob_entropy_fwd(
            logits, targets, keep_mask, inv_tau, with_entropy, entropy_grad,
            implementation, group_name, rank, world)
        return log_prob, (entropy if with_entropy else None)
    return _EagerFunction.apply(logits, targets, keep_mask, (
        inv_tau, with_entropy, entropy_grad, implementation, group_name, rank, world,
        check_targets))
