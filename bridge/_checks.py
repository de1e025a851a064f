"""`check_targets`: the opt-in range check of target ids (a host sync)."""

from __future__ import annotations

import collections
import weakref

import torch

_checked_targets: collections.deque = collections.deque(maxlen=8)


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
