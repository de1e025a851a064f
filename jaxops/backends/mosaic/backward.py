"""The Mosaic GPU kernel for d loss / d logits and its launcher (`backward_logits`);
the shape of the work is the forward's (`forward.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxops.backends.mosaic import common as mosaic_common
from jaxops.backends.mosaic.common import (EXCLUDED, LN2, LOG2E, ROWS, SHARED_EXP_GAP,
                                           any_row, chunk_start, copy_targets,
                                           interpret_params, mask_bytes,
                                           mosaic_compiler_params, neg_reference,
                                           operand_tiles, per_col, read_targets, read_tile,
                                           row_vector, rows_layout, target_smem,
                                           tile_transforms, to_layout, vocab_chunks,
                                           write_tile)
from jaxops.backends.mosaic.config import (MosaicConfig, check_supported, mosaic_defaults,
                                           mosaic_supported)
from jaxops.contract import NEG, BackwardCoefs, vary_like, varying_struct

# Whether `can_write_into` offers `backward_logits(into=)` to callers (the bridge's route
# through JAX: the gradient stored straight into torch's buffer). The stored bytes equal
# the allocated gradient's on the GPU (tests/jaxops/test_mosaic_gpu.py::
# test_gpu_write_through_matches_the_allocated_gradient; docs/bridge.md). False: JAX
# allocates the gradient and torch takes it over (a copy where a call spans windows).
IN_PLACE_GRADIENT = True


# --- backward ----------------------------------------------------------------------------

def softmax_terms(raw, neg_ref, coef_sum, coef_shifted, *, scale):
    """(2^d, the per-element coefficient) of a [64, width] float32 tile of raw logits, d =
    (x - m) log2(e) (`neg_ref` = -m log2(e), `scale` = log2(e) / tau): the gradient is
    2^d * coefficient plus the target's term (and the kept softmax's, with a mask). The
    coefficient is coef_sum + coef_shifted * d with entropy (`coef_shifted` not None).
    Also the fused head's backward epilogue (`mosaic.linear.backward_logits`)."""
    shape = raw.shape
    d = raw * scale + per_col(neg_ref, shape)
    coef = per_col(coef_sum, shape)
    if coef_shifted is not None:
        coef = coef + per_col(coef_shifted, shape) * d
    return jnp.exp2(d), coef


def padded_targets(local_targets, num_vocab: int, padded: int):
    """The kernels' int32 target ids `[padded]`: -1 for targets off this shard (which then
    match no column, not even a padding column) and in the rows past T."""
    on_shard = (local_targets >= 0) & (local_targets < num_vocab)
    return jnp.pad(jnp.where(on_shard, local_targets, -1).astype(jnp.int32),
                   (0, padded - local_targets.shape[0]))


def backward_vectors(max_logit, masked_max, coefs: BackwardCoefs, inv_tau, padded: int):
    """The backward kernels' per-row vectors `[n, padded]` float32 (rows past T zero):
    -m log2(e), then the coefficients with 1/tau (and ln 2 for the log2-unit d) folded
    in: coef_sum[, coef_shifted], coef_target[, masked -m log2(e), coef_masked]."""
    def finite_or_zero(m):  # rows with no finite logit: any finite reference works
        return jnp.where(m > NEG, m, 0.0)

    vectors = [neg_reference(finite_or_zero(max_logit)), coefs.coef_sum * inv_tau]
    if coefs.coef_shifted is not None:
        vectors.append(coefs.coef_shifted * (inv_tau * LN2))
    vectors.append(coefs.coef_target * inv_tau)
    if masked_max is not None:
        vectors += [neg_reference(finite_or_zero(masked_max)), coefs.coef_masked * inv_tau]
    vectors = jnp.stack([v.astype(jnp.float32) for v in vectors])
    return jnp.pad(vectors, [(0, 0), (0, padded - vectors.shape[1])])


