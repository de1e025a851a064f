"""`logprob_entropy` for torch tensors: validation, the custom op, its autograd, vocab parallelism.

Data flow of one call (R = ranks of `process_group`, K = packed statistics per token):

    forward   logits [T, V_loc] --DLPack--> JAX: this shard's stats [K, T]
              R == 1: combined in the same jitted call; outputs --DLPack--> torch
              R  > 1: stats --DLPack--> torch, ONE all-gather -> [R, K, T] (O(T) floats),
                      --DLPack--> JAX: combine -> log_prob, entropy --DLPack--> torch
    backward  logits + saved [R, K, T] + d_log_prob, d_entropy --> JAX --> d logits [T, V_loc]
              (no collective: each rank differentiates its own shard)

Saved between forward and backward: the input tensors (references, no copies) and the
gathered statistics, O(R K T) floats -- never a [T, V] softmax. (The eager route keeps
the JAX views of the inputs instead of re-importing them in the backward.)

Two routes into the same implementation functions:
* `torch.ops.jaxops_bridge.logprob_entropy_fwd/_bwd`, a `torch.library.custom_op` pair
  with fake implementations and registered autograd: used under `torch.compile` (and
  whenever `USE_CUSTOM_OP_IN_EAGER` is True); passes `torch.library.opcheck`.
* a plain `torch.autograd.Function` in eager mode, because the custom-op dispatch layers
  cost tens of microseconds of Python per call (see benchmarks/bridge_overhead.py).
"""

from __future__ import annotations

import collections
import dataclasses
import numbers
import sys
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from bridge import _dlpack, _jaxfns
from jaxops import staged
from jaxops.pallas_gpu import PallasConfig

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
IMPLEMENTATIONS = ("pallas", "xla")
USE_CUSTOM_OP_IN_EAGER = False
PALLAS_CONFIG = PallasConfig()  # launch parameters for CUDA; interpret mode is added off-GPU

_LITTLE_ENDIAN = sys.byteorder == "little"


# ---------------------------------------------------------------------------
# validation (all of it before any kernel runs)
# ---------------------------------------------------------------------------

def _check_tensor(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _check_flag(name, x):
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {x!r}")


def _inv_temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(
            f"temperature must be a Python number (it is compiled into the kernel), "
            f"got {type(temperature).__name__}")
    tau = float(temperature)
    if not (tau > 0 and tau != float("inf")):
        raise ValueError(f"temperature must be finite and > 0, got {tau}")
    return 1.0 / tau


def _group_info(process_group):
    """(group name, rank, size) of the vocab-parallel group; ("", 0, 1) without one."""
    if process_group is None:
        return "", 0, 1
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"process_group must be a torch.distributed.ProcessGroup or None, "
            f"got {type(process_group).__name__}")
    world = dist.get_world_size(process_group)
    if world == 1:
        return "", 0, 1
    return process_group.group_name, dist.get_rank(process_group), world


