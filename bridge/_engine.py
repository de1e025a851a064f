"""What the two engines share: `_run.py` (`bridge.logprob_entropy`) and `_linear_run.py`
(`bridge.linear_logprob_entropy`) cut a call's rows into windows, hand them to JAX and
back, and, with a process group of R > 1 ranks, run the one all-gather of the
statistics here (`forward_windows`), so that both ops order their work the same way.

Ordering on CUDA (`_dlpack.Transfer`): every torch op a call needs before JAX reads
(clones of small misaligned windows, the gradient's allocation, the incoming gradients'
stack) is issued before `begin()`, which makes JAX's stream wait for torch's current
stream; JAX runs the windows in order on its one compute stream; the exports at the end
make torch's stream wait for JAX. No host synchronisation anywhere by default.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from bridge import _checks, _jaxfns
from jaxops import staged
from jaxops.backends import registry
from jaxops.backends.triton.config import PallasConfig

PALLAS_CONFIG = PallasConfig()  # launch parameters for CUDA; interpret mode is added off-GPU

_LITTLE_ENDIAN = sys.byteorder == "little"


# ------------------------------------------------------------------- tensors for JAX

def big(name, t, dev) -> torch.Tensor:
    """A `[T, ...]` operand ([T, V_loc] logits or mask, [T, H] hidden, [V_loc, H] weight),
    shared with JAX as it is."""
    _checks.check_shareable(name, t)
    _checks.check_aligned(name, t, dev.alignment)
    return t.detach()


def small(t: torch.Tensor, dev) -> torch.Tensor:
    """An O(T) tensor in a form JAX can take: contiguous and aligned (copied if not)."""
    t = t.detach()
    if not t.is_contiguous() or (t.numel() and t.data_ptr() % dev.alignment):
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def raw_targets(targets: torch.Tensor) -> tuple[torch.Tensor, str, int]:
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
    `registry.for_call`, for V_loc `num_vocab`, logits of `itemsize` bytes and a
    mask handed over as `mask_dtype`) with the bridge's launch config."""
    platform = "cuda" if dev.cuda else "cpu"
    name, config = registry.resolve(implementation or None, platform, PALLAS_CONFIG)
    return registry.for_call(name, config, PALLAS_CONFIG, num_vocab=num_vocab,
                             itemsize=itemsize, mask_dtype=mask_dtype, platform=platform)


# ------------------------------------------------------------------ one call's windows

class WindowPlan:
    """One call's torch inputs on one device, cut into row windows (torch views).
    `split`: the `[T, ...]` input whose windows JAX gets (logits `[T, V_loc]`, hidden
    `[T, H]`); `raw_targets` `[T * words]` int32 as `raw_targets` makes them."""

    __slots__ = ("dev", "split", "mask", "raw_targets", "target_mode", "words", "windows",
                 "implementation", "config", "num_tokens", "num_vocab")

    def rows(self, t, w, per_token=1):
        return t[w.start * per_token:(w.start + w.size) * per_token]

    def window_inputs(self, w):
        """Torch tensors of window w that JAX imports: (split rows, targets words, mask)."""
        return (self.rows(self.split, w),
                small(self.rows(self.raw_targets, w, self.words), self.dev),
                None if self.mask is None else self.rows(self.mask, w))


def import_window(xfer, tensors):
    return tuple(None if t is None else xfer.to_jax(t) for t in tensors)


def assemble(plan: WindowPlan, pieces, lead) -> torch.Tensor:
    """Per-window torch tensors [*lead, b] -> one [*lead, T] (no copy for one window)."""
    if len(pieces) == 1 and plan.windows[0].size == plan.num_tokens:
        return pieces[0]
    out = pieces[0].new_empty((*lead, plan.num_tokens))
    for w, piece in zip(plan.windows, pieces):
        out[..., w.start + w.skip:w.start + w.size] = piece[..., w.skip:]
    return out


class ForwardState:
    """What the eager route keeps for the backward: the JAX views of each window's
    inputs and statistics `[R, K, b]` (so the backward imports only the incoming
    gradients, and the fused head the weight again)."""

    __slots__ = ("plan", "views", "stats")

    def __init__(self, plan, views, stats):
        self.plan, self.views, self.stats = plan, views, stats


def forward_windows(plan: WindowPlan, xfer, views, fn, with_entropy, group_name, world, *,
                    want_stats=False):
    """The forward once the windows' inputs are imported (`views`, one tuple each):
    `fn(*view)` per window gives (outputs [n_out, b], stats [1, K, b]) for one rank, this
    shard's stats [K, b] for R > 1, which go through ONE all-gather -> [R, K, T] and
    are combined per window. -> (outputs [n_out, T] float32 torch, stats [R, K, T] torch
    (R > 1, or `want_stats`) or None, ForwardState)."""
    masked = plan.mask is not None
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
    dist.all_gather_into_tensor(flat, packed, group=_checks.resolve_group(group_name))
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


def stack_cotangents(d_log_prob, d_entropy) -> torch.Tensor:
    """The incoming gradients token-major, `d_out [T, n]` float32 (n = those present),
    so that a window of them is a contiguous slice."""
    grads = [g for g in (d_log_prob, d_entropy) if g is not None]
    return (torch.stack(grads, dim=1) if len(grads) == 2 else grads[0].unsqueeze(1)).float()
