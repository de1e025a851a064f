"""The "xla" implementation of the shard statistics, in fused `jnp`: the CPU path and the
fallback where Pallas cannot run.

Same contract as `backends/triton/kernels.py` (see `contract.py`); XLA fuses each function into
a few reductions over the logits (forward) and one elementwise pass (backward).
`masked_max` is always the kept maximum here, and the backward always computes
exp(x - masked_max) on its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxops.contract import NEG, BackwardCoefs, LocalStats


def _scaled(logits: jax.Array, inv_tau: float) -> jax.Array:
    return jnp.maximum(logits.astype(jnp.float32) * inv_tau, NEG)


def _kept(keep_mask, local_targets, num_vocab):
    onehot = jnp.arange(num_vocab, dtype=jnp.int32)[None, :] == local_targets[:, None]
    return onehot, (None if keep_mask is None else keep_mask | onehot)


def _finite_or_zero(row_max: jax.Array) -> jax.Array:
    # A row with no finite logit has max -inf; any finite reference point
    # works there and keeps exp(x - m) free of inf - inf.
    return jnp.where(jnp.isfinite(row_max), row_max, 0.0)


def _row_max_and_exp(x, weights_mask=None):
    """Row max (-inf for rows with nothing above NEG), x - max and exp(x - max)."""
    if weights_mask is not None:
        x = jnp.where(weights_mask, x, NEG)
    row_max = jnp.max(x, axis=-1)
    shifted = x - row_max[:, None]
    exp_shifted = jnp.exp(shifted)
    empty = row_max <= NEG
    return jnp.where(empty, -jnp.inf, row_max), empty, shifted, exp_shifted


def forward_stats(logits, local_targets, keep_mask, *, inv_tau, with_entropy,
                  config=None) -> LocalStats:
    del config  # nothing to configure
    num_vocab = logits.shape[-1]
    x = _scaled(logits, inv_tau)
    row_max, empty, shifted, exp_shifted = _row_max_and_exp(x)
    sum_exp = jnp.where(empty, 0.0, jnp.sum(exp_shifted, axis=-1))
    sum_exp_shifted = None
    if with_entropy:
        sum_exp_shifted = jnp.where(empty, 0.0, jnp.sum(exp_shifted * shifted, axis=-1))

    on_shard = (local_targets >= 0) & (local_targets < num_vocab)
    safe_targets = jnp.where(on_shard, local_targets, 0)
    # The raw (unclamped) target logit, so that a -inf target gives log_prob -inf.
    raw_target = jnp.take_along_axis(logits, safe_targets[:, None], axis=-1)[:, 0]
    target_logit = jnp.where(on_shard, raw_target.astype(jnp.float32) * inv_tau, 0.0)

    masked_max = masked_sum_exp = None
    if keep_mask is not None:
        _, kept = _kept(keep_mask, local_targets, num_vocab)
        masked_max, masked_empty, _, masked_exp = _row_max_and_exp(x, kept)
        masked_sum_exp = jnp.where(
            masked_empty, 0.0, jnp.sum(jnp.where(kept, masked_exp, 0.0), axis=-1))
    return LocalStats(row_max, sum_exp, sum_exp_shifted, target_logit,
                      masked_max, masked_sum_exp)


def backward_logits(logits, local_targets, keep_mask, max_logit, masked_max,
                    coefs: BackwardCoefs, *, inv_tau, config=None, out_dtype=None) -> jax.Array:
    del config  # nothing to configure
    num_vocab = logits.shape[-1]
    x = _scaled(logits, inv_tau)
    shifted = x - _finite_or_zero(max_logit)[:, None]
    scale = coefs.coef_sum[:, None]
    if coefs.coef_shifted is not None:
        scale = scale + coefs.coef_shifted[:, None] * shifted
    dx = jnp.exp(shifted) * scale
    onehot, kept = _kept(keep_mask, local_targets, num_vocab)
    dx = dx + jnp.where(onehot, coefs.coef_target[:, None], 0.0)
    if kept is not None:
        masked_exp = jnp.exp(x - _finite_or_zero(masked_max)[:, None])
        dx = dx + jnp.where(kept, masked_exp * coefs.coef_masked[:, None], 0.0)
    return (dx * inv_tau).astype(out_dtype or logits.dtype)
