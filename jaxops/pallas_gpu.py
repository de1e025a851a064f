"""Pallas GPU kernels (Triton lowering) for the shard statistics and their gradient.

One program per row. The forward streams the row's vocabulary in tiles of
`block_v` and keeps online-softmax accumulators (docs/design.md §3); the backward
recomputes exp(x - m) from the saved row maxima and writes the gradient once,
in the logits' dtype. On CPU the same kernels run with `interpret=True`. The
statistics and the gradient formula are the contract of `contract.py`; the launch
parameters are `pallas_config.PallasConfig` (re-exported here).

Lowering constraints (Triton): every array value has a power-of-two size, so
the vocabulary is walked in power-of-two tiles; full tiles are loaded without
a bounds mask and only the last, partial tile is masked.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxops import _triton_offsets
from jaxops.contract import (
    NEG,
    BackwardCoefs,
    LocalStats,
    masked_sum_shares_row_reference,
    varying_struct,
)
from jaxops.pallas_config import PallasConfig, with_tuned_defaults

__all__ = ["PallasConfig", "backward_logits", "forward_stats"]  # PallasConfig: re-exported


# Excluded entries (-inf logits, padding, masked-out columns) are clamped to
# _EXCLUDED, strictly below the running max's start value NEG: while a row has
# seen nothing real (max = NEG), their exponent is still ~ -1e30, never ~0, so
# no sum counts them, whatever the rounding of the 1e30-sized FMA.
_EXCLUDED = 2 * NEG
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def _exp2(x, config: PallasConfig):
    # Scalars (once per tile) keep libdevice: the inline-asm lowering wants a block.
    if config.approx_exp2 and not config.interpret and x.ndim > 0:
        [result] = plt.elementwise_inline_asm(
            "ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
        return result
    return jnp.exp2(x)


def _tiles(num_vocab: int, block_v: int):
    """(number of full tiles, size of the partial tail tile or 0)."""
    return num_vocab // block_v, num_vocab % block_v


def _load_tile(ref, start, block_v, num_vocab, bounded: bool):
    """A tile of logits as stored (fp32/bf16/fp16); padding past the shard reads -inf."""
    cols = start + jnp.arange(block_v, dtype=jnp.int32)
    if bounded:
        return plt.load(ref.at[cols], mask=cols < num_vocab, other=-jnp.inf)
    return plt.load(ref.at[cols])


def _tile_loader(logits_ref, mask_ref, block_v, num_vocab):
    """`load(start, bounded) -> (stored logits, keep mask or None)` for `_stream_tiles`."""
    def load(start, bounded):
        stored = _load_tile(logits_ref, start, block_v, num_vocab, bounded)
        keep = (None if mask_ref is None
                else _load_keep(mask_ref, start, block_v, num_vocab, bounded))
        return stored, keep

    return load


def _widen(stored):
    """fp32 logits clamped at _EXCLUDED (-inf and padding -> _EXCLUDED).

    The kernels work on raw logits and apply 1/tau and log2(e) inside one FMA
    per element: exp(x - m) = exp2(raw * (log2e / tau) - m * log2e).
    """
    return jnp.maximum(stored.astype(jnp.float32), _EXCLUDED)


def _load_keep(mask_ref, start, block_v, num_vocab, bounded: bool):
    cols = start + jnp.arange(block_v, dtype=jnp.int32)
    if bounded:
        return plt.load(mask_ref.at[cols], mask=cols < num_vocab, other=False)
    return plt.load(mask_ref.at[cols])


def _stream_tiles(load, fold, acc, *, num_vocab, block_v, prefetch):
    """Fold every tile of a row into `acc`: `load(start, bounded)` reads a tile,
    `fold(start, bounded, tile, acc)` consumes it. Full tiles load without a bounds mask;
    only the last, partial tile is masked.

    With `prefetch`, tile i + 1 is loaded before tile i is folded (the loaded
    tile rides in the loop carry): Triton does not software-pipeline loads that
    feed no dot, and without this a program waits on each tile's HBM latency.
    """
    num_full, tail = _tiles(num_vocab, block_v)

    def start_of(i):
        return pl.multiple_of(i * block_v, block_v)

    if prefetch and num_full > 1:
        def body(i, carry):
            tile, acc = carry
            next_tile = load(start_of(i + 1), False)
            return next_tile, fold(start_of(i), False, tile, acc)

        last, acc = lax.fori_loop(0, num_full - 1, body, (load(0, False), acc))
        if tail:  # issued before the last full tile is folded, for the same reason
            tail_tile = load(num_full * block_v, True)
        # A static start: pl.multiple_of has no lowering for constants.
        acc = fold((num_full - 1) * block_v, False, last, acc)
    else:
        acc = lax.fori_loop(0, num_full,
                            lambda i, a: fold(start_of(i), False, load(start_of(i), False), a),
                            acc)
        if tail:
            tail_tile = load(num_full * block_v, True)
    if tail:
        acc = fold(num_full * block_v, True, tail_tile, acc)
    return acc


def _online_update(row_max, sum_vec, shifted_vec, masked_vec, raw, keep, inv_tau, config):
    """Fold one tile into the row's accumulators.

    Accumulators: the scalar raw max m and per-lane vectors of sum 2^d, sum 2^d d
    and (with `keep`) the kept tokens' sum 2^d, where d = (x - m) * log2(e) for the
    running max m; the vectors are rescaled when m grows. `shifted_vec` and
    `masked_vec` may be None (not tracked). With `config.scalar_sums` the three
    sums are scalars and each tile is reduced before it is added.
    """
    new_max = jnp.maximum(row_max, jnp.max(raw))
    scale = inv_tau * _LOG2E
    d = raw * scale + _neg_reference(new_max * inv_tau)
    exp_d = _exp2(d, config)
    tile_sum = exp_d
    tile_shifted = None if shifted_vec is None else exp_d * d
    tile_kept = None if keep is None else jnp.where(keep, exp_d, 0.0)
    if config.scalar_sums:
        tile_sum, tile_shifted, tile_kept = (
            None if t is None else jnp.sum(t) for t in (tile_sum, tile_shifted, tile_kept))

    def rescaled():
        d_old = (row_max - new_max) * scale
        rescale = _exp2(d_old, config)
        return (sum_vec * rescale + tile_sum,
                None if shifted_vec is None
                else rescale * (shifted_vec + d_old * sum_vec) + tile_shifted,
                None if masked_vec is None else masked_vec * rescale + tile_kept)

    def same_reference():  # rescale would be exactly 1 (d_old = 0)
        return (sum_vec + tile_sum,
                None if shifted_vec is None else shifted_vec + tile_shifted,
                None if masked_vec is None else masked_vec + tile_kept)

    if config.skip_rescale:
        # Uniform per program, and after the first few tiles of a row the max
        # rarely grows: most tiles take the cheaper branch (2 fewer ops per
        # element for the entropy sum, 1 fewer for the masked sum).
        vecs = lax.cond(new_max > row_max, rescaled, same_reference)
    else:
        vecs = rescaled()
    return (new_max, *vecs)


def _neg_reference(max_x):
    """-m * log2(e) for a row max m in units of x; forward and backward share these bits."""
    return -(max_x * _LOG2E)


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

    load = _tile_loader(logits_ref, mask_ref, block_v, num_vocab)

    def fold(start, bounded, tile, acc):
        stored, keep = tile
        row_max, sum_vec, shifted_vec, masked_vec, kept_count = acc
        row_max, sum_vec, shifted_vec, masked_vec = _online_update(
            row_max, sum_vec, shifted_vec, masked_vec, _widen(stored), keep, inv_tau, config)
        if masked:
            # Per lane; the row's count tells a kept set of the target alone (below).
            kept_count = kept_count + keep.astype(jnp.int32)
        return row_max, sum_vec, shifted_vec, masked_vec, kept_count

    def stream(fold, acc):
        return _stream_tiles(load, fold, acc, num_vocab=num_vocab, block_v=block_v,
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
        shifted_ref[...] = jnp.where(empty, 0.0, jnp.sum(shifted_vec) * _LN2)
    target_ref, *out_refs = out_refs
    target_ref[...] = jnp.where(on_shard, raw_target * inv_tau, 0.0)
    if not masked:
        return

    # The target always counts as kept; add it here if its mask bit is off.
    target_bit = mask_ref[safe_target]
    target_alone = on_shard & jnp.logical_not(target_bit)
    kept_total = jnp.sum(kept_count)
    target_exp = jnp.exp2(jnp.maximum(raw_target, _EXCLUDED) * (inv_tau * _LOG2E)
                          + _neg_reference(row_max * inv_tau))
    shared_sum = jnp.sum(masked_vec) + jnp.where(target_alone, target_exp, 0.0)
    anything_kept = (kept_total > 0) | on_shard

    def exact_pass():
        def fold_kept(start, bounded, tile, acc):
            stored, keep = tile
            kept_max, kept_vec = acc
            kept_max, kept_vec, _, _ = _online_update(
                kept_max, kept_vec, None, None, jnp.where(keep, _widen(stored), _EXCLUDED),
                None, inv_tau, config)
            return kept_max, kept_vec

        kept_max, kept_vec = stream(fold_kept, (neg, zeros))
        # Fold in the target if it was not kept by the mask (exact, scalar).
        target_raw = jnp.where(target_alone, jnp.maximum(raw_target, _EXCLUDED), _EXCLUDED)
        new_max = jnp.maximum(kept_max, target_raw)
        total = (jnp.sum(kept_vec) * jnp.exp2((kept_max - new_max) * (inv_tau * _LOG2E))
                 + jnp.where(target_alone, jnp.exp2((target_raw - new_max) * (inv_tau * _LOG2E)), 0.0))
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
    alone_max = jnp.maximum(neg, jnp.maximum(raw_target, _EXCLUDED))
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


def _row_spec():
    return pl.BlockSpec((None,), lambda i: (i,))


def _matrix_spec(num_vocab):
    return pl.BlockSpec((None, num_vocab), lambda i: (i, 0))


def _compiler_params(config: PallasConfig):
    return plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)


def _lowering_indexes_safely(config: PallasConfig, *operands) -> bool:
    """False where the Triton lowering would index an operand with wrapping 32-bit
    offsets (see `_triton_offsets`); interpret mode indexes in XLA, always safely."""
    if config.interpret or _triton_offsets.large_byte_operands_ok(*operands):
        return True
    warnings.warn(
        "This JAX's Pallas Triton lowering indexes bool arrays of 2**31+ elements with "
        "32-bit offsets and jaxops could not correct it; computing this call with the "
        "XLA implementation instead (correct, slower).", RuntimeWarning, stacklevel=3)
    return False


def forward_stats(logits, local_targets, keep_mask, *, inv_tau, with_entropy,
                  config: PallasConfig = PallasConfig()) -> LocalStats:
    if not _lowering_indexes_safely(config, logits, keep_mask):
        from jaxops import xla

        return xla.forward_stats(logits, local_targets, keep_mask, inv_tau=inv_tau,
                                 with_entropy=with_entropy)
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
    in_specs = [_row_spec(), _matrix_spec(num_vocab)] + ([_matrix_spec(num_vocab)] if masked else [])
    outs = pl.pallas_call(
        kernel,
        out_shape=[row] * num_out,
        grid=(num_tokens,),
        in_specs=in_specs,
        out_specs=[_row_spec()] * num_out,
        compiler_params=_compiler_params(config),
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


def _backward_kernel(*refs, num_vocab, inv_tau, entropy, masked, write_through, config):
    block_v = config.block_v
    refs = list(refs)
    target = refs.pop(0)[...]
    row_max = refs.pop(0)[...]
    # inv_tau is folded into the per-row coefficients: d logits = d x * inv_tau.
    coef_sum = refs.pop(0)[...] * inv_tau
    coef_shifted = refs.pop(0)[...] * (inv_tau * _LN2) if entropy else None
    coef_target = refs.pop(0)[...] * inv_tau
    if masked:
        masked_max = refs.pop(0)[...]
        coef_masked = refs.pop(0)[...] * inv_tau
    logits_ref = refs.pop(0)
    mask_ref = refs.pop(0) if masked else None
    if write_through:  # the gradient goes to memory passed in as an input (see backward_logits)
        dlogits_ref, done_ref = refs
        done_ref[...] = jnp.float32(1)
    else:
        (dlogits_ref,) = refs

    scale = inv_tau * _LOG2E
    # Rows whose max is -inf have no finite logit: any finite reference works.
    neg_ref = _neg_reference(jnp.where(row_max > NEG, row_max, 0.0))
    if masked:
        masked_neg_ref = _neg_reference(jnp.where(masked_max > NEG, masked_max, 0.0))

    load = _tile_loader(logits_ref, mask_ref, block_v, num_vocab)

    def write_tile(start, bounded, tile, shared_reference):
        stored, keep = tile
        raw = _widen(stored)
        cols = start + jnp.arange(block_v, dtype=jnp.int32)
        d = raw * scale + neg_ref  # (x - m) * log2(e)
        exp_d = _exp2(d, config)
        coef = coef_sum + coef_shifted * d if entropy else coef_sum
        onehot = cols == target
        if masked:
            kept = keep | onehot
            if shared_reference:  # exp(x - masked_max) is 2^d bit for bit: reuse it
                grad = exp_d * (coef + jnp.where(kept, coef_masked, 0.0))
            else:
                masked_exp = _exp2(raw * scale + masked_neg_ref, config)
                grad = exp_d * coef + jnp.where(kept, masked_exp * coef_masked, 0.0)
        else:
            grad = exp_d * coef
        grad = (grad + jnp.where(onehot, coef_target, 0.0)).astype(dlogits_ref.dtype)
        if bounded:
            plt.store(dlogits_ref.at[cols], grad, mask=cols < num_vocab)
        else:
            plt.store(dlogits_ref.at[cols], grad)

    def sweep(shared_reference):
        def fold(start, bounded, tile, acc):
            write_tile(start, bounded, tile, shared_reference)
            return acc

        _stream_tiles(load, fold, (), num_vocab=num_vocab, block_v=block_v,
                      prefetch=config.prefetch)

    if masked:
        # One exponential per element serves both terms where the masked sum's reference
        # point is the row max (the forward's shared path, or a kept max equal to it);
        # elsewhere (the forward's exact pass) each term takes its own.
        shared = masked_sum_shares_row_reference(row_max, masked_max)
        lax.cond(shared, lambda: sweep(True), lambda: sweep(False))
    else:
        sweep(False)


def can_write_into(logits, keep_mask, config: PallasConfig) -> bool:
    """Whether `backward_logits(..., into=buffer)` can write the gradient into `buffer`:
    only compiled kernels store through their refs to the caller's memory."""
    return not config.interpret and _lowering_indexes_safely(config, logits, keep_mask)


