"""The fused output layer split at its one collective, for callers that run their own
(the PyTorch bridge's `bridge.linear_logprob_entropy`). `staged.py` for `linear.py`:

    packed = local_forward(hidden, weight, targets, ...)       # this shard: [K, T] float32
    gathered = <all-gather packed over the vocab shards>       # [R, K, T], vocab order
    log_prob, entropy = staged.combine_gathered(gathered, targets, ...)
    d_hidden, d_weight_acc = local_backward(hidden, weight, targets, gathered, ...,
                                            d_weight_acc)

Both walk the vocabulary in chunks of `chunk` columns (`linear._over_columns`), so no
`[T, V_loc]` logits or gradient exist beyond one `[T, chunk]` fp32 chunk. `local_backward`
needs no collective: the cotangent of this shard's statistics is the VJP of the
combine with respect to its own row of `gathered` (as in `staged.local_backward`).
Its `d hidden` is this shard's part of the sum over shards; summing it (or not) is
the caller's business. `d_weight_acc` is an fp32 `[V_loc, H]` accumulator the call
adds its rows' `d weight` to, so that a caller that cuts T into pieces rounds d weight
to the weight's dtype once, after the last piece.

Not jitted here: the bridge jits each configuration itself (`bridge/_linear_jaxfns.py`).
"""

from __future__ import annotations

import jax

from jaxops.backends.triton.config import PallasConfig
from jaxops.linear import chunked_backward, linear_local_stats
from jaxops.staged import pack_stats, shard_cotangents, shard_local_targets


def local_forward(hidden, weight, targets, keep_mask, shard_index, *, inv_tau: float,
                  with_entropy: bool, implementation: str, config: PallasConfig | None,
                  chunk: int, fused_forward: bool = False) -> jax.Array:
    """This shard's statistics of `hidden [T, H] @ weight [V_loc, H]^T`, packed as
    `[K, T]` float32 (`staged.num_packed`). `targets [T]` are global ids.
    `fused_forward`: in one Mosaic GPU kernel (`backends/mosaic/linear.py`; the caller checks that
    it applies), else chunked."""
    local_targets = shard_local_targets(targets, shard_index, weight.shape[0])
    stats = linear_local_stats(hidden, weight, local_targets, keep_mask, inv_tau,
                                with_entropy, True, implementation, config, chunk,
                                fused_forward)
    return pack_stats(stats, with_entropy, keep_mask is not None)


def local_backward(hidden, weight, targets, keep_mask, gathered, shard_index, d_log_prob,
                   d_entropy, d_weight_acc, *, inv_tau: float, with_entropy: bool,
                   entropy_grad: bool, implementation: str, config: PallasConfig | None,
                   chunk: int, want_d_hidden: bool = True, want_d_weight: bool = False,
                   fused_logits: bool = False):
    """(d hidden `[T, H]` (hidden's dtype; this shard's part) or None, d weight or None).

    d weight `[V_loc, H]`: `d_weight_acc` + this call's d weight (fp32) with an
    accumulator; else, with `want_d_weight`, this call's d weight in weight's dtype
    (for a caller with one piece: no fp32 copy); else None.

    `gathered [R, K, T]`: every shard's packed statistics; `d_log_prob [T]` float32 (or
    None), `d_entropy [T]` or None: the incoming cotangents. `fused_logits`: the d logits
    from `mosaic.linear.backward_logits` (the caller checks that it applies)."""
    num_vocab = weight.shape[0]
    own, coefs = shard_cotangents(gathered, targets, shard_index, d_log_prob, d_entropy,
                                  num_vocab=num_vocab, with_entropy=with_entropy,
                                  entropy_grad=entropy_grad, masked=keep_mask is not None)
    return chunked_backward(
        hidden, weight, shard_local_targets(targets, shard_index, num_vocab), keep_mask,
        own.max_logit, own.masked_max, coefs, inv_tau=inv_tau,
        implementation=implementation, config=config, chunk=chunk, d_weight=d_weight_acc,
        want_d_hidden=want_d_hidden, want_d_weight=want_d_weight, fused_logits=fused_logits)
