"""Pallas GPU kernels (Triton lowering) for the shard statistics and their gradient.

One program per row. The forward streams the row's vocabulary in tiles of
`block_v` and keeps online-softmax accumulators (SPEC §3); the backward
recomputes exp(x - m) from the saved row maxima and writes the gradient once,
in the logits' dtype. On CPU the same kernels run with `interpret=True`.

Lowering constraints (Triton): every array value has a power-of-two size, so
the vocabulary is walked in power-of-two tiles; full tiles are loaded without
a bounds mask and only the last, partial tile is masked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxops.stats import NEG, BackwardCoefs, LocalStats


@dataclasses.dataclass(frozen=True)
class PallasConfig:
    """Launch parameters. `None` fields are chosen from the dtype."""

    block_v: int | None = None  # vocabulary tile, a power of two
    num_warps: int | None = None
    num_stages: int | None = None
    interpret: bool = False


def _resolve(config: PallasConfig, dtype, num_vocab: int) -> PallasConfig:
    itemsize = jnp.dtype(dtype).itemsize
    block_v = config.block_v or (4096 if itemsize >= 4 else 8192)
    block_v = min(block_v, pl.next_power_of_2(max(num_vocab, 16)))
    if block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    return dataclasses.replace(
        config,
        block_v=block_v,
        num_warps=config.num_warps or 8,
        num_stages=config.num_stages or 2,
    )


def _tiles(num_vocab: int, block_v: int):
    """(number of full tiles, size of the partial tail tile or 0)."""
    return num_vocab // block_v, num_vocab % block_v


def _load_scaled(ref, start, block_v, num_vocab, inv_tau, bounded: bool):
    """Tile of x = logits * inv_tau in fp32, clamped at NEG (-inf and padding -> NEG)."""
    cols = start + jnp.arange(block_v, dtype=jnp.int32)
    if bounded:
        raw = plt.load(ref.at[cols], mask=cols < num_vocab, other=-jnp.inf)
    else:
        raw = plt.load(ref.at[cols])
    return cols, jnp.maximum(raw.astype(jnp.float32) * inv_tau, NEG)


def _load_kept(mask_ref, cols, target, num_vocab, bounded: bool):
    if bounded:
        keep = plt.load(mask_ref.at[cols], mask=cols < num_vocab, other=False)
    else:
        keep = plt.load(mask_ref.at[cols])
    return keep | (cols == target)


def _online_update(row_max, sum_vec, shifted_vec, x):
    """Fold one tile into (scalar max, per-lane sum exp, per-lane sum exp * shift)."""
    new_max = jnp.maximum(row_max, jnp.max(x))
    rescale = jnp.exp(row_max - new_max)
    shift = x - new_max
    exp_shift = jnp.exp(shift)
    if shifted_vec is not None:
        # Re-reference the old sum_j e^(x_j - m_old)(x_j - m_old) to the new max.
        shifted_vec = rescale * (shifted_vec + (row_max - new_max) * sum_vec) + exp_shift * shift
    sum_vec = sum_vec * rescale + exp_shift
    return new_max, sum_vec, shifted_vec


def _forward_kernel(targets_ref, logits_ref, *refs, num_vocab, block_v, inv_tau,
                    with_entropy, masked):
    if masked:
        mask_ref, *out_refs = refs
    else:
        mask_ref, out_refs = None, list(refs)
    target = targets_ref[...]
    zeros = jnp.zeros((block_v,), jnp.float32)
    neg = jnp.float32(NEG)

    def fold(start, carry, bounded):
        row_max, sum_vec, shifted_vec, masked_max, masked_vec = carry
        cols, x = _load_scaled(logits_ref, start, block_v, num_vocab, inv_tau, bounded)
        row_max, sum_vec, shifted_vec = _online_update(row_max, sum_vec, shifted_vec, x)
        if masked:
            kept = _load_kept(mask_ref, cols, target, num_vocab, bounded)
            masked_max, masked_vec, _ = _online_update(
                masked_max, masked_vec, None, jnp.where(kept, x, NEG))
        return row_max, sum_vec, shifted_vec, masked_max, masked_vec

    carry = (neg, zeros, zeros if with_entropy else None,
             neg if masked else None, zeros if masked else None)
    num_full, tail = _tiles(num_vocab, block_v)
    carry = lax.fori_loop(
        0, num_full,
        lambda i, c: fold(pl.multiple_of(i * block_v, block_v), c, False), carry)
    if tail:
        carry = fold(num_full * block_v, carry, True)
    row_max, sum_vec, shifted_vec, masked_max, masked_vec = carry

    # A row with nothing above NEG (all -inf) counted each element as exp(0).
    empty = row_max <= NEG
    max_ref, sum_ref, *out_refs = out_refs
    max_ref[...] = jnp.where(empty, -jnp.inf, row_max)
    sum_ref[...] = jnp.where(empty, 0.0, jnp.sum(sum_vec))
    if with_entropy:
        shifted_ref, *out_refs = out_refs
        shifted_ref[...] = jnp.where(empty, 0.0, jnp.sum(shifted_vec))
    target_ref, *out_refs = out_refs
    on_shard = (target >= 0) & (target < num_vocab)
    raw_target = logits_ref[jnp.where(on_shard, target, 0)].astype(jnp.float32)
    target_ref[...] = jnp.where(on_shard, raw_target * inv_tau, 0.0)
    if masked:
        masked_max_ref, masked_sum_ref = out_refs
        masked_empty = masked_max <= NEG
        masked_max_ref[...] = jnp.where(masked_empty, -jnp.inf, masked_max)
        masked_sum_ref[...] = jnp.where(masked_empty, 0.0, jnp.sum(masked_vec))


def _row_spec():
    return pl.BlockSpec((None,), lambda i: (i,))


def _matrix_spec(num_vocab):
    return pl.BlockSpec((None, num_vocab), lambda i: (i, 0))


def _compiler_params(config: PallasConfig):
    return plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)


def forward_stats(logits, local_targets, keep_mask, *, inv_tau, with_entropy,
                  config: PallasConfig = PallasConfig()) -> LocalStats:
    num_tokens, num_vocab = logits.shape
    config = _resolve(config, logits.dtype, num_vocab)
    masked = keep_mask is not None
    row = jax.ShapeDtypeStruct((num_tokens,), jnp.float32)
    num_out = 3 + with_entropy + 2 * masked
    kernel = functools.partial(
        _forward_kernel, num_vocab=num_vocab, block_v=config.block_v,
        inv_tau=float(inv_tau), with_entropy=with_entropy, masked=masked)
    inputs = [local_targets.astype(jnp.int32), logits] + ([keep_mask] if masked else [])
    in_specs = [_row_spec(), _matrix_spec(num_vocab)] + ([_matrix_spec(num_vocab)] if masked else [])
    outs = pl.pallas_call(
        kernel,
        out_shape=[row] * num_out,
        grid=(num_tokens,),
        in_specs=in_specs,
        out_specs=[_row_spec()] * num_out,
        compiler_params=_compiler_params(config),
        interpret=config.interpret,
        name="logprob_entropy_fwd",
    )(*inputs)
    outs = list(outs)
    row_max, sum_exp = outs.pop(0), outs.pop(0)
    sum_exp_shifted = outs.pop(0) if with_entropy else None
    target_logit = outs.pop(0)
    masked_max, masked_sum_exp = (outs if masked else (None, None))
    return LocalStats(row_max, sum_exp, sum_exp_shifted, target_logit,
                      masked_max, masked_sum_exp)


def _backward_kernel(*refs, num_vocab, block_v, inv_tau, entropy, masked):
    refs = list(refs)
    target = refs.pop(0)[...]
    row_max = refs.pop(0)[...]
    # inv_tau is folded into the per-row coefficients: d logits = d x * inv_tau.
    coef_sum = refs.pop(0)[...] * inv_tau
    coef_shifted = refs.pop(0)[...] * inv_tau if entropy else None
    coef_target = refs.pop(0)[...] * inv_tau
    if masked:
        masked_max = refs.pop(0)[...]
        coef_masked = refs.pop(0)[...] * inv_tau
    logits_ref = refs.pop(0)
    mask_ref = refs.pop(0) if masked else None
    (dlogits_ref,) = refs

    # Rows whose max is -inf have no finite logit: any finite reference works.
    row_max = jnp.where(row_max > NEG, row_max, 0.0)
    if masked:
        masked_max = jnp.where(masked_max > NEG, masked_max, 0.0)

    def tile(start, bounded):
        cols, x = _load_scaled(logits_ref, start, block_v, num_vocab, inv_tau, bounded)
        shift = x - row_max
        scale = coef_sum + coef_shifted * shift if entropy else coef_sum
        dx = jnp.exp(shift) * scale
        onehot = cols == target
        dx = dx + jnp.where(onehot, coef_target, 0.0)
        if masked:
            kept = _load_kept(mask_ref, cols, target, num_vocab, bounded)
            dx = dx + jnp.where(kept, jnp.exp(x - masked_max) * coef_masked, 0.0)
        dx = dx.astype(dlogits_ref.dtype)
        if bounded:
            plt.store(dlogits_ref.at[cols], dx, mask=cols < num_vocab)
        else:
            plt.store(dlogits_ref.at[cols], dx)

    num_full, tail = _tiles(num_vocab, block_v)

    @pl.loop(0, num_full)
    def _(i):
        tile(pl.multiple_of(i * block_v, block_v), False)

    if tail:
        tile(num_full * block_v, True)


def backward_logits(logits, local_targets, keep_mask, max_logit, masked_max,
                    coefs: BackwardCoefs, *, inv_tau,
                    config: PallasConfig = PallasConfig()) -> jax.Array:
    num_tokens, num_vocab = logits.shape
    config = _resolve(config, logits.dtype, num_vocab)
    masked = keep_mask is not None
    entropy = coefs.coef_shifted is not None
    rows = [local_targets.astype(jnp.int32), max_logit, coefs.coef_sum]
    rows += [coefs.coef_shifted] if entropy else []
    rows += [coefs.coef_target]
    rows += [masked_max, coefs.coef_masked] if masked else []
    matrices = [logits] + ([keep_mask] if masked else [])
    kernel = functools.partial(
        _backward_kernel, num_vocab=num_vocab, block_v=config.block_v,
        inv_tau=float(inv_tau), entropy=entropy, masked=masked)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(logits.shape, logits.dtype),
        grid=(num_tokens,),
        in_specs=[_row_spec()] * len(rows) + [_matrix_spec(num_vocab)] * len(matrices),
        out_specs=_matrix_spec(num_vocab),
        compiler_params=_compiler_params(config),
        interpret=config.interpret,
        name="logprob_entropy_bwd",
    )(*rows, *matrices)