def gradient_kernel(*refs, num_vocab, inv_tau, entropy, masked, config, itemsize,
                     num_vectors, prologue=None, write_through=False):
    """`prologue`: None reads the targets and the coefficient vectors computed by
    `backward_logits`; else `prologue(refs, rows)` -> (target, vectors, dlogits_ref,
    grad_smem) computes them in the kernel from whatever `refs` it was given
    (`backends/mosaic/direct.py`). `write_through`: the gradient goes to an input buffer (the
    ref after the vectors) and the output is a `[padded]` ready-token (see
    `backward_logits`)."""
    refs = list(refs)
    logits_ref = refs.pop(0)
    mask_ref = refs.pop(0) if masked else None
    block_v = config.block_v
    stages = config.num_stages
    row_block = lax.axis_index("rows")
    chunk = lax.axis_index("chunks")
    tiles, _, per_chunk = vocab_chunks(num_vocab, block_v, config.chunk_v)
    first_tile, _ = chunk_start(chunk, tiles, per_chunk)
    rows = pl.ds(row_block * ROWS, ROWS)
    if prologue is None:
        target_ref = refs.pop(0)
        vectors_ref = refs.pop(0)  # [num_vectors, padded] float32, see backward_logits
        dlogits_ref = refs.pop(0)
        done_ref = refs.pop(0) if write_through else None
        target_smem, vectors_smem, grad_smem, barrier = refs
        copy_targets(target_ref, rows, target_smem, barrier.at[0], wide=False)
        plgpu.copy_gmem_to_smem(vectors_ref.at[:, rows], vectors_smem, barrier.at[0])
        plgpu.barrier_wait(barrier.at[0])
        if write_through:
            # The token's values are never read; storing one of the vectors gives it
            # defined contents without another SMEM buffer.
            @pl.when(chunk == 0)
            def _():
                plgpu.copy_smem_to_gmem(vectors_smem.at[0], done_ref.at[rows])
        target = read_targets(target_smem, False, config)
        vectors = [read_tile(vectors_smem.at[i], rows_layout(), config)
                   for i in range(num_vectors)]
    else:
        target, vectors, dlogits_ref, grad_smem = prologue(refs, rows)
    neg_ref, coef_sum = vectors.pop(0), vectors.pop(0)
    coef_shifted = vectors.pop(0) if entropy else None
    coef_target = vectors.pop(0)
    if masked:
        masked_neg_ref, coef_masked = vectors
    scale = inv_tau * LOG2E
    shape = (ROWS, block_v)
    wgmma = plgpu.Layout.WGMMA
    transforms, read_logits, mask_transforms, read_mask = operand_tiles(
        logits_ref, num_vocab, itemsize, block_v, masked, config)

    def step(indices, *tile_refs, shared_exp=False):
        (j,) = indices
        if masked:
            logits_smem, mask_smem = tile_refs
        else:
            (logits_smem,) = tile_refs
        cols = (first_tile + j) * block_v + to_layout(
            lax.broadcasted_iota(jnp.int32, shape, 1), wgmma, config)
        # Columns past V_loc are never stored (TMA clips them): no vocabulary mask.
        raw = jnp.maximum(read_logits(logits_smem).astype(jnp.float32), EXCLUDED)
        exp_d, coef = softmax_terms(raw, neg_ref, coef_sum, coef_shifted, scale=scale)
        onehot = cols == per_col(target, shape)
        if masked:
            kept = read_mask(mask_smem) | onehot
            # The kept softmax from the row's exponential (exact where the kept maximum
            # is near the row maximum) ...
            grad = exp_d * (coef + jnp.where(kept, per_col(coef_shared, shape), 0.0))
            if not shared_exp:
                # ... and from its own exponential in the rows where it is not. The
                # other rows keep the expression above, bit for bit.
                far_rows = per_col(far_flag, shape) != 0.0
                masked_exp = jnp.exp2(raw * scale + per_col(masked_neg_ref, shape))
                far_grad = exp_d * coef + jnp.where(
                    kept, masked_exp * per_col(coef_masked, shape), 0.0)
                grad = jnp.where(far_rows, far_grad, grad)
        else:
            grad = exp_d * coef
        grad = grad + jnp.where(onehot, per_col(coef_target, shape), 0.0)
        # The gradient's own ring of `stages` SMEM slots: the slot written now was
        # last stored stages steps ago; wait until that TMA store has read it.
        # (Not emit_pipeline's out_specs: their predicated stores have no rule in
        # the 0.10 interpreter.)
        slot = lax.rem(j, jnp.int32(stages))
        plgpu.wait_smem_to_gmem(stages - 1, wait_read_only=True)
        write_tile(grad_smem.at[slot], grad.astype(grad_smem.dtype), config,
               tiled=bool(transforms))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            grad_smem.at[slot],
            dlogits_ref.at[pl.ds(row_block * ROWS, ROWS),
                           pl.ds((first_tile + j) * block_v, block_v)])

    index = lambda j: (row_block, first_tile + j)  # noqa: E731
    in_specs = [plgpu.BlockSpec(shape, index, transforms=transforms)]
    gmem = [logits_ref]
    if masked:
        in_specs.append(plgpu.BlockSpec(shape, index,
                                        transforms=mask_transforms))
        gmem.append(mask_ref)

    def run(body):
        plgpu.emit_pipeline(body, grid=(per_chunk,), in_specs=in_specs,
                            max_concurrent_steps=stages)(*gmem)

    if masked:
        # As in the forward: the kept softmax's exponential is the row's times a per-row
        # factor where the kept maximum is within SHARED_EXP_GAP of the row maximum
        # (rows that keep nothing have coef_masked 0); a block with a row farther off
        # takes the body with a second exponential (CTA-uniform choice), used by the far
        # rows only (batch invariance).
        gap = masked_neg_ref - neg_ref  # (m - kept m) * log2(e) >= 0
        coef_shared = coef_masked * jnp.exp2(jnp.minimum(gap, SHARED_EXP_GAP))
        zero = row_vector(0.0, jnp.float32, config)
        far = (gap > SHARED_EXP_GAP) & (coef_masked != 0.0)
        far_flag = jnp.where(far, zero + 1.0, zero)  # float: broadcast along the row
        lax.cond(any_row(far, zero),
                 lambda: run(step),
                 lambda: run(functools.partial(step, shared_exp=True)))
    else:
        run(step)
    plgpu.wait_smem_to_gmem(0)


