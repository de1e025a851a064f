"""Drop-in for slime's `calculate_log_probs_and_entropy` (slime/utils/ppo_utils.py).

    # from slime.utils.ppo_utils import calculate_log_probs_and_entropy
    from bridge.slime import calculate_log_probs_and_entropy
"""

from __future__ import annotations

from typing import Optional

import torch

from bridge.op import logprob_entropy


def calculate_log_probs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    tp_group,
    with_entropy: bool = False,
    chunk_size: int = -1,
    log_prob_keep_mask: Optional[torch.Tensor] = None,
    with_entropy_grad: bool = True,
    *,
    check_targets: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """slime's signature, shapes and results, computed by the fused JAX/Pallas op.

    Args:
      logits: `[T, V_loc]` this tensor-parallel rank's vocabulary shard (slime passes
        float32 logits already divided by the rollout temperature; bfloat16/float16
        work too). Must be contiguous: it is shared with JAX, not copied.
      tokens: `[T]` global token ids.
      tp_group: the tensor-parallel process group (vocab shards in rank order), or None.
      with_entropy: also return the entropy over the full vocabulary.
      chunk_size: accepted for compatibility and ignored; any value gives identical
        results. slime splits the rows into chunks to bound the `[chunk, V]`
        temporaries of its PyTorch implementation. The fused op has none -- it streams
        the vocabulary in tiles and keeps O(T) per-row statistics -- so chunking would
        only add kernel launches and collectives, and would force the per-chunk
        gradients to be concatenated into a new `[T, V]` tensor.
      log_prob_keep_mask: optional `[T, V_loc]` bool (the rollout's top-p set on this
        shard; all True for rows without a record): the log-prob is renormalised over
        the kept tokens plus the target. Entropy is unaffected.
      with_entropy_grad: False (entropy coefficient 0): entropy is returned without a
        gradient, and the backward does no entropy work.
      check_targets: extra keyword, see `bridge.logprob_entropy` (one device sync on
        CUDA to reject out-of-range ids before any kernel runs).

    Returns:
      `(log_prob [T, 1] float32, entropy [T] float32 or None)`; with `T == 0`,
      `log_prob` has shape `(0,)` (and entropy `(0,)` when requested), as in slime.
    """
    del chunk_size  # see the docstring: nothing to chunk
    log_prob, entropy = logprob_entropy(
        logits, tokens, process_group=tp_group, keep_mask=log_prob_keep_mask,
        with_entropy=bool(with_entropy), entropy_grad=bool(with_entropy_grad),
        check_targets=check_targets)
    if log_prob.shape[0] == 0:
        return log_prob, entropy  # slime: shape (0,) for empty inputs
    return log_prob.unsqueeze(-1), entropy