def backward_logits(logits, local_targets, keep_mask, max_logit, masked_max,
                    coefs: BackwardCoefs, *, inv_tau,
                    config: PallasConfig = PallasConfig(), into=None,
                    out_dtype=None) -> jax.Array:
    """d loss / d logits `[T, V_loc]` in the logits' dtype, or in `out_dtype`: the kernel
    rounds its fp32 values once to that dtype as it stores them (the same bits as storing
    fp32 and converting after, without the fp32 array and the pass over it: the fused
    head hands in fp32 logits chunks and wants bf16 d logits for its GEMMs).

    With `into` (a `[T, V_loc]` array of the logits' dtype, e.g. a DLPack view of
    memory another framework allocated), the kernel stores the gradient into that
    buffer instead of allocating one, and returns a `[T]` float32 array of ones that
    is ready when the buffer is written. XLA treats `into` as a read-only input: the
    caller must not read it through JAX afterwards, only through its owner (the
    PyTorch bridge gives JAX the gradient tensor torch allocated). Needs
    `can_write_into(...)`; the interpreter would write into a copy.
    """
    if into is not None:
        if not can_write_into(logits, keep_mask, config):
            raise ValueError("backward_logits(into=...) needs the compiled Pallas kernels")
        if out_dtype is not None and jnp.dtype(out_dtype) != logits.dtype:
            raise ValueError("backward_logits(into=...) writes the logits' dtype")
        if into.shape != logits.shape or into.dtype != logits.dtype:
            raise ValueError(f"into must be {logits.shape} {logits.dtype}, "
                             f"got {into.shape} {into.dtype}")
    if not _lowering_indexes_safely(config, logits, keep_mask):
        from jaxops import xla

        return xla.backward_logits(logits, local_targets, keep_mask, max_logit, masked_max,
                                   coefs, inv_tau=inv_tau, out_dtype=out_dtype)
    num_tokens, num_vocab = logits.shape
    masked = keep_mask is not None
    config = with_tuned_defaults(config, num_vocab, masked=masked,
                                 itemsize=logits.dtype.itemsize, backward=True)
    entropy = coefs.coef_shifted is not None
    rows = [local_targets.astype(jnp.int32), max_logit, coefs.coef_sum]
    rows += [coefs.coef_shifted] if entropy else []
    rows += [coefs.coef_target]
    rows += [masked_max, coefs.coef_masked] if masked else []
    matrices = [logits] + ([keep_mask] if masked else [])
    write_through = into is not None
    kernel = functools.partial(
        _backward_kernel, num_vocab=num_vocab, inv_tau=float(inv_tau),
        entropy=entropy, masked=masked, write_through=write_through, config=config)
    if write_through:
        matrices.append(into)
        out_shape = varying_struct((num_tokens,), jnp.float32, *rows, *matrices)
        out_spec = _row_spec()
    else:
        out_shape = varying_struct(logits.shape, out_dtype or logits.dtype, *rows, *matrices)
        out_spec = _matrix_spec(num_vocab)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_tokens,),
        in_specs=[_row_spec()] * len(rows) + [_matrix_spec(num_vocab)] * len(matrices),
        out_specs=out_spec,
        compiler_params=_compiler_params(config),
        interpret=config.interpret,
        debug=config.debug,
        name="logprob_entropy_bwd",
    )(*rows, *matrices)
