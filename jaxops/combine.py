"""Shard statistics -> log-prob and entropy, in plain differentiable JAX on `[T]` arrays.

With `axis_name` set this runs inside `shard_map` over the vocabulary axis and
uses exactly two O(T) collectives: one `pmax` of the (stop-gradient) row maxima
and one `psum` of the stacked rescaled sums (docs/design.md §3). JAX transposes the psum
itself, which is what keeps gradients right under both `check_vma` settings:
no collective in the backward with `check_vma=True`, one O(T) psum with
`check_vma=False` (where JAX divides a replicated output's cotangent by the
shard count, and the psum's transpose restores it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxops.contract import LocalStats


def _rescale(row_max, global_max):
    """exp(m_r - M) and m_r - M, with shards that hold nothing (m_r = -inf) giving 0."""
    present = jnp.isfinite(row_max)
    delta = jnp.where(present, row_max - global_max, 0.0)
    return jnp.where(present, jnp.exp(delta), 0.0), delta


def combine(
    stats: LocalStats,
    targets_valid: jax.Array,  # [T] bool: 0 <= target < V (global)
    *,
    entropy_grad: bool = True,
    axis_name=None,
) -> tuple[jax.Array, jax.Array | None]:
    """Combine per-shard statistics into (log_prob [T], entropy [T] or None)."""
    masked = stats.masked_max is not None
    with_entropy = stats.sum_exp_shifted is not None

    maxima = [stats.max_logit] + ([stats.masked_max] if masked else [])
    maxima = lax.stop_gradient(jnp.stack(maxima))
    global_maxima = maxima if axis_name is None else lax.pmax(maxima, axis_name)
    global_max = global_maxima[0]
    weight, delta = _rescale(maxima[0], global_max)

    # Everything that is summed over shards travels in one psum.
    terms = [weight * stats.sum_exp, stats.target_logit]
    if with_entropy:
        shifted = stats.sum_exp_shifted
        if not entropy_grad:
            shifted = lax.stop_gradient(shifted)
        # sum_j exp(x_j - M) (x_j - M) of this shard, from its stats relative to m_r.
        terms.append(weight * (shifted + delta * stats.sum_exp))
    if masked:
        # maxima[1] are the masked sums' reference points (LocalStats.masked_max): a
        # shard's kept maximum or its row maximum. Only as such are they used: each
        # shard's sum is rescaled to the largest reference point over the shards.
        masked_weight, _ = _rescale(maxima[1], global_maxima[1])
        terms.append(masked_weight * stats.masked_sum_exp)
    sums = jnp.stack(terms)
    if axis_name is not None:
        sums = lax.psum(sums, axis_name)

    sum_exp, target_logit = sums[0], sums[1]
    log_sum_exp = jnp.log(sum_exp)
    if masked:
        normaliser = global_maxima[1] + jnp.log(sums[-1])
    else:
        normaliser = global_max + log_sum_exp
    log_prob = target_logit - normaliser
    if masked:
        # A kept set that is the target alone (to fp32: the target is the kept maximum
        # and the kept sum is exactly 1): log_prob is 0 for all nearby logits, so its
        # gradient is 0. The kernels fold such a target into the forward's sum as exactly
        # 1 but recompute its 2^d in the backward, where d rounds to ~|x| * 2^-24 rather
        # than 0, which left |g| ~ |x| 2^-24 |g_lp| / tau where 0 is exact; other kept
        # logits that round away from a sum of 1 weigh < 2^-24.
        point_mass = (target_logit == global_maxima[1]) & (sums[-1] == 1.0)
        log_prob = jnp.where(point_mass, lax.stop_gradient(log_prob), log_prob)
    log_prob = jnp.where(targets_valid, log_prob, jnp.nan)

    entropy = None
    if with_entropy:
        # H = LSE - E_p[x] = log S - E_p[x - M]
        entropy = log_sum_exp - sums[2] / sum_exp
        if not entropy_grad:
            entropy = lax.stop_gradient(entropy)
    return log_prob, entropy


def shard_targets(targets: jax.Array, num_vocab: int, axis_name=None):
    """(targets_valid [T] bool, local_targets [T] int32) for this shard of `num_vocab`
    columns: validity against the global vocabulary (R * V_loc with `axis_name`), and the
    ids relative to this shard's first column (out of [0, V_loc) when elsewhere)."""
    if axis_name is None:
        vocab_start, total_vocab = 0, num_vocab
    else:
        vocab_start = lax.axis_index(axis_name) * num_vocab
        total_vocab = lax.axis_size(axis_name) * num_vocab
    valid = (targets >= 0) & (targets < total_vocab)
    return valid, targets.astype(jnp.int32) - vocab_start


def unflatten(log_prob, entropy, lead_shape):
    """`[T]` outputs back to the caller's leading shape (entropy may be None)."""
    return (jnp.reshape(log_prob, lead_shape),
            None if entropy is None else jnp.reshape(entropy, lead_shape))