def can_write_into(logits, keep_mask, config: MosaicConfig | None) -> bool:
    """Whether callers should hand `backward_logits` a buffer to write the gradient into
    (`IN_PLACE_GRADIENT`, and `_stores_into` allows it)."""
    return IN_PLACE_GRADIENT and _stores_into(logits, keep_mask, config)


def _stores_into(logits, keep_mask, config: MosaicConfig | None) -> bool:
    """Whether `backward_logits(..., into=buffer)` can store into `buffer`: compiled
    kernels (not the interpreter, which works on copies) at a V_loc they take, on a JAX
    that lowers a store into an input (`mosaic_common.STORES_INTO_INPUTS`)."""
    return (mosaic_common.STORES_INTO_INPUTS and not (config is not None and config.interpret)
            and logits.shape[0] > 0
            and mosaic_supported(logits.shape[-1], logits.dtype.itemsize,
                                 keep_mask is not None))


def backward_logits(logits, local_targets, keep_mask, max_logit, masked_max,
                    coefs: BackwardCoefs, *, inv_tau,
                    config: MosaicConfig | None = None, into=None,
                    out_dtype=None) -> jax.Array:
    """d loss / d logits `[T, V_loc]` in the logits' dtype (see `contract.py`); another
    `out_dtype` is a rounding of that after the kernel (the kernel stores through SMEM
    tiles of the logits' dtype), not a narrower store as in the Triton kernel.

    With `into` (a `[T, V_loc]` array of the logits' dtype, e.g. a DLPack view of a
    tensor PyTorch allocated), the kernel's TMA stores go to that buffer instead of a
    new one, and the result is a `[T]` float32 array that is ready once the buffer is
    written (its values are unspecified). XLA treats `into` as a read-only input: read
    it through its owner only. Needs `_stores_into(...)` (see `can_write_into`)."""
    if into is not None:
        if not _stores_into(logits, keep_mask, config):
            raise ValueError("backward_logits(into=...) needs the compiled Mosaic kernels "
                             "at a V_loc they take")
        if out_dtype is not None and jnp.dtype(out_dtype) != logits.dtype:
            raise ValueError("backward_logits(into=...) writes the logits' dtype")
        if into.shape != logits.shape or into.dtype != logits.dtype:
            raise ValueError(f"into must be {logits.shape} {logits.dtype}, "
                             f"got {into.shape} {into.dtype}")
    dlogits = _backward_logits(logits, local_targets, keep_mask, max_logit, masked_max,
                               coefs, inv_tau=inv_tau, config=config, into=into)
    return dlogits if out_dtype is None else dlogits.astype(out_dtype)