def validate(logits, targets, keep_mask, temperature, with_entropy, entropy_grad,
             process_group, implementation):
    """Raise TypeError/ValueError for a bad call; return (inv_tau, group name, rank, world)."""
    _check_tensor("logits", logits)
    _check_tensor("targets", targets)
    if logits.dim() != 2:
        raise ValueError(f"logits must have shape [T, V_loc], got {tuple(logits.shape)}")
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    num_tokens, num_vocab = logits.shape
    if num_vocab < 1:
        raise ValueError(
            f"logits must have at least one vocabulary column, got {tuple(logits.shape)}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"targets must hold integer token ids, got dtype {targets.dtype}")
    if targets.dim() != 1 or targets.shape[0] != num_tokens:
        raise ValueError(
            f"targets must have shape [T] = [{num_tokens}] to match logits "
            f"{tuple(logits.shape)}, got {tuple(targets.shape)}")
    if targets.device != logits.device:
        raise ValueError(
            f"targets are on {targets.device} but logits on {logits.device}; "
            "put them on the same device")
    if keep_mask is not None:
        _check_tensor("keep_mask", keep_mask)
        if keep_mask.dtype != torch.bool:
            raise TypeError(f"keep_mask must be a bool tensor, got dtype {keep_mask.dtype}")
        if keep_mask.shape != logits.shape:
            raise ValueError(
                f"keep_mask must have the logits' shape {tuple(logits.shape)}, "
                f"got {tuple(keep_mask.shape)}")
        if keep_mask.device != logits.device:
            raise ValueError(
                f"keep_mask is on {keep_mask.device} but logits on {logits.device}; "
                "put them on the same device")
    if logits.device.type not in ("cpu", "cuda"):
        raise ValueError(f"the bridge supports CPU and CUDA tensors, got {logits.device}")
    _check_flag("with_entropy", with_entropy)
    _check_flag("entropy_grad", entropy_grad)
    if implementation not in (None, *IMPLEMENTATIONS):
        raise ValueError(
            f"implementation must be None, 'pallas' or 'xla', got {implementation!r}")
    inv_tau = _inv_temperature(temperature)
    _check_shareable("logits", logits)
    if keep_mask is not None:
        _check_shareable("keep_mask", keep_mask)
    return (inv_tau, *_group_info(process_group))


def _check_shareable(name, t):
    """[T, V] tensors are shared with JAX as they are, or not at all."""
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (row-major) to be shared with JAX without a copy; "
            f"got strides {t.stride()} for shape {tuple(t.shape)}. The bridge does not copy "
            f"a [T, V] tensor silently: call {name}.contiguous() yourself if a copy is fine.")


def _check_aligned(name, t, alignment):
    if t.numel() and t.data_ptr() % alignment:
        raise ValueError(
            f"{name} starts at an address that is not {alignment}-byte aligned (a view at "
            f"element offset {t.storage_offset()}), which JAX cannot share without a copy. "
            f"The bridge does not copy a [T, V] tensor silently: pass {name}.clone() if a "
            f"copy is fine.")


_checked_targets: collections.deque = collections.deque(maxlen=8)


def _version(t):
    try:
        return t._version
    except RuntimeError:  # inference-mode tensors have no version counter
        return None


def check_targets_in_range(targets, total_vocab):
    """Eager only: one aminmax read back on the host (a device sync on CUDA).

    A tensor already checked, unchanged since (same object, same version counter), is
    not checked again: RL code computes several log-probs of the same tokens (reference,
    old policy, each PPO epoch)."""
    if targets.numel() == 0:
        return
    version = _version(targets)
    for ref, ver, vocab in _checked_targets:
        if ref() is targets and ver == version and vocab == total_vocab and ver is not None:
            return
    lo, hi = (int(v) for v in torch.aminmax(targets))
    if lo < 0 or hi >= total_vocab:
        bad = ((targets < 0) | (targets >= total_vocab)).nonzero().flatten()
        shown = ", ".join(f"{int(r)}: {int(targets[r])}" for r in bad[:5].tolist())
        raise ValueError(
            f"targets must lie in [0, {total_vocab}); {bad.numel()} row(s) do not "
            f"(row: value) {shown}")
    if version is not None:
        _checked_targets.append((weakref.ref(targets), version, total_vocab))


# ---------------------------------------------------------------------------
# the implementation (runs on real tensors; shared by both routes)
# ---------------------------------------------------------------------------

def _backend(implementation: str, dev) -> tuple[str, object]:
    impl = implementation or ("pallas" if dev.cuda else "xla")
    if impl == "xla":
        return "xla", ()
    config = PALLAS_CONFIG
    if not dev.cuda and not config.interpret:
        config = dataclasses.replace(config, interpret=True)
    return "pallas", config


def _small(t: torch.Tensor, dev) -> torch.Tensor:
    """An O(T) tensor in a form JAX can take: contiguous and aligned (copied if not)."""
    t = t.detach()
    if not t.is_contiguous() or (t.numel() and t.data_ptr() % dev.alignment):
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _raw_targets(targets: torch.Tensor, dev) -> tuple[torch.Tensor, str]:
    if targets.dtype == torch.int64 and _LITTLE_ENDIAN:
        return _small(targets, dev).view(torch.int32), "i64"
    if targets.dtype != torch.int32:
        targets = targets.to(torch.int32)
    return _small(targets, dev), "i32"


