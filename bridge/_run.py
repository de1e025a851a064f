"""The bridge's work on real tensors: row windows, DLPack hand-overs, the one collective.

Data flow of one call (R = ranks of the process group, K = packed statistics per token,
windows w = zero-copy row slices of a few power-of-two sizes, `_windows.py`):

    forward   per w: logits[w] --DLPack--> JAX: stats of this shard [K, b]
              R == 1: combined in the same jitted call -> outputs [n_out, b] --> torch
              R  > 1: stats --> torch [K, T], ONE all-gather -> [R, K, T] (O(T) floats),
                      per w: --> JAX: combine -> outputs [n_out, b] --> torch
    backward  torch allocates d logits [T, V_loc]; per w: logits[w] + stats[w] +
              incoming gradients[w] --> JAX --> the kernel writes d logits[w] in place
              (CUDA + Pallas; elsewhere JAX returns it). No collective.

Ordering on CUDA (`_dlpack.Transfer`): every torch op a call needs before JAX reads
(clones of small misaligned windows, the gradient's allocation, the incoming gradients'
stack) is issued before `begin()`, which makes JAX's stream wait for torch's current
stream; JAX runs the windows in order on its one compute stream; the exports at the end
make torch's stream wait for JAX. No host synchronisation anywhere by default.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist

from bridge import _direct, _dlpack, _jaxfns
from bridge._windows import row_align, row_windows
from jaxops import implementations, staged
from jaxops.pallas_config import PallasConfig

IMPLEMENTATIONS = ("pallas", "pallas_triton", "pallas_mosaic", "xla")
PALLAS_CONFIG = PallasConfig()  # launch parameters for CUDA; interpret mode is added off-GPU

_LITTLE_ENDIAN = sys.byteorder == "little"


# ------------------------------------------------------------------- tensors for JAX

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


def big(name, t, dev) -> torch.Tensor:
    check_shareable(name, t)
    check_aligned(name, t, dev.alignment)
    return t.detach()


def small(t: torch.Tensor, dev) -> torch.Tensor:
    """An O(T) tensor in a form JAX can take: contiguous and aligned (copied if not)."""
    t = t.detach()
    if not t.is_contiguous() or (t.numel() and t.data_ptr() % dev.alignment):
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _raw_targets(targets: torch.Tensor, dev) -> tuple[torch.Tensor, str, int]:
    """(targets as int32 words, decode mode, words per token). A strided view of int64
    ids is copied first (O(T)): the int32 view of its words needs unit stride."""
    if targets.dtype == torch.int64 and _LITTLE_ENDIAN:
        return targets.detach().contiguous().view(torch.int32), "i64", 2
    if targets.dtype != torch.int32:
        targets = targets.to(torch.int32)
    return targets.detach(), "i32", 1


def implementation_for(implementation: str, dev, *, num_vocab: int, itemsize: int,
                       mask_dtype=None) -> tuple[str, PallasConfig | None]:
    """(name, config) for this device and call: jaxops' one dispatch policy (Pallas on
    CUDA, interpreted elsewhere; XLA by default off-GPU; "pallas" per call as in
    `implementations.for_call`, for V_loc `num_vocab`, logits of `itemsize` bytes and a
    mask handed over as `mask_dtype`) with the bridge's launch config."""
    platform = "cuda" if dev.cuda else "cpu"
    name, config = implementations.resolve(implementation or None, platform, PALLAS_CONFIG)
    return implementations.for_call(name, config, PALLAS_CONFIG, num_vocab=num_vocab,
                                    itemsize=itemsize, mask_dtype=mask_dtype,
                                    platform=platform)


class Plan:
    """One call's torch inputs on one device, cut into row windows (torch views)."""

    __slots__ = ("dev", "logits", "mask", "raw_targets", "target_mode", "words",
                 "windows", "implementation", "config", "num_tokens", "num_vocab")

    def __init__(self, logits, targets, keep_mask, implementation):
        dev = self.dev = _dlpack.device(logits.device)
        self.logits = big("logits", logits, dev)
        self.mask = None if keep_mask is None else big("keep_mask", keep_mask, dev)
        self.raw_targets, self.target_mode, self.words = _raw_targets(targets, dev)
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
        if self.implementation == "pallas_mosaic" and self.mask is not None:
            self.mask = self.mask.view(torch.uint8)
        self.num_tokens, self.num_vocab = logits.shape
        smallest = 1 if keep_mask is not None else logits.element_size()
        self.windows = row_windows(self.num_tokens,
                                   row_align(self.num_vocab * smallest, dev.alignment))

    def rows(self, t, w, per_token=1):
        return t[w.start * per_token:(w.start + w.size) * per_token]

    def window_inputs(self, w):
        """Torch tensors of window w that JAX imports: (logits, targets words, mask)."""
        return (self.rows(self.logits, w),
                small(self.rows(self.raw_targets, w, self.words), self.dev),
                None if self.mask is None else self.rows(self.mask, w))


def _import_window(xfer, tensors):
    return tuple(None if t is None else xfer.to_jax(t) for t in tensors)


def assemble(plan: Plan, pieces, lead) -> torch.Tensor:
    """Per-window torch tensors [*lead, b] -> one [*lead, T] (no copy for one window)."""
    if len(pieces) == 1 and plan.windows[0].size == plan.num_tokens:
        return pieces[0]
    out = pieces[0].new_empty((*lead, plan.num_tokens))
    for w, piece in zip(plan.windows, pieces):
        out[..., w.start + w.skip:w.start + w.size] = piece[..., w.skip:]
    return out


