"""The JAX side of the bridge: one jitted function per static configuration.

Each function closes over everything static (shard index, temperature, flags,
implementation, launch config), so a call is a plain `jit` dispatch on arrays -- the
C++ fast path, no hashing of Python objects, no retracing. They are called on row
windows (`_windows.py`), so the shapes they see are `[b, V_loc]` for a few window
sizes b: each function compiles once per window size, never per T.

Targets arrive as torch stores them. int64 ids are passed as their raw bytes,
viewed as int32 pairs by torch (no copy, no JAX x64 conversion), and decoded
here as the direct route's kernels decode them (`jaxops.contract.ids_from_words`):
an id outside [0, 2**31) becomes -1 (out of range, so that row's log-prob is NaN
rather than a wrapped-around id).

Packed layouts (float32): `outputs [n_out, b]` = log_prob and, with entropy, entropy;
`stats [K, b]` = this shard's statistics (`staged.num_packed`); the backward's
incoming gradients arrive token-major, `d_out [b, n]` (d log_prob and/or d entropy),
so that a window of them is a contiguous slice of torch's `[T, n]` tensor.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from bridge import _launch
from jaxops import staged
from jaxops.contract import ids_from_words


def decode_targets(raw, mode: str):
    if mode == "i32":
        return raw
    pairs = raw.reshape(-1, 2)  # little-endian int64 -> (low, high) int32 words
    return ids_from_words(pairs[:, 0], pairs[:, 1])


_JITTED: list = []  # every jitted function a `cached` factory made, for compiled_programs()


def cached(make):
    """lru_cache for the factories of jitted functions (here and in `_linear_jaxfns.py`),
    remembering each function made so that `compiled_programs` counts its programs."""
    @functools.lru_cache(maxsize=None)
    @functools.wraps(make)
    def factory(**static):
        fn = make(**static)
        _JITTED.append(fn)
        return fn

    return factory


def compiled_programs() -> int:
    """How many programs JAX has compiled for the bridge so far (all configurations),
    the direct route's kernels included."""
    return sum(fn._cache_size() for fn in _JITTED) + _launch.compiled_launchers()


def pack_outputs(log_prob, entropy):
    """log_prob [b] and entropy [b] or None -> outputs [n_out, b]."""
    return jnp.stack([log_prob] + ([entropy] if entropy is not None else []))


@cached
def local_forward(*, shard_index, world, inv_tau, with_entropy, masked, implementation, config,
                  target_mode):
    """world == 1: (outputs [n_out, b], stats [1, K, b]); else this shard's stats [K, b]."""

    def fn(logits, raw_targets, keep_mask):
        targets = decode_targets(raw_targets, target_mode)
        packed = staged.local_forward(
            logits, targets, keep_mask if masked else None, shard_index, inv_tau=inv_tau,
            with_entropy=with_entropy, implementation=implementation, config=config)
        if world > 1:
            return packed
        gathered = packed[None]
        log_prob, entropy = staged.combine_gathered(
            gathered, targets, num_vocab=logits.shape[-1], with_entropy=with_entropy,
            masked=masked)
        return pack_outputs(log_prob, entropy), gathered

    return jax.jit(fn)


@cached
def combine(*, num_vocab, with_entropy, masked, target_mode):
    """All shards' stats [R, K, b] -> outputs [n_out, b]."""

    def fn(gathered, raw_targets):
        return pack_outputs(*staged.combine_gathered(
            gathered, decode_targets(raw_targets, target_mode), num_vocab=num_vocab,
            with_entropy=with_entropy, masked=masked))

    return jax.jit(fn)


@cached
def local_backward(*, shard_index, inv_tau, with_entropy, entropy_grad, masked, has_d_log_prob,
                   has_d_entropy, implementation, config, target_mode, write_through):
    """d loss / d logits of this shard, no collective.

    write_through: fn(..., into) stores the gradient into `into` (torch's tensor) and
    returns a [b] array that is ready when it is written; else fn(...) returns it."""

    def fn(logits, raw_targets, keep_mask, gathered, d_out, into=None):
        targets = decode_targets(raw_targets, target_mode)
        d_log_prob = d_out[:, 0] if has_d_log_prob else jnp.zeros(targets.shape, jnp.float32)
        d_entropy = d_out[:, -1] if has_d_entropy else None
        return staged.local_backward(
            logits, targets, keep_mask if masked else None, gathered, shard_index,
            d_log_prob, d_entropy, inv_tau=inv_tau,
            with_entropy=with_entropy, entropy_grad=entropy_grad, implementation=implementation,
            config=config, into=into if write_through else None)

    return jax.jit(fn)