def _big(name, t, dev) -> torch.Tensor:
    _check_shareable(name, t)
    _check_aligned(name, t, dev.alignment)
    return t.detach()


def _resolve_group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _collective_device(group, logits):
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and logits.device.type != "cuda":
        raise ValueError(f"process group backend {backend!r} needs CUDA tensors; "
                         f"logits are on {logits.device}")
    return logits.device if logits.device.type == "cuda" and "gloo" not in backend \
        else torch.device("cpu")


_checked_shapes: set = set()


def _check_shards(group, group_name, logits):
    """Every rank must hold the same [T, V_loc]. Checked with one extra small all-gather
    the first time a (group, T, V_loc) is seen -- i.e. alongside the JAX compile that a
    new shape costs anyway; later calls with that shape need no check."""
    key = (group_name, tuple(logits.shape))
    if key in _checked_shapes:
        return
    world = dist.get_world_size(group)
    device = _collective_device(group, logits)
    mine = torch.tensor(list(logits.shape), dtype=torch.int64, device=device)
    every = torch.empty(world * 2, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine, group=group)
    shapes = [tuple(s) for s in every.view(world, 2).tolist()]
    if len(set(shapes)) != 1:
        listing = ", ".join(f"rank {r}: T={s[0]}, V_loc={s[1]}" for r, s in enumerate(shapes))
        raise ValueError(
            "every rank of the vocab-parallel group must pass logits of the same shape "
            f"[T, V_loc] (equal vocabulary shards, rank r holding columns "
            f"[r * V_loc, (r + 1) * V_loc)); got {listing}")
    _checked_shapes.add(key)


class _Inputs:
    """JAX views of one call's input tensors (each keeps its torch tensor alive)."""

    __slots__ = ("dev", "logits", "targets", "mask", "target_mode", "backend", "config",
                 "num_vocab")

    def __init__(self, xfer, logits, targets, keep_mask, implementation):
        dev = self.dev = xfer.dev
        logits = _big("logits", logits, dev)
        keep_mask = None if keep_mask is None else _big("keep_mask", keep_mask, dev)
        raw_targets, self.target_mode = _raw_targets(targets, dev)
        self.logits = xfer.to_jax(logits)
        self.targets = xfer.to_jax(raw_targets)
        self.mask = None if keep_mask is None else xfer.to_jax(keep_mask)
        self.backend, self.config = _backend(implementation, dev)
        self.num_vocab = logits.shape[1]


def _check_inputs(logits, keep_mask, dev):
    _big("logits", logits, dev)
    if keep_mask is not None:
        _big("keep_mask", keep_mask, dev)


def _forward_jax(xfer, inp: _Inputs, inv_tau, with_entropy, group_name, rank, world):
    """-> (log_prob, entropy | None, gathered stats [R, K, T]) as JAX arrays, plus the
    torch tensor of the gathered stats when a collective produced it (R > 1)."""
    masked = inp.mask is not None
    fn = _jaxfns.local_forward(
        shard_index=rank, world=world, inv_tau=inv_tau, with_entropy=with_entropy,
        masked=masked, backend=inp.backend, config=inp.config, target_mode=inp.target_mode)
    if world == 1:
        j_lp, j_ent, j_gathered = fn(inp.logits, inp.targets, inp.mask)
        return j_lp, j_ent, j_gathered, None
    packed = xfer.to_torch(fn(inp.logits, inp.targets, inp.mask))
    num_stats, num_tokens = packed.shape
    flat = torch.empty((world * num_stats, num_tokens), dtype=torch.float32,
                       device=packed.device)
    dist.all_gather_into_tensor(flat, packed, group=_resolve_group(group_name))  # the one
    gathered = flat.view(world, num_stats, num_tokens)
    xfer.resync()  # JAX waits (on the GPU) for the all-gather's result on torch's stream
    j_gathered = xfer.to_jax(gathered)
    j_lp, j_ent = _jaxfns.combine(
        num_vocab=inp.num_vocab, with_entropy=with_entropy, masked=masked,
        target_mode=inp.target_mode)(j_gathered, inp.targets)
    return j_lp, j_ent, j_gathered, gathered


