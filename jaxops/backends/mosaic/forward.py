"""The Mosaic GPU (Hopper, sm_90+) kernel for the shard statistics and its launcher
(`forward_stats`); the design notes below hold for the gradient kernel (`backward.py`) too.

Same contract as the Triton kernels (`contract.py`); launch parameters are
`config.MosaicConfig`. On CPU the kernels run in Mosaic GPU's interpret mode.

Shape of the work. A CTA (one warpgroup, 128 threads) owns a block of 64 rows and
one *chunk* of the vocabulary; it streams [64, block_v] tiles of logits (and of the
keep mask) from HBM into shared memory with TMA, `num_stages` tiles in flight
(`plgpu.emit_pipeline`), and reads each tile into registers in the WGMMA layout,
where a row's elements sit in 4 lanes of one warp: a per-row reduction along the
vocabulary is a per-thread reduction plus two shuffles. Row tails are TMA bounds
(zero fill on load, clipped on store); the vocabulary tail is masked with an iota.

Batch invariance. Every row goes through the same instruction sequence whatever T
is and wherever the row sits: the chunking of the vocabulary is a function of V_loc
alone, the 64 rows of a block are reduced independently of each other, and the
per-chunk partial statistics are combined in plain JAX, elementwise per row, in a
fixed chunk order (`combine_partials`). Small T still fills the GPU because the grid is
(row blocks x vocabulary chunks).

The target logit and the target's own mask bit are read outside the kernel (a [T]
gather); the forward kernel needs no targets. The masked log-sum-exp is exact
(`masked_max` is the kept maximum, as in `backends/xla.py`), in the same single pass, and
shares the row's exponential where that is exact (`statistics_kernel`).

Shapes taken (`config.mosaic_supported`): V_loc a multiple of 32 bytes of logits (fp32:
8, bf16: 16; the swizzled SMEM tile) and, with a mask, of 16 (TMA's row-stride alignment);
other shapes fall back to the XLA implementation with a RuntimeWarning. Any T: where
T > 8 is not a multiple of 8 the tiles move unswizzled (`common.tile_transforms`), bitwise the
same results, slower (bf16 1.6x at T = 8191). The kernels
read the mask as bytes: a uint8 mask (nonzero = kept) in place, a bool one after
`common.mask_bytes`'s XLA pass over it (on the H200 that pass makes a bf16 masked forward
2.6x slower: docs/performance.md, "Which backend 'pallas' means") or, where
`mask_view.ENABLED`, in place too.

Measured on the H200 at T = 8192, V = 151,936 (uint8 masks): every fp32/bf16 x
entropy x mask case within 1.06x of the HBM roofline, forward and forward+backward.
Not yet: T = 1024 (1.31x) and V_loc = 18,992 (slower than the Triton kernels).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxops.backends.mosaic.common import (EXCLUDED, LN2, LOG2E, ROWS, SHARED_EXP_GAP,
                                           any_row, chunk_start, copy_targets,
                                           interpret_params, mask_bytes,
                                           mosaic_compiler_params, neg_reference,
                                           operand_tiles, per_col, read_targets,
                                           row_vector, target_smem, to_layout,
                                           vocab_chunks, write_tile)
from jaxops.backends.mosaic.config import MosaicConfig, check_supported, mosaic_defaults
from jaxops.contract import NEG, LocalStats, vary_like, varying_struct

# --- forward -----------------------------------------------------------------------------

def num_partials(with_entropy: bool, masked: bool, with_target: bool = False) -> int:
    """Per-chunk partial statistics the forward kernel writes: (max, sum[, shifted]
    [, kept max, kept sum]) and, `with_target`, (target logit[, target kept])."""
    return 2 + with_entropy + 2 * masked + with_target * (1 + masked)


def fold_tile(raw, row_max, sum_exp, shifted, *, inv_tau):
    """One [64, width] float32 tile of raw logits (columns left out at EXCLUDED) folded
    into its rows' running statistics: the row max m in raw units, sum 2^d and (unless
    `shifted` is None) sum 2^d d, d = (x - m) log2(e) relative to the running max.
    Returns them and the tile's 2^d and the old sums' rescale factor (the masked sums
    reuse both). Also the fused head's epilogue on its wgmma logits tiles
    (`backends/mosaic/linear.py`)."""
    scale = inv_tau * LOG2E
    shape = raw.shape
    new_max = jnp.maximum(row_max, raw.max(axis=1))
    d = raw * scale + per_col(neg_reference(new_max * inv_tau), shape)
    exp_d = jnp.exp2(d)
    d_old = (row_max - new_max) * scale
    rescale = jnp.exp2(d_old)
    if shifted is not None:  # before sum_exp is updated: the rescale needs the old sum
        shifted = rescale * (shifted + d_old * sum_exp) + (exp_d * d).sum(axis=1)
    sum_exp = sum_exp * rescale + exp_d.sum(axis=1)
    return new_max, sum_exp, shifted, exp_d, rescale


def statistics_kernel(*refs, num_vocab, inv_tau, with_entropy, masked, config, itemsize,
                    with_target=False, wide_targets=False, epilogue=None):
    """`with_target`: also read the rows' (shard-local) targets and sum, per chunk, the
    target's raw logit and its mask bit (0 in chunks that do not hold the target), so
    that no gather outside the kernel is needed (`backends/mosaic/direct.py`); `wide_targets`:
    they are int64, as int32 word pairs (`read_targets`).

    `epilogue` (one vocabulary chunk only): `(fn, num_out)`; `fn(partials, targets)`
    turns the row block's partials into `num_out` row vectors, written to 1-D [padded]
    outputs instead of the partials (`mosaic.direct.forward_kernel`).

    Two choices keep the instruction count per element low (the bf16 kernels are as
    much instruction- as bandwidth-bound):
    - Only a chunk's edge tiles (the last chunk's tiles shared with its neighbour, the
      vocabulary's partial last tile) hold columns to leave out; a tile-uniform branch
      gives the others a body without the column mask (iota, two compares, a select).
    - With a mask, the kept sum shares the row's exponential: it accumulates relative
      to the running *row* maximum and is moved to the kept maximum per row at the end.
      That is exact to rounding while the kept maximum is within `SHARED_EXP_GAP` of the
      row maximum (a top-p mask keeps the row maximum: the gap is 0). Otherwise one
      more pass over the chunk, taken by the whole CTA, sums the kept logits relative to
      their own maximum, as `backends/xla.py` does; only the far rows take that sum, so a row's
      bits never depend on its neighbours."""
    refs = list(refs)
    logits_ref = refs.pop(0)
    mask_ref = refs.pop(0) if masked else None
    target_ref = refs.pop(0) if with_target else None
    num_out = epilogue[1] if epilogue else num_partials(with_entropy, masked, with_target)
    out_refs, smem_refs = refs[:num_out], refs[num_out:2 * num_out]
    block_v = config.block_v
    tiles, _, per_chunk = vocab_chunks(num_vocab, block_v, config.chunk_v)
    row_block = lax.axis_index("rows")
    chunk = lax.axis_index("chunks")
    first_tile, first_owned = chunk_start(chunk, tiles, per_chunk)
    target = None
    if with_target:
        target_smem, barrier = refs[2 * num_out:]
        copy_targets(target_ref, pl.ds(row_block * ROWS, ROWS), target_smem, barrier.at[0],
                     wide_targets)
        plgpu.barrier_wait(barrier.at[0])
        target = read_targets(target_smem, wide_targets, config)
    scale = inv_tau * LOG2E
    shape = (ROWS, block_v)
    wgmma = plgpu.Layout.WGMMA
    transforms, read_logits, mask_transforms, read_mask = operand_tiles(
        logits_ref, num_vocab, itemsize, block_v, masked, config)
    # A float32 tile of ones (where(c, 1.0, 0.0) of two Python floats is float64 under x64).
    ones = to_layout(jnp.full(shape, 1.0, jnp.float32), wgmma, config) if with_target else None

    def columns(j):
        """[64, block_v] int32: the tile's vocabulary columns."""
        return (first_tile + j) * block_v + to_layout(
            lax.broadcasted_iota(jnp.int32, shape, 1), wgmma, config)

    def is_edge(j):
        tile = first_tile + j
        return (tile < first_owned) | ((tile + 1) * block_v > num_vocab)

    def read_raw(logits_smem, j, edge):
        """(stored tile, raw float32 tile with the columns left out at EXCLUDED, in-vocab
        mask or None)."""
        stored = read_logits(logits_smem)
        raw = jnp.maximum(stored.astype(jnp.float32), EXCLUDED)
        if not edge:
            return stored, raw, None
        cols = columns(j)
        in_vocab = (cols >= first_owned * block_v) & (cols < num_vocab)
        return stored, jnp.where(in_vocab, raw, EXCLUDED), in_vocab

    def update(j, tile_refs, carry, edge):
        logits_smem, mask_smem = tile_refs if masked else (tile_refs[0], None)
        row_max, sum_exp, shifted, kept_max, kept_sum, target_sum, target_kept = carry
        stored, raw, in_vocab = read_raw(logits_smem, j, edge)

        row_max, sum_exp, shifted, exp_d, rescale = fold_tile(
            raw, row_max, sum_exp, shifted, inv_tau=inv_tau)

        keep = None
        if masked:  # columns left out are at EXCLUDED: neither their max nor exp counts
            keep = read_mask(mask_smem)
            kept_max = jnp.maximum(kept_max, jnp.where(keep, raw, EXCLUDED).max(axis=1))
            kept_sum = kept_sum * rescale + jnp.where(keep, exp_d, 0.0).sum(axis=1)
        if with_target:
            # One column at most matches (owned columns only): the sums are exact, and
            # the logit is the raw one (a -inf target gives a -inf log-prob).
            hit = columns(j) == per_col(target, shape)
            if edge:
                hit = hit & in_vocab
            target_sum = target_sum + jnp.where(
                hit, stored.astype(jnp.float32), 0.0).sum(axis=1)
            if masked:
                target_kept = target_kept + jnp.where(hit & keep, ones, 0.0).sum(axis=1)
        return row_max, sum_exp, shifted, kept_max, kept_sum, target_sum, target_kept

    def step(indices, *tile_refs_and_carry):
        (j,) = indices
        *tile_refs, carry = tile_refs_and_carry
        return lax.cond(is_edge(j),
                        lambda c: update(j, tile_refs, c, edge=True),
                        lambda c: update(j, tile_refs, c, edge=False), carry)

    specs = [plgpu.BlockSpec(shape, lambda j: (row_block, first_tile + j),
                             transforms=transforms)]
    gmem = [logits_ref]
    if masked:
        specs.append(plgpu.BlockSpec(shape, lambda j: (row_block, first_tile + j),
                                     transforms=mask_transforms))
        gmem.append(mask_ref)

    def run(body, carry):
        return plgpu.emit_pipeline(body, grid=(per_chunk,), in_specs=specs,
                                   max_concurrent_steps=config.num_stages,
                                   init_carry=carry)(*gmem)

    neg = row_vector(NEG, jnp.float32, config)
    zero = row_vector(0.0, jnp.float32, config)
    carry = (neg, zero, zero if with_entropy else None,
             neg if masked else None, zero if masked else None,
             zero if with_target else None, zero if with_target and masked else None)
    row_max, sum_exp, shifted, kept_max, kept_sum, target_sum, target_kept = run(step, carry)
    if masked:
        # Relative to the kept maximum; no kept logit: kept_max is NEG, kept_sum 0.
        gap = (row_max - kept_max) * scale
        kept_sum = kept_sum * jnp.exp2(jnp.minimum(gap, SHARED_EXP_GAP))
        far = (kept_max > NEG) & (gap > SHARED_EXP_GAP)

        def exact_kept_sum():
            def kept_step(indices, logits_smem, mask_smem, kept):
                (j,) = indices
                _, raw, _ = read_raw(logits_smem, j, edge=True)
                kept_raw = jnp.where(read_mask(mask_smem), raw, EXCLUDED)
                kept_exp = jnp.exp2(kept_raw * scale
                                    + per_col(neg_reference(kept_max * inv_tau), shape))
                return kept + kept_exp.sum(axis=1)
            return run(kept_step, zero)

        # One row far from its maximum sends the block through the pass; only the far
        # rows take its sum, so a row's result does not depend on its neighbours.
        kept_sum = lax.cond(any_row(far, zero),
                            lambda: jnp.where(far, exact_kept_sum(), kept_sum),
                            lambda: kept_sum)
    results = [r for r in (row_max, sum_exp, shifted, kept_max, kept_sum, target_sum,
                           target_kept) if r is not None]
    rows = pl.ds(row_block * ROWS, ROWS)
    if epilogue:
        results = epilogue[0](results, target)
    for smem, value in zip(smem_refs, results):
        write_tile(smem, value, config)
    plgpu.commit_smem()
    for smem, out in zip(smem_refs, out_refs):
        plgpu.copy_smem_to_gmem(smem, out.at[rows] if epilogue else out.at[chunk, rows])
    plgpu.wait_smem_to_gmem(0)


