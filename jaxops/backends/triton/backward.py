"""The Triton kernel for d loss / d logits and its launcher (`backward_logits`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxops.backends.triton.common import (LN2, LOG2E, exp2, indexes_safely, matrix_spec,
                                           neg_reference, require_safe_indexing, row_spec,
                                           stream_tiles, tile_loader,
                                           triton_compiler_params, widen)
from jaxops.backends.triton.config import PallasConfig, with_tuned_defaults
from jaxops.contract import (NEG, BackwardCoefs, masked_sum_shares_row_reference,
                             varying_struct)


def _backward_kernel(*refs, num_vocab, inv_tau, entropy, masked, write_through, config):
    block_v = config.block_v
    refs = list(refs)
    target = refs.pop(0)[...]
    row_max = refs.pop(0)[...]
    # inv_tau is folded into the per-row coefficients: d logits = d x * inv_tau.
    coef_sum = refs.pop(0)[...] * inv_tau
    coef_shifted = refs.pop(0)[...] * (inv_tau * LN2) if entropy else None
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

    scale = inv_tau * LOG2E
    # Rows whose max is -inf have no finite logit: any finite reference works.
    neg_ref = neg_reference(jnp.where(row_max > NEG, row_max, 0.0))
    if masked:
        masked_neg_ref = neg_reference(jnp.where(masked_max > NEG, masked_max, 0.0))

    load = tile_loader(logits_ref, mask_ref, block_v, num_vocab)

    def write_tile(start, bounded, tile, shared_reference):
        stored, keep = tile
        raw = widen(stored)
        cols = start + jnp.arange(block_v, dtype=jnp.int32)
        d = raw * scale + neg_ref  # (x - m) * log2(e)
        exp_d = exp2(d, config)
        coef = coef_sum + coef_shifted * d if entropy else coef_sum
        onehot = cols == target
        if masked:
            kept = keep | onehot
            if shared_reference:  # exp(x - masked_max) is 2^d bit for bit: reuse it
                grad = exp_d * (coef + jnp.where(kept, coef_masked, 0.0))
            else:
                masked_exp = exp2(raw * scale + masked_neg_ref, config)
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

        stream_tiles(load, fold, (), num_vocab=num_vocab, block_v=block_v,
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
    return not config.interpret and indexes_safely(config, logits, keep_mask)


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
    require_safe_indexing(config, logits, keep_mask)
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
        out_spec = row_spec()
    else:
        out_shape = varying_struct(logits.shape, out_dtype or logits.dtype, *rows, *matrices)
        out_spec = matrix_spec(num_vocab)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_tokens,),
        in_specs=[row_spec()] * len(rows) + [matrix_spec(num_vocab)] * len(matrices),
        out_specs=out_spec,
        compiler_params=triton_compiler_params(config),
        interpret=config.interpret,
        debug=config.debug,
        name="logprob_entropy_bwd",
    )(*rows, *matrices)