def _backward_jax(xfer, inp: _Inputs, j_gathered, d_log_prob, d_entropy, inv_tau,
                  with_entropy, entropy_grad, rank):
    dev = inp.dev
    # Both incoming gradients cross as one [2, T] tensor: a torch.stack costs less host
    # time than a second DLPack import.
    grads = [g for g in (d_log_prob, d_entropy) if g is not None]
    d_out = torch.stack(grads) if len(grads) == 2 else grads[0].unsqueeze(0)
    j_d_out = xfer.to_jax(_small(d_out.float(), dev))
    fn = _jaxfns.local_backward(
        shard_index=rank, inv_tau=inv_tau, with_entropy=with_entropy,
        entropy_grad=entropy_grad, masked=inp.mask is not None,
        has_d_log_prob=d_log_prob is not None, has_d_entropy=d_entropy is not None,
        backend=inp.backend, config=inp.config, target_mode=inp.target_mode)
    return fn(inp.logits, inp.targets, inp.mask, j_gathered, j_d_out)


def _empty_outputs(logits, with_entropy, masked, world):
    num_stats = staged.num_packed(with_entropy, masked)
    return (logits.new_empty((0,), dtype=torch.float32),
            logits.new_empty((0,), dtype=torch.float32),
            logits.new_empty((world, num_stats, 0), dtype=torch.float32))


def _start_forward(logits, targets, keep_mask, inv_tau, with_entropy, implementation,
                   group_name, rank, world):
    """Checks, imports and runs the forward for T > 0 (both routes).

    -> (xfer, inputs, j_log_prob, j_entropy, j_gathered, gathered or None)."""
    dev = _dlpack.device(logits.device)
    if world > 1:  # local errors first, then the (collective) shape check
        _check_inputs(logits, keep_mask, dev)
        _check_shards(_resolve_group(group_name), group_name, logits)
    xfer = dev.begin()
    inp = _Inputs(xfer, logits, targets, keep_mask, implementation)
    return (xfer, inp) + tuple(_forward_jax(
        xfer, inp, inv_tau, with_entropy, group_name, rank, world))


def forward_impl(logits, targets, keep_mask, inv_tau: float, with_entropy: bool,
                 implementation: str, group_name: str, rank: int, world: int):
    """-> (log_prob [T] f32, entropy [T] f32 (or [0]), gathered stats [R, K, T] f32)."""
    if logits.shape[0] == 0:
        return _empty_outputs(logits, with_entropy, keep_mask is not None, world)
    xfer, _, j_lp, j_ent, j_gathered, gathered = _start_forward(
        logits, targets, keep_mask, inv_tau, with_entropy, implementation,
        group_name, rank, world)
    if gathered is None:
        gathered = xfer.to_torch(j_gathered)
    entropy = (xfer.to_torch(j_ent) if with_entropy
               else logits.new_empty((0,), dtype=torch.float32))
    return xfer.to_torch(j_lp), entropy, gathered


def backward_impl(logits, targets, keep_mask, gathered, d_log_prob, d_entropy,
                  inv_tau: float, with_entropy: bool, entropy_grad: bool,
                  implementation: str, rank: int):
    """-> d loss / d logits [T, V_loc] in the logits' dtype (no collective)."""
    if not (with_entropy and entropy_grad):
        d_entropy = None
    if logits.shape[0] == 0 or (d_log_prob is None and d_entropy is None):
        return torch.zeros_like(logits)
    dev = _dlpack.device(logits.device)
    xfer = dev.begin()
    inp = _Inputs(xfer, logits, targets, keep_mask, implementation)
    j_gathered = xfer.to_jax(_small(gathered, dev))
    return xfer.to_torch(_backward_jax(xfer, inp, j_gathered, d_log_prob, d_entropy,
                                       inv_tau, with_entropy, entropy_grad, rank))


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