def combine_partials(partials, inv_tau):
    """Per-chunk (max, sum) pairs -> the row's (max, sum[, shifted]), in raw units.

    Elementwise per row, chunks folded in index order: a row's arithmetic does not
    depend on T. `partials` is a list over chunks of (raw max, sum of 2^d, sum of
    2^d d or None), d in log2 units relative to that chunk's max."""
    scale = inv_tau * LOG2E
    total_max = functools.reduce(jnp.maximum, [p[0] for p in partials])
    total_sum = total_shifted = 0.0
    for chunk_max, chunk_sum, chunk_shifted in partials:
        d_old = (chunk_max - total_max) * scale  # finite: maxima are >= NEG
        rescale = jnp.exp2(d_old)
        if chunk_shifted is not None:
            total_shifted = total_shifted + rescale * (chunk_shifted + d_old * chunk_sum)
        total_sum = total_sum + chunk_sum * rescale
    return total_max, total_sum, total_shifted


def row_statistics(row_max, sum_exp, shifted, inv_tau):
    """The per-chunk partials (raw max, sum of 2^d[, sum of 2^d d]), each [chunks, T],
    folded over the chunks into `LocalStats`' max_logit, sum_exp and sum_exp_shifted
    (None without `shifted`); a row with no finite logit gets (-inf, 0, 0)."""
    with_entropy = shifted is not None
    row_max, sum_exp, shifted = combine_partials(
        [(row_max[c], sum_exp[c], shifted[c] if with_entropy else None)
         for c in range(row_max.shape[0])], inv_tau)
    empty = row_max <= NEG  # no finite logit in this row
    return (jnp.where(empty, -jnp.inf, row_max * inv_tau), jnp.where(empty, 0.0, sum_exp),
            jnp.where(empty, 0.0, shifted * LN2) if with_entropy else None)


