"""The op split at its one collective, for callers that run their own (the PyTorch bridge).

    packed = local_forward(logits, targets, ...)           # this shard: [K, T] float32
    gathered = <all-gather packed over the vocab shards>   # [R, K, T], ranks in vocab order
    log_prob, entropy = combine_gathered(gathered, targets, ...)
    dlogits = local_backward(logits, targets, gathered, shard_index, d_log_prob, d_entropy, ...)

`combine_gathered` is the same algebra as `combine.combine` with the shard
reductions done over the leading axis, so every rank computes identical outputs.
`local_backward` needs no collective: the cotangent of this shard's statistics is
the VJP of `combine_gathered` with respect to its own row of `gathered`.

All functions are pure JAX and jit-compiled here; `targets` are global ids,
`shard_index * V_loc` is this shard's first column. `implementation` ("pallas" or
"xla") and `config` are as `jaxops.backends.registry.resolve` returns them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxops.backends import registry
from jaxops.backends.triton.config import PallasConfig
from jaxops.combine import combine
from jaxops.contract import LocalStats, backward_coefs, present_fields


def num_packed(with_entropy: bool, masked: bool) -> int:
    """K, the number of float32 rows `local_forward` packs per token."""
    return len(present_fields(with_entropy, masked))


def pack_stats(stats: LocalStats, with_entropy, masked) -> jax.Array:
    """LocalStats of `[T]` fields -> `[K, T]` float32, in `contract.present_fields` order."""
    return jnp.stack([getattr(stats, f) for f in present_fields(with_entropy, masked)])


def unpack_stats(packed: jax.Array, with_entropy, masked) -> LocalStats:
    """`[..., K, T]` -> LocalStats of `[..., T]` fields."""
    values = {f: packed[..., i, :] for i, f in enumerate(present_fields(with_entropy, masked))}
    return LocalStats(**{f: values.get(f) for f in LocalStats._fields})


def shard_local_targets(targets, shard_index, num_vocab):
    """Global target ids `[T]` -> indices into shard `shard_index`'s V_loc = `num_vocab`
    columns (out of [0, V_loc): the target is on another shard)."""
    return targets.astype(jnp.int32) - shard_index * num_vocab


@functools.partial(
    jax.jit, static_argnames=("inv_tau", "with_entropy", "implementation", "config"))
def local_forward(logits, targets, keep_mask, shard_index, *, inv_tau, with_entropy,
                  implementation: str, config: PallasConfig | None = None) -> jax.Array:
    """This shard's statistics of `logits [T, V_loc]`, packed as `[K, T]` float32."""
    stats = registry.kernels(implementation).forward_stats(
        logits, shard_local_targets(targets, shard_index, logits.shape[-1]), keep_mask,
        inv_tau=inv_tau, with_entropy=with_entropy, config=config)
    return pack_stats(stats, with_entropy, keep_mask is not None)


def _combine_stack(gathered: jax.Array, targets, total_vocab, with_entropy, masked,
                   entropy_grad=True):
    """combine() with shards stacked on axis 0 instead of a mesh axis."""
    stats = unpack_stats(gathered, with_entropy, masked)  # each field [R, T]
    valid = (targets >= 0) & (targets < total_vocab)
    # vmap over shards turns the named-axis collectives into reductions over axis 0.
    log_prob, entropy = jax.vmap(
        lambda s: combine(s, valid, entropy_grad=entropy_grad, axis_name="shards"),
        axis_name="shards")(stats)
    return log_prob[0], (None if entropy is None else entropy[0])


@functools.partial(jax.jit, static_argnames=("num_vocab", "with_entropy", "masked"))
def combine_gathered(gathered, targets, *, num_vocab, with_entropy, masked):
    """(log_prob [T], entropy [T] or None) from all shards' packed stats `[R, K, T]`."""
    return _combine_stack(gathered, targets, num_vocab * gathered.shape[0], with_entropy, masked)


def shard_cotangents(gathered, targets, shard_index, d_log_prob, d_entropy, *, num_vocab,
                     with_entropy, entropy_grad, masked):
    """(this shard's LocalStats, its BackwardCoefs) from every shard's statistics
    `gathered [R, K, T]` and the incoming `d_log_prob [T]` (None: zero) and `d_entropy`
    (None: zero): the VJP of the combine with respect to this shard's own row of
    `gathered` -- no collective, every shard holds all rows."""
    total_vocab = num_vocab * gathered.shape[0]

    def outputs(own):
        stacked = gathered.at[shard_index].set(own)
        return _combine_stack(stacked, targets, total_vocab, with_entropy, masked, entropy_grad)

    _, vjp = jax.vjp(outputs, gathered[shard_index])
    if d_log_prob is None:
        d_log_prob = jnp.zeros(targets.shape, jnp.float32)
    if with_entropy and d_entropy is None:
        d_entropy = jnp.zeros_like(d_log_prob)
    (d_packed,) = vjp((d_log_prob, d_entropy if with_entropy else None))
    coefs = backward_coefs(unpack_stats(d_packed, with_entropy, masked),
                           with_entropy and entropy_grad, masked)
    return unpack_stats(gathered[shard_index], with_entropy, masked), coefs


@functools.partial(
    jax.jit,
    static_argnames=("inv_tau", "with_entropy", "entropy_grad", "implementation", "config"))
def local_backward(logits, targets, keep_mask, gathered, shard_index, d_log_prob, d_entropy,
                   *, inv_tau, with_entropy, entropy_grad, implementation: str,
                   config: PallasConfig | None = None, into=None) -> jax.Array:
    """d loss / d logits `[T, V_loc]` (logits' dtype) for this shard, no collective.

    `into`: Pallas only -- a `[T, V_loc]` buffer the kernel writes the gradient into;
    then the result is a `[T]` array that is ready once it is written (see
    `triton.kernels.backward_logits`)."""
    num_vocab = logits.shape[-1]
    own, coefs = shard_cotangents(gathered, targets, shard_index, d_log_prob, d_entropy,
                                  num_vocab=num_vocab, with_entropy=with_entropy,
                                  entropy_grad=entropy_grad, masked=keep_mask is not None)
    extra = {} if into is None else {"into": into}
    return registry.kernels(implementation).backward_logits(
        logits, shard_local_targets(targets, shard_index, num_vocab), keep_mask,
        own.max_logit, own.masked_max, coefs, inv_tau=inv_tau, config=config, **extra)
