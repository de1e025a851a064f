"""The executable definition of the op (docs/design.md §2), in plain `jnp`.

Everything here is written for clarity, not speed: it materialises the full
softmax, and JAX's own autodiff supplies the gradient. The tests compare every
fast implementation against this function evaluated in float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def logprob_entropy_reference(
    logits: jax.Array,  # [T, V]
    targets: jax.Array,  # [T] int
    keep_mask: jax.Array | None = None,  # [T, V] bool
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
) -> tuple[jax.Array, jax.Array | None]:
    """Log-prob of `targets` and entropy of softmax(logits / temperature).

    Computes in float32, or in float64 when `logits` are float64 (enable
    `jax_enable_x64`). Out-of-range targets give NaN in their row.
    """
    compute_dtype = jnp.promote_types(logits.dtype, jnp.float32)
    x = logits.astype(compute_dtype) / jnp.asarray(temperature, compute_dtype)
    num_vocab = x.shape[-1]
    valid = (targets >= 0) & (targets < num_vocab)
    safe_targets = jnp.where(valid, targets, 0)
    target_logit = jnp.take_along_axis(x, safe_targets[:, None], axis=-1)[:, 0]

    if keep_mask is None:
        lse = jax.nn.logsumexp(x, axis=-1)
        log_prob = target_logit - lse
    else:
        target_onehot = jnp.arange(num_vocab)[None, :] == safe_targets[:, None]
        kept = keep_mask | target_onehot
        masked_x = jnp.where(kept, x, -jnp.inf)
        log_prob = target_logit - jax.nn.logsumexp(masked_x, axis=-1)
    log_prob = jnp.where(valid, log_prob, jnp.nan)

    if not with_entropy:
        return log_prob, None
    log_p = jax.nn.log_softmax(x, axis=-1)
    p = jnp.exp(log_p)
    # 0 * log 0 is 0: entries with p == 0 (e.g. -inf logits) contribute
    # nothing. The inner `where` keeps -inf out of the product so that its
    # gradient stays finite too.
    safe_log_p = jnp.where(p > 0, log_p, 0.0)
    entropy = -jnp.sum(p * safe_log_p, axis=-1)
    if not entropy_grad:
        entropy = jax.lax.stop_gradient(entropy)
    return log_prob, entropy