def forward_stats(logits, local_targets, keep_mask, *, inv_tau, with_entropy,
                  config: MosaicConfig | None = None) -> LocalStats:
    num_tokens, num_vocab = logits.shape
    masked = keep_mask is not None
    itemsize = logits.dtype.itemsize
    config = mosaic_defaults(config or MosaicConfig(), itemsize=itemsize, masked=masked,
                             backward=False)
    check_supported(num_vocab, itemsize, masked, config)
    inv_tau = float(inv_tau)
    _, chunks, _ = vocab_chunks(num_vocab, config.block_v, config.chunk_v)
    row_blocks = pl.cdiv(num_tokens, ROWS)
    padded = row_blocks * ROWS
    num_out = num_partials(with_entropy, masked)
    part = varying_struct((chunks, padded), jnp.float32, logits, keep_mask)
    kernel = plgpu.kernel(
        functools.partial(statistics_kernel, num_vocab=num_vocab, inv_tau=inv_tau,
                          with_entropy=with_entropy, masked=masked, config=config,
                          itemsize=itemsize),
        out_type=[part] * num_out,
        scratch_types=[plgpu.SMEM((ROWS,), jnp.float32)] * num_out,
        grid=(row_blocks, chunks),
        grid_names=("rows", "chunks"),
        compiler_params=mosaic_compiler_params(config),
        interpret=interpret_params() if config.interpret else False,
    )
    outs = list(kernel(logits, *([mask_bytes(keep_mask, in_place=not config.interpret)]
                              if masked else [])))
    outs = [vary_like(o[:, :num_tokens], logits, keep_mask) for o in outs]
    row_max, sum_exp = outs.pop(0), outs.pop(0)
    shifted = outs.pop(0) if with_entropy else None
    max_logit, sum_exp, sum_exp_shifted = row_statistics(row_max, sum_exp, shifted,
                                                         inv_tau)

    on_shard = (local_targets >= 0) & (local_targets < num_vocab)
    safe_target = jnp.where(on_shard, local_targets, 0).astype(jnp.int32)[:, None]
    # Raw, unclamped: a -inf target logit gives log_prob -inf (as the other kernels).
    raw_target = jnp.take_along_axis(logits, safe_target, axis=1)[:, 0].astype(jnp.float32)
    target_logit = jnp.where(on_shard, raw_target * inv_tau, 0.0)

    masked_max = masked_sum_exp = None
    if masked:
        masked_max, masked_sum_exp = kept_statistics(
            *outs, raw_target, keep_mask, safe_target[:, 0], on_shard, inv_tau)
    return LocalStats(max_logit, sum_exp, sum_exp_shifted, target_logit,
                      masked_max, masked_sum_exp)