def _backward_logits(logits, local_targets, keep_mask, max_logit, masked_max,
                     coefs: BackwardCoefs, *, inv_tau, config: MosaicConfig | None,
                     into=None):
    num_tokens, num_vocab = logits.shape
    masked = keep_mask is not None
    itemsize = logits.dtype.itemsize
    config = mosaic_defaults(config or MosaicConfig(), itemsize=itemsize, masked=masked,
                             backward=True)
    check_supported(num_vocab, itemsize, masked, config)
    inv_tau = float(inv_tau)
    entropy = coefs.coef_shifted is not None
    _, chunks, per_chunk = vocab_chunks(num_vocab, config.block_v, config.chunk_v)
    row_blocks = pl.cdiv(num_tokens, ROWS)
    padded = row_blocks * ROWS

    vectors = backward_vectors(max_logit, masked_max if masked else None, coefs, inv_tau,
                               padded)
    target = padded_targets(local_targets, num_vocab, padded)
    num_vectors = vectors.shape[0]
    # The interpreter cannot clip out-of-bounds TMA stores as the GPU does: there the
    # gradient is computed into a tile-aligned array and sliced.
    out_shape = ((padded, chunks * per_chunk * config.block_v) if config.interpret
                 else logits.shape)
    operands = ([logits] + ([mask_bytes(keep_mask, in_place=not config.interpret)] if masked
                           else []) + [target, vectors] + ([] if into is None else [into]))
    out_type = ((out_shape, logits.dtype) if into is None else ((padded,), jnp.float32))
    kernel = plgpu.kernel(
        functools.partial(gradient_kernel, num_vocab=num_vocab, inv_tau=inv_tau,
                          entropy=entropy, masked=masked, config=config, itemsize=itemsize,
                          num_vectors=num_vectors, write_through=into is not None),
        out_type=varying_struct(*out_type, *operands, max_logit,
                                *[c for c in coefs if c is not None]),
        scratch_types=[target_smem(wide=False),
                       plgpu.SMEM((num_vectors, ROWS), jnp.float32),
                       plgpu.SMEM((config.num_stages, ROWS, config.block_v), logits.dtype,
                                  transforms=tile_transforms(num_tokens, num_vocab, itemsize,
                                                         config.block_v)),
                       # num_barriers explicit: its default is 1 (a [1] ref) in
                       # 0.10 and () (a scalar ref) in 0.11.
                       plgpu.Barrier(num_arrivals=2, num_barriers=1)],
        grid=(row_blocks, chunks),
        grid_names=("rows", "chunks"),
        compiler_params=mosaic_compiler_params(config),
        interpret=interpret_params() if config.interpret else False,
    )
    dlogits = vary_like(kernel(*operands), *operands, max_logit,
                        *[c for c in coefs if c is not None])
    if into is not None:
        return dlogits[:num_tokens]
    return dlogits[:num_tokens, :num_vocab] if config.interpret else dlogits