# ------------------------------------------------------------------------ collectives

def resolve_group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _collective_device(group, logits):
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and logits.device.type != "cuda":
        raise ValueError(f"process group backend {backend!r} needs CUDA tensors; "
                         f"logits are on {logits.device}")
    return logits.device if logits.device.type == "cuda" and "gloo" not in backend \
        else torch.device("cpu")


_checked_groups: set = set()


def check_shards(group, group_name, logits, *, every_call: bool):
    """Every rank must hold the same [T, V_loc]. One small all-gather with a host sync:
    on the first call with a group (every rank makes that call, so every rank takes
    part), and on every call when `every_call` (the opt-in checks: T may change from
    call to call, and ranks must agree on it). A per-shape key would not do: ranks
    whose shapes differ would disagree on whether to run the collective."""
    if group_name in _checked_groups and not every_call:
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
    _checked_groups.add(group_name)


# ---------------------------------------------------------------------------- forward

class ForwardState:
    """What the eager route keeps for the backward: the JAX views of each window's
    inputs and statistics (so the backward imports only the incoming gradients)."""

    __slots__ = ("plan", "views", "stats")

    def __init__(self, plan, views, stats):
        self.plan, self.views, self.stats = plan, views, stats


def forward(plan: Plan, inv_tau, with_entropy, group_name, rank, world, *,
            want_stats: bool):
    """-> (outputs [n_out, T] float32 torch, stats [R, K, T] torch or None, state for
    `backward`). On CUDA with one shard, "pallas" (the default) and "pallas_mosaic" take
    the direct route where it applies (`_direct.py`)."""
    if _direct.applies(plan, world, want_stats):
        outputs, state = _direct.forward(plan, inv_tau, with_entropy)
        return outputs, None, state
    masked = plan.mask is not None
    fn = _jaxfns.local_forward(
        shard_index=rank, world=world, inv_tau=inv_tau, with_entropy=with_entropy,
        masked=masked, implementation=plan.implementation, config=plan.config,
        target_mode=plan.target_mode)
    inputs = [plan.window_inputs(w) for w in plan.windows]
    xfer = plan.dev.begin()
    views = [_import_window(xfer, t) for t in inputs]
    if world == 1:
        results = [fn(*v) for v in views]
        j_stats = [s for _, s in results]
        outputs = assemble(plan, [xfer.to_torch(o) for o, _ in results], (1 + with_entropy,))
        stats = None
        if want_stats:
            stats = assemble(plan, [xfer.to_torch(s) for s in j_stats],
                             (1, staged.num_packed(with_entropy, masked)))
        return outputs, stats, ForwardState(plan, views, j_stats)

    num_stats = staged.num_packed(with_entropy, masked)
    packed = assemble(plan, [xfer.to_torch(fn(*v)) for v in views], (num_stats,))
    flat = torch.empty((world * num_stats, plan.num_tokens), dtype=torch.float32,
                       device=packed.device)
    dist.all_gather_into_tensor(flat, packed, group=resolve_group(group_name))  # the one
    stats = flat.view(world, num_stats, plan.num_tokens)
    stat_windows = [small(stats[:, :, w.start:w.start + w.size], plan.dev)
                    for w in plan.windows]
    xfer.resync()  # JAX waits (on the GPU) for the all-gather and the copies above
    combine = _jaxfns.combine(num_vocab=plan.num_vocab, with_entropy=with_entropy,
                              masked=masked, target_mode=plan.target_mode)
    j_stats = [xfer.to_jax(s) for s in stat_windows]
    outputs = assemble(plan, [xfer.to_torch(combine(s, v[1])) for s, v in zip(j_stats, views)],
                       (1 + with_entropy,))
    return outputs, stats, ForwardState(plan, views, j_stats)


# --------------------------------------------------------------------------- backward

def backward(plan: Plan, state: ForwardState | None, stats, d_log_prob, d_entropy, inv_tau,
             with_entropy, entropy_grad, rank) -> torch.Tensor:
    """d loss / d logits [T, V_loc] in the logits' dtype, allocated by torch (no collective).

    `state`: the eager forward's JAX views, or None (the custom-op route: the inputs
    and the gathered `stats [R, K, T]` are imported again), or the direct route's."""
    if isinstance(state, _direct.State):
        return _direct.backward(state, d_log_prob, d_entropy, entropy_grad)
    dev = plan.dev
    grads = [g for g in (d_log_prob, d_entropy) if g is not None]
    d_out = (torch.stack(grads, dim=1) if len(grads) == 2 else grads[0].unsqueeze(1)).float()
    d_windows = [small(plan.rows(d_out, w), dev) for w in plan.windows]
    inputs = None if state is not None else [
        plan.window_inputs(w) + (small(stats[:, :, w.start:w.start + w.size], dev),)
        for w in plan.windows]
    # Kernels that can store through a torch-allocated buffer (the Triton backward);
    # elsewhere JAX allocates the gradient and torch copies the windows' pieces.
    can_write_into = dev.cuda and getattr(
        implementations.kernels(plan.implementation), "can_write_into", None)
    write_through = bool(can_write_into)
    grad = torch.empty_like(plan.logits) if write_through else None
    xfer = dev.begin()  # JAX waits for every torch op above
    if state is None:
        imported = [_import_window(xfer, t) for t in inputs]
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