def kept_statistics(kept_max, kept_sum, raw_target, keep_mask, safe_target, on_shard,
                    inv_tau):
    """`LocalStats`' masked_max and masked_sum_exp from the per-chunk partials (raw kept
    max, sum of 2^d relative to it), each [chunks, T], folded over the chunks, with the
    target counted as kept where its mask bit is off. raw_target [T] float32 (the
    target's raw logit), keep_mask [T, V_loc], safe_target [T] int32 (a column in range),
    on_shard [T] bool. Also the fused head's (`mosaic.linear.forward_stats`)."""
    kept_max, kept_sum, _ = combine_partials(
        [(kept_max[c], kept_sum[c], None) for c in range(kept_max.shape[0])], inv_tau)
    target_kept = jnp.take_along_axis(keep_mask, safe_target[:, None], axis=1)[:, 0] != 0
    target_alone = on_shard & ~target_kept
    target_raw = jnp.where(target_alone, jnp.maximum(raw_target, EXCLUDED), EXCLUDED)
    total_max, total_sum, _ = combine_partials(
        [(kept_max, kept_sum, None),
         (target_raw, jnp.where(target_alone, 1.0, 0.0), None)], inv_tau)
    none_kept = total_max <= NEG
    return (jnp.where(none_kept, -jnp.inf, total_max * inv_tau),
            jnp.where(none_kept, 0.0, total_sum))


