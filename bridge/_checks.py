"""Every check of a bridge call's torch inputs and process group, before any kernel runs.

`validate_logits` (`bridge.logprob_entropy`) and `validate_linear`
(`bridge.linear_logprob_entropy`) check a call's arguments on the host, with no device
work; `check_shards` checks, with one small collective, that the ranks of a group agree
on their shapes; `check_targets` is the opt-in range check of target ids (a host sync).
The process group travels through the ops as its name (`group_info`; `resolve_group`
finds the group again), which is what `torch.library` custom ops can take.
"""

from __future__ import annotations

import collections
import numbers
import weakref

import torch
import torch.distributed as dist

from jaxops.backends import registry

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
IMPLEMENTATIONS = tuple(n for n in registry.IMPLEMENTATIONS if n != registry.REFERENCE)

_checked_targets: collections.deque = collections.deque(maxlen=8)
# (the sizes' names, group name) of every group whose ranks agreed once: the op's
# [T, V_loc] and the fused head's [T, H, V_loc] are checked apart.
_checked_groups: set = set()


# ------------------------------------------------------------------ single arguments

def check_tensor(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_flag(name, x):
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {x!r}")


def check_implementation(implementation):
    if implementation not in (None, *IMPLEMENTATIONS):
        raise ValueError(
            f"implementation must be None or one of {IMPLEMENTATIONS}, got {implementation!r}")


def check_target_ids(targets, num_tokens, like_name, like):
    """`targets` `[T]` integer ids for `like` `[T, ...]` (logits or hidden)."""
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"targets must hold integer token ids, got dtype {targets.dtype}")
    if targets.dim() != 1 or targets.shape[0] != num_tokens:
        raise ValueError(
            f"targets must have shape [T] = [{num_tokens}] to match {like_name} "
            f"{tuple(like.shape)}, got {tuple(targets.shape)}")


def check_device_type(t):
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"the bridge supports CPU and CUDA tensors, got {t.device}")


def inv_temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(
            f"temperature must be a Python number (it is compiled into the kernel), "
            f"got {type(temperature).__name__}")
    tau = float(temperature)
    if not (tau > 0 and tau != float("inf")):
        raise ValueError(f"temperature must be finite and > 0, got {tau}")
    return 1.0 / tau


def group_info(process_group):
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


def resolve_group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


# ------------------------------------------------------------- tensors shared with JAX

def check_shareable(name, t):
    """Large tensors ([T, V] logits, hidden, weight, masks) are shared with JAX as they
    are, or not at all."""
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (row-major) to be shared with JAX without a copy; "
            f"got strides {t.stride()} for shape {tuple(t.shape)}. The bridge does not copy "
            f"{name} silently: call {name}.contiguous() yourself if a copy is fine.")


def check_aligned(name, t, alignment):
    if t.numel() and t.data_ptr() % alignment:
        raise ValueError(
            f"{name} starts at an address that is not {alignment}-byte aligned (a view at "
            f"element offset {t.storage_offset()}), which JAX cannot share without a copy. "
            f"The bridge does not copy {name} silently: pass {name}.clone() if a "
            f"copy is fine.")


# --------------------------------------------------------------------- whole calls

def validate_logits(logits, targets, keep_mask, temperature, with_entropy, entropy_grad,
                    process_group, implementation):
    """`bridge.logprob_entropy`'s arguments: raise TypeError/ValueError for a bad call;
    return (inv_tau, group name, rank, world)."""
    check_tensor("logits", logits)
    check_tensor("targets", targets)
    if logits.dim() != 2:
        raise ValueError(f"logits must have shape [T, V_loc], got {tuple(logits.shape)}")
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    num_tokens, num_vocab = logits.shape
    if num_vocab < 1:
        raise ValueError(
            f"logits must have at least one vocabulary column, got {tuple(logits.shape)}")
    check_target_ids(targets, num_tokens, "logits", logits)
    if targets.device != logits.device:
        raise ValueError(
            f"targets are on {targets.device} but logits on {logits.device}; "
            "put them on the same device")
    if keep_mask is not None:
        check_tensor("keep_mask", keep_mask)
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
    check_device_type(logits)
    check_flag("with_entropy", with_entropy)
    check_flag("entropy_grad", entropy_grad)
    check_implementation(implementation)
    inv_tau = inv_temperature(temperature)
    check_shareable("logits", logits)
    if keep_mask is not None:
        check_shareable("keep_mask", keep_mask)
    return (inv_tau, *group_info(process_group))


def _check_same_device(name, t, hidden):
    if t.device != hidden.device:
        raise ValueError(f"{name} is on {t.device} but hidden on {hidden.device}; "
                         "put them on the same device")