class _EagerFunction(torch.autograd.Function):
    """The eager route. Besides skipping the custom-op dispatch layers it keeps the JAX
    views made in the forward (logits, targets, mask, gathered stats) for the backward,
    which then imports only the incoming gradients. The torch inputs are saved too, so
    autograd still detects in-place changes between forward and backward.

    forward(ctx, ...) rather than a separate setup_context: with the latter,
    Function.apply binds the arguments through inspect.signature on every call."""

    @staticmethod
    def forward(ctx, logits, targets, keep_mask, inv_tau, with_entropy, entropy_grad,
                implementation, group_name, rank, world):
        ctx.set_materialize_grads(False)
        ctx.params = (inv_tau, with_entropy, entropy_grad, rank)
        ctx.save_for_backward(logits, targets, keep_mask)
        if logits.shape[0] == 0:
            ctx.state = None
            lp, ent, _ = _empty_outputs(logits, with_entropy, keep_mask is not None, world)
        else:
            xfer, inp, j_lp, j_ent, j_gathered, _ = _start_forward(
                logits, targets, keep_mask, inv_tau, with_entropy, implementation,
                group_name, rank, world)
            ctx.state = (inp, j_gathered)
            lp = xfer.to_torch(j_lp)
            ent = xfer.to_torch(j_ent) if with_entropy else None
        if ent is not None and not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable  # no double backward (nor on the op route)
    def backward(ctx, d_log_prob, d_entropy):
        logits, _, _ = ctx.saved_tensors  # (raises if an input changed in place)
        inv_tau, with_entropy, entropy_grad, rank = ctx.params
        if not (with_entropy and entropy_grad):
            d_entropy = None
        if d_log_prob is None and d_entropy is None:
            return (None,) * 10
        if ctx.state is None:
            return (torch.zeros_like(logits),) + (None,) * 9
        inp, j_gathered = ctx.state
        xfer = inp.dev.begin()  # JAX waits for the incoming gradients on torch's stream
        j_dlogits = _backward_jax(xfer, inp, j_gathered, d_log_prob, d_entropy, inv_tau,
                                  with_entropy, entropy_grad, rank)
        return (xfer.to_torch(j_dlogits),) + (None,) * 9


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
    check_targets: bool = True,
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
        a one-off shape check the first time a shape is seen); the backward none.
      keep_mask: optional `[T, V_loc]` bool: the log-prob is renormalised over the kept
        tokens plus the target (which always counts); entropy stays over the full
        vocabulary.
      temperature: a Python number > 0; logits / temperature in float32 in the kernel.
      with_entropy: False: entropy is None and no entropy work is done.
      entropy_grad: False: entropy is returned but is constant for autograd.
      implementation: None ("pallas" on CUDA, "xla" on CPU), "pallas" (interpret
        mode on CPU: slow, for tests) or "xla".
      check_targets: raise ValueError for targets outside the vocabulary before any
        kernel runs. This reads two numbers back from the device (one sync on CUDA,
        skipped when the same, unmodified targets tensor was checked recently); pass
        False to skip it -- out-of-range rows then give NaN log-probs. Under
        `torch.compile` the check is skipped (NaN rows), as inside `jax.jit`.

    Returns:
      `(log_prob [T] float32, entropy [T] float32 or None)`. Gradients flow to `logits`
      through torch autograd, in the logits' dtype (accumulated in float32, rounded once).
    """
    inv_tau, group_name, rank, world = validate(
        logits, targets, keep_mask, temperature, with_entropy, entropy_grad,
        process_group, implementation)
    implementation = implementation or ""
    compiling = torch.compiler.is_compiling()
    if check_targets and not compiling:
        check_targets_in_range(targets, world * logits.shape[1])
    args = (logits, targets, keep_mask, inv_tau, with_entropy, entropy_grad,
            implementation, group_name, rank, world)
    if compiling or USE_CUSTOM_OP_IN_EAGER:
        log_prob, entropy, _ = logprob_entropy_fwd(*args)
        return log_prob, (entropy if with_entropy else None)
    return _EagerFunction.apply(*args)
