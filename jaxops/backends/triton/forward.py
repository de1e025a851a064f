"""Pallas GPU kernels (Triton lowering): the statistics kernel and `forward_stats`; the
design notes below hold for the gradient kernel (`backward.py`) too.

One program per row. The forward streams the row's vocabulary in tiles of
`block_v` and keeps online-softmax accumulators (docs/design.md §3); the backward
recomputes exp(x - m) from the saved row maxima and writes the gradient once,
in the logits' dtype. On CPU the same kernels run with `interpret=True`. The
statistics and the gradient formula are the contract of `contract.py`; the launch
parameters are `config.PallasConfig`.

Lowering constraints (Triton): every array value has a power-of-two size, so
the vocabulary is walked in power-of-two tiles; full tiles are loaded without
a bounds mask and only the last, partial tile is masked.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxops.backends.triton.common import (EXCLUDED, LN2, LOG2E, matrix_spec,
                                           neg_reference, online_update,
                                           require_safe_indexing, row_spec, stream_tiles,
                                           tile_loader, triton_compiler_params, widen)
from jaxops.backends.triton.config import PallasConfig, with_tuned_defaults
from jaxops.contract import NEG, LocalStats, varying_struct


# The masked sum shares the row's exponentials (its reference point `masked_max` is
# then the row max, see `LocalStats`) unless the kept mass relative to the max is
# below this; then kept logits may sit so far below the max that their 2^d flush to
# zero, and the row takes a second, exact pass whose reference is the kept max.
# Above it, anything flushed (< 2^-126) is < 2^-48 of the sum.
_SHARED_MASKED_MIN = 2.0 ** -60


def _forward_kernel(targets_ref, logits_ref, *refs, num_vocab, inv_tau, with_entropy,
                    masked, config):
    block_v = config.block_v
    if masked:
        mask_ref, *out_refs = refs
    else:
        mask_ref, out_refs = None, list(refs)
    target = targets_ref[...]
    on_shard = (target >= 0) & (target < num_vocab)
    safe_target = jnp.where(on_shard, target, 0)
    zeros = jnp.zeros(() if config.scalar_sums else (block_v,), jnp.float32)
    neg = jnp.float32(NEG)

    load = tile_loader(logits_ref, mask_ref, block_v, num_vocab)

    def fold(start, bounded, tile, acc):
        stored, keep = tile
        row_max, sum_vec, shifted_vec, masked_vec, kept_count = acc
        row_max, sum_vec, shifted_vec, masked_vec = online_update(
            row_max, sum_vec, shifted_vec, masked_vec, widen(stored), keep, inv_tau, config)
        if masked:
            # Per lane; the row's count tells a kept set of the target alone (below).
            kept_count = kept_count + keep.astype(jnp.int32)
        return row_max, sum_vec, shifted_vec, masked_vec, kept_count

    def stream(fold, acc):
        return stream_tiles(load, fold, acc, num_vocab=num_vocab, block_v=block_v,
                             prefetch=config.prefetch)

    acc = (neg, zeros, zeros if with_entropy else None,
           zeros if masked else None,
           jnp.zeros((block_v,), jnp.int32) if masked else None)
    row_max, sum_vec, shifted_vec, masked_vec, kept_count = stream(fold, acc)

    empty = row_max <= NEG  # no finite logit in this row
    max_x = jnp.where(empty, -jnp.inf, row_max * inv_tau)
    raw_target = logits_ref[safe_target].astype(jnp.float32)
    max_ref, sum_ref, *out_refs = out_refs
    max_ref[...] = max_x
    sum_ref[...] = jnp.where(empty, 0.0, jnp.sum(sum_vec))
    if with_entropy:
        shifted_ref, *out_refs = out_refs
        shifted_ref[...] = jnp.where(empty, 0.0, jnp.sum(shifted_vec) * LN2)
    target_ref, *out_refs = out_refs
    target_ref[...] = jnp.where(on_shard, raw_target * inv_tau, 0.0)
    if not masked:
        return

    # The target always counts as kept; add it here if its mask bit is off.
    target_bit = mask_ref[safe_target]
    target_alone = on_shard & jnp.logical_not(target_bit)
    kept_total = jnp.sum(kept_count)
    target_exp = jnp.exp2(jnp.maximum(raw_target, EXCLUDED) * (inv_tau * LOG2E)
                          + neg_reference(row_max * inv_tau))
    shared_sum = jnp.sum(masked_vec) + jnp.where(target_alone, target_exp, 0.0)
    anything_kept = (kept_total > 0) | on_shard

    def exact_pass():
        def fold_kept(start, bounded, tile, acc):
            stored, keep = tile
            kept_max, kept_vec = acc
            kept_max, kept_vec, _, _ = online_update(
                kept_max, kept_vec, None, None, jnp.where(keep, widen(stored), EXCLUDED),
                None, inv_tau, config)
            return kept_max, kept_vec

        kept_max, kept_vec = stream(fold_kept, (neg, zeros))
        # Fold in the target if it was not kept by the mask (exact, scalar).
        target_raw = jnp.where(target_alone, jnp.maximum(raw_target, EXCLUDED), EXCLUDED)
        new_max = jnp.maximum(kept_max, target_raw)
        total = (jnp.sum(kept_vec) * jnp.exp2((kept_max - new_max) * (inv_tau * LOG2E))
                 + jnp.where(target_alone, jnp.exp2((target_raw - new_max) * (inv_tau * LOG2E)), 0.0))
        return jnp.where(new_max <= NEG, -jnp.inf, new_max * inv_tau), jnp.where(new_max <= NEG, 0.0, total)

    def shared_result():  # masked_max = the row max, the reference of the shared sum
        return (jnp.where(anything_kept & ~empty, max_x, -jnp.inf),
                jnp.where(anything_kept & ~empty, shared_sum, 0.0))

    # Where the kept set is the target alone (the mask keeps nothing, or only the
    # target's own bit), its own logit is the reference and its 2^0 = 1 the sum, exactly
    # (no second pass). Relative to the row max instead, the sum is the target's 2^d,
    # which the backward's 2^d need not match to the bit (the CPU's scalar and vector
    # ones did not), and `combine` could not see the point mass (it zeroes its
    # gradient where the target is the kept maximum and the kept sum is 1).
    # (No jnp.where of int constants here: the Triton lowering rejects its i1/i64 select.)
    alone = ((target_alone & (kept_total == 0))
             | (on_shard & target_bit & (kept_total == 1)))
    alone_max = jnp.maximum(neg, jnp.maximum(raw_target, EXCLUDED))
    needs_exact = anything_kept & ~empty & ~alone & (shared_sum < _SHARED_MASKED_MIN)
    masked_max, masked_sum = lax.cond(needs_exact, exact_pass, shared_result)
    masked_max = jnp.where(alone, jnp.where(alone_max <= NEG, -jnp.inf, alone_max * inv_tau),
                           masked_max)
    # 0 or 1 as a conversion, not where(.., 0.0, 1.0): with x64 off, JAX's Triton
    # lowering emitted those two literals as i1 constants (invalid IR; jax 0.10-0.11).
    masked_sum = jnp.where(alone, (alone_max > NEG).astype(jnp.float32), masked_sum)
    masked_max_ref, masked_sum_ref = out_refs
    masked_max_ref[...] = masked_max
    masked_sum_ref[...] = masked_sum


def forward_stats(logits, local_targets, keep_mask, *, inv_tau, with_entropy,
                  config: PallasConfig = PallasConfig()) -> LocalStats:
    require_safe_indexing(config, logits, keep_mask)
    num_tokens, num_vocab = logits.shape
    masked = keep_mask is not None
    config = with_tuned_defaults(config, num_vocab, masked=masked,
                                 itemsize=logits.dtype.itemsize, with_entropy=with_entropy)
    row = varying_struct((num_tokens,), jnp.float32, logits, local_targets, keep_mask)
    num_out = 3 + with_entropy + 2 * masked
    kernel = functools.partial(
        _forward_kernel, num_vocab=num_vocab, inv_tau=float(inv_tau),
        with_entropy=with_entropy, masked=masked, config=config)
    inputs = [local_targets.astype(jnp.int32), logits] + ([keep_mask] if masked else [])
    in_specs = [row_spec(), matrix_spec(num_vocab)] + ([matrix_spec(num_vocab)] if masked else [])
    outs = pl.pallas_call(
        kernel,
        out_shape=[row] * num_out,
        grid=(num_tokens,),
        in_specs=in_specs,
        out_specs=[row_spec()] * num_out,
        compiler_params=triton_compiler_params(config),
        interpret=config.interpret,
        debug=config.debug,
        name="logprob_entropy_fwd",
    )(*inputs)
    outs = list(outs)
    row_max, sum_exp = outs.pop(0), outs.pop(0)
    sum_exp_shifted = outs.pop(0) if with_entropy else None
    target_logit = outs.pop(0)
    masked_max, masked_sum_exp = (outs if masked else (None, None))
    return LocalStats(row_max, sum_exp, sum_exp_shifted, target_logit,
                      masked_max, masked_sum_exp)