def validate_linear(hidden, weight, targets, keep_mask, temperature, with_entropy,
                    entropy_grad, chunk_size, implementation, reduce_hidden_grad,
                    process_group):
    """`bridge.linear_logprob_entropy`'s arguments: raise TypeError/ValueError for a bad
    call; return (inv_tau, group name, rank, world)."""
    check_tensor("hidden", hidden)
    check_tensor("weight", weight)
    check_tensor("targets", targets)
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
    check_target_ids(targets, num_tokens, "hidden", hidden)
    _check_same_device("weight", weight, hidden)
    _check_same_device("targets", targets, hidden)
    if keep_mask is not None:
        check_tensor("keep_mask", keep_mask)
        if keep_mask.dtype != torch.bool:
            raise TypeError(f"keep_mask must be a bool tensor, got dtype {keep_mask.dtype}")
        if keep_mask.shape != (num_tokens, num_vocab):
            raise ValueError(f"keep_mask must have shape [T, V_loc] = "
                             f"[{num_tokens}, {num_vocab}], got {tuple(keep_mask.shape)}")
        _check_same_device("keep_mask", keep_mask, hidden)
    check_device_type(hidden)
    check_flag("with_entropy", with_entropy)
    check_flag("entropy_grad", entropy_grad)
    check_flag("reduce_hidden_grad", reduce_hidden_grad)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(
            chunk_size, numbers.Integral) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
    check_implementation(implementation)
    inv_tau = inv_temperature(temperature)
    check_shareable("hidden", hidden)
    check_shareable("weight", weight)
    if keep_mask is not None:
        check_shareable("keep_mask", keep_mask)
    return (inv_tau, *group_info(process_group))


# ------------------------------------------------------------------- across the ranks

def collective_device(group, t, *, refuse_nccl_off_cuda=True) -> torch.device:
    """Where a small collective of the call runs: t's GPU, unless the group's backend
    names gloo (CPU tensors then). `refuse_nccl_off_cuda` (the plain op's rule):
    ValueError for a backend that names NCCL and a `t` off CUDA."""
    backend = str(dist.get_backend(group)).lower()
    if refuse_nccl_off_cuda and "nccl" in backend and t.device.type != "cuda":
        raise ValueError(f"process group backend {backend!r} needs CUDA tensors; "
                         f"logits are on {t.device}")
    return t.device if t.device.type == "cuda" and "gloo" not in backend \
        else torch.device("cpu")


def check_shards(group_name, sizes: dict, t, *, every_call: bool, expected: str,
                 refuse_nccl_off_cuda: bool = True):
    """Every rank must pass the same `sizes` ({"T": T, "V_loc": V_loc}, ...): else
    ValueError, "every rank of the vocab-parallel group must pass {expected}", listing
    each rank's. One small all-gather with a host sync: on the first call with a group
    (every rank makes that call, so every rank takes part), and on every call when
    `every_call` (the opt-in checks: T may change from call to call, and ranks must
    agree on it). A per-shape key would not do: ranks whose shapes differ would disagree
    on whether to run the collective. `t`: the call's tensor that places the collective
    (`collective_device`)."""
    key = (tuple(sizes), group_name)
    if key in _checked_groups and not every_call:
        return
    group = resolve_group(group_name)
    world = dist.get_world_size(group)
    device = collective_device(group, t, refuse_nccl_off_cuda=refuse_nccl_off_cuda)
    mine = torch.tensor(list(sizes.values()), dtype=torch.int64, device=device)
    every = torch.empty(world * len(sizes), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine, group=group)
    shapes = [tuple(s) for s in every.view(world, len(sizes)).tolist()]
    if len(set(shapes)) != 1:
        listing = ", ".join(
            f"rank {r}: " + ", ".join(f"{k}={v}" for k, v in zip(sizes, s))
            for r, s in enumerate(shapes))
        raise ValueError(
            f"every rank of the vocab-parallel group must pass {expected}; got {listing}")
    _checked_groups.add(key)


# --------------------------------------------------------------------- target range

def _version(t):
    try:
        return t._version
    except RuntimeError:  # inference-mode tensors have no version counter
        return None


def check_targets(targets: torch.Tensor, vocab_size: int) -> None:
    """Raise ValueError, naming the rows, if any id in `targets` is outside
    `[0, vocab_size)` (the global vocabulary). One aminmax read back to the host: a
    device sync on CUDA. A tensor already checked and unchanged since (same object, same
    version counter) is not read again: RL code computes several log-probs of the same
    tokens (reference, old policy, each PPO epoch).

    The bridge never needs this for safety -- an out-of-range id gives a NaN log-prob
    for its row, never a plausible number -- but a NaN found later in a loss is harder
    to trace than this error. `logprob_entropy(..., check_targets=True)` calls it."""
    if targets.numel() == 0:
        return
    version = _version(targets)
    for ref, ver, vocab in _checked_targets:
        if ref() is targets and ver == version and vocab == vocab_size and ver is not None:
            return
    lo, hi = (int(v) for v in torch.aminmax(targets))
    if lo < 0 or hi >= vocab_size:
        bad = ((targets < 0) | (targets >= vocab_size)).nonzero().flatten()
        shown = ", ".join(f"{int(r)}: {int(targets[r])}" for r in bad[:5].tolist())
        raise ValueError(
            f"targets must lie in [0, {vocab_size}); {bad.numel()} row(s) do not "
            f"(row: value) {shown}")
    if version is not None:
        _checked_targets.append((weakref.ref(targets), version, vocab_size))
