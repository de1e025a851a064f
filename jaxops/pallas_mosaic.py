"""Pallas kernels lowered through Mosaic GPU (Hopper, sm_90+) for the shard statistics
and their gradient (issue 14).

Same contract as `pallas_gpu.py` (`contract.py`); launch parameters are
`pallas_config.MosaicConfig`. On CPU the kernels run in Mosaic GPU's interpret mode.

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
fixed chunk order (`_combine`). Small T still fills the GPU because the grid is
(row blocks x vocabulary chunks).

The target logit and the target's own mask bit are read outside the kernel (a [T]
gather); the forward kernel needs no targets. The masked log-sum-exp is exact
(`masked_max` is the kept maximum, as in `xla.py`), in the same single pass, and
shares the row's exponential where that is exact (`_forward_kernel`).

Shapes taken (`pallas_config.mosaic_supported`): V_loc a multiple of 32 bytes of logits (fp32: 8, bf16:
16; the swizzled SMEM tile) and, with a mask, of 16 (TMA's row-stride alignment);
other shapes fall back to the XLA implementation with a RuntimeWarning. Any T: where
T > 8 is not a multiple of 8 the tiles move unswizzled (`_transforms`), bitwise the
same results, slower (bf16 1.6x at T = 8191; "pallas" picks Triton for such T). The kernels
read the mask as bytes: a uint8 mask (nonzero = kept) in place, a bool one after
`_mask_bytes`'s XLA pass over it (on the H200 that pass makes a bf16 masked forward
2.6x slower: docs/performance.md, "Which backend 'pallas' means") or, where
`_mask_view.ENABLED`, in place too.

Measured on the H200 at T = 8192, V = 151,936 (uint8 masks): every fp32/bf16 x
entropy x mask case within 1.06x of the HBM roofline, forward and forward+backward.
Not yet: T = 1024 (1.31x) and V_loc = 18,992 (slower than the Triton kernels).
"""

from __future__ import annotations

import functools
import inspect
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxops import _mask_view
from jaxops.contract import NEG, BackwardCoefs, LocalStats, ids_from_words, varying_struct
from jaxops.pallas_config import (MosaicConfig, mosaic_defaults, mosaic_rows_tile,
                                  mosaic_supported)

__all__ = ["MosaicConfig", "backward_logits", "forward_stats"]  # MosaicConfig: re-exported

_ROWS = 64  # rows per CTA: the M extent of the WGMMA register layout
_EXCLUDED = 2 * NEG  # as in pallas_gpu.py: strictly below the running max's start NEG
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
# With a keep mask, the kept logits' sum shares the row's exponential (relative to the
# row maximum) while the kept maximum is at most this far below it, in log2 units. The
# terms that underflow there (below 2^-126) are below 2^-62 of the kept maximum's own
# term: over 2^20 columns still far below float32's epsilon.
_SHARED_EXP_GAP = 64.0


# --- version shims (jax 0.10.2, 0.11.2 and 0.12.1 checked) ------------------------------

# jax 0.12 refuses a kernel that stores into an input passed as an array (it wants a
# Ref, or the input aliased to an output); 0.10 and 0.11 lower it. The kernels that store
# into a buffer their caller owns -- the in-place gradient (`backward_logits(into=)`) and
# the bridge's direct route (`mosaic_direct`) -- are therefore used up to 0.11 only;
# from 0.12 the gradient is JAX's and the bridge goes through JAX (docs/bridge.md).
STORES_INTO_INPUTS = tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 12)
# `backward_logits(into=)` lowers for CUDA (tests/test_mosaic.py) but has not yet run on a
# GPU: `can_write_into` offers it once
# tests/test_mosaic.py::test_gpu_write_through_matches_the_allocated_gradient has passed
# there. Until then the bridge's route through JAX takes JAX's gradient on the Mosaic
# kernels (handed to torch without a copy for one row window).
IN_PLACE_GRADIENT = False


def _interpret_params():
    """Mosaic GPU's own interpreter (GMEM/SMEM, TMA, barriers simulated on CPU).

    `interpret=True` would select the generic Pallas interpreter, which has no rule
    for TMA copies. Public as `plgpu.InterpretGPUParams` from jax 0.11; in 0.10 only
    under `jax._src`. Out-of-bounds TMA reads must not raise: on the GPU they
    zero-fill, here they read an "uninitialized" value (NaN for floats), which the
    kernels mask like any padding."""
    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    return params(out_of_bounds_reads="uninitialized")


def _compiler_params(config: MosaicConfig):
    # Lane semantics pinned: the default changed from Lane (0.10) to Warpgroup (0.11);
    # the layouts below are chosen explicitly, which is what Lane semantics means.
    return plgpu.CompilerParams(approx_math=config.approx_math,
                                lowering_semantics=plgpu.LoweringSemantics.Lane)


def _layout(x, layout, config: MosaicConfig):
    # The 0.10 interpreter has no rule for layout_cast; layouts mean nothing there.
    return x if config.interpret else plgpu.layout_cast(x, layout)


def _read(ref, layout, config: MosaicConfig):
    """A whole SMEM (or GMEM) ref as a register array in `layout`.

    `ref[...]` immediately followed by a layout cast is how the Lane lowering
    learns the layout to load in (`plgpu.load` has no interpret rule in 0.10 and
    deprecates its index argument in 0.11)."""
    return _layout(ref[...], layout, config)


def _read_unoptimized(ref, layout, config: MosaicConfig):
    """As `_read`, allowing a load with shared-memory bank conflicts (the mask tile
    where V_loc admits no swizzle, see `_transforms`)."""
    if config.interpret:
        return ref[...]
    if _LOAD_NEEDS_INDEX:
        return plgpu.load(ref, (), layout=layout, optimized=False)  # jax 0.10
    return plgpu.load(ref, layout=layout, optimized=False)  # 0.11, 0.12: index the ref


def _load_needs_index() -> bool:
    """`plgpu.load(ref, idx, ...)`: jax 0.10 requires the index; 0.11 makes it optional
    (deprecated) and 0.12 removes it. 0.11 and 0.12 then load the whole ref alike."""
    idx = inspect.signature(plgpu.load).parameters.get("idx")
    return idx is not None and idx.default is inspect.Parameter.empty


_LOAD_NEEDS_INDEX = _load_needs_index()


def _write(ref, value, config: MosaicConfig, *, tiled: bool = False):
    """`ref[...] = value` into SMEM, a ref without tiling transforms (row vectors, the
    untiled tiles of `_transforms`) allowing bank conflicts, as jax 0.10 and 0.11 store
    it. From 0.12 `ref[...] =` demands a conflict-free plan there (and loads the old
    value), which such tiles may lack; its new `plgpu.store` can waive that."""
    if tiled or config.interpret or not hasattr(plgpu, "store"):  # jax 0.10, 0.11
        ref[...] = value
    else:
        plgpu.store(ref, value, optimized=False)  # 0.12


def _tile_reader(transforms, config: MosaicConfig):
    """fn reading a [64, block_v] SMEM tile into registers in the WGMMA layout; from an
    untiled tile (no `transforms`) the load accepts bank conflicts."""
    if transforms:
        return lambda ref: _read(ref, plgpu.Layout.WGMMA, config)
    return lambda ref: _read_unoptimized(ref, plgpu.Layout.WGMMA, config)


def _mask_reader(num_tokens: int, num_vocab: int, block_v: int, masked: bool,
                 config: MosaicConfig):
    """(the mask tiles' SMEM transforms, fn reading a mask tile as bool [64, block_v] in
    the WGMMA layout)."""
    transforms = _transforms(num_tokens, num_vocab, 1, block_v) if masked else ()
    read = _tile_reader(transforms, config)
    return transforms, lambda ref: read(ref) != 0


def _operand_tiles(logits_ref, num_vocab: int, itemsize: int, block_v: int, masked: bool,
                   config: MosaicConfig):
    """(logits tiles' SMEM transforms, fn reading a logits tile, the mask tiles'
    transforms, fn reading a mask tile as bool), for the [T, V_loc] operands of a kernel
    whose logits are `logits_ref`."""
    num_tokens = logits_ref.shape[0]
    transforms = _transforms(num_tokens, num_vocab, itemsize, block_v)
    return (transforms, _tile_reader(transforms, config),
            *_mask_reader(num_tokens, num_vocab, block_v, masked, config))


def _rows_layout():
    return plgpu.Layout.WGMMA.reduce(1)


def target_smem(wide: bool):
    """SMEM for a 64-row block's targets: int32 ids, or (`wide`) the two int32 words of
    each little-endian int64 id, as torch stores them (`mosaic_direct`)."""
    return plgpu.SMEM((_ROWS * (2 if wide else 1),), jnp.int32)


def copy_targets(target_ref, rows, smem, barrier, wide: bool):
    """Start the TMA copy of the targets of `rows` (a 64-row `pl.ds`) into
    `target_smem(wide)`."""
    if wide:
        rows = pl.ds(rows.start * 2, 2 * _ROWS)
    plgpu.copy_gmem_to_smem(target_ref.at[rows], smem, barrier)


def read_targets(smem, wide: bool, config: MosaicConfig):
    """[64] int32 ids in the rows layout from `target_smem(wide)`; a wide id outside
    [0, 2**31) reads as -1 (`contract.ids_from_words`), which the range test fails."""
    if not wide:
        return _read(smem, _rows_layout(), config)
    if config.interpret:  # the interpreter has no reshape transform for SMEM refs
        low, high = smem[pl.ds(0, _ROWS, stride=2)], smem[pl.ds(1, _ROWS, stride=2)]
    else:  # Mosaic GPU lowers no strided slice; a column of the [64, 2] view it does
        words = smem.reshape(_ROWS, 2)
        low, high = (_layout(words[:, k], _rows_layout(), config) for k in (0, 1))
    return ids_from_words(low, high)


def _row_vector(value, dtype, config):
    return _layout(jnp.full((_ROWS,), value, dtype), _rows_layout(), config)


def _per_col(row_vec, shape):
    return lax.broadcast_in_dim(row_vec, shape, (0,))


def _any_row(flags, zero):
    """Whether any of the block's rows is flagged (`flags`: bool [64] in the rows
    layout; `zero`: a float32 row vector of 0.0): one value for the whole CTA, so a
    branch on it is uniform."""
    return jnp.max(jnp.where(flags, zero + 1.0, zero)) > 0


# --- shapes, tiles, chunks ---------------------------------------------------------------

def _transforms(num_tokens: int, num_vocab: int, itemsize: int, block_v: int):
    """SMEM tiling + swizzle for a [64, block_v] tile of a [T, V_loc] operand, or ()
    where its shape admits none.

    The WGMMA-layout load from (and store to) SMEM is free of bank conflicts only
    from a tiled, swizzled tile. TMA fills one from a descriptor of the whole GMEM
    operand tiled the same way, (8, width), so the tile width must divide V_loc (the
    widest swizzle whose width does is used: 128 bytes for V = 151,936; 64 for fp32 at
    V_loc = 18,992) and T must tile by 8 rows (`mosaic_rows_tile`). Other shapes move
    untiled tiles and read them with bank conflicts (`_tile_reader`)."""
    if not mosaic_rows_tile(num_tokens):
        return ()
    for swizzle in (128, 64, 32):
        width = swizzle // itemsize
        if num_vocab % width == 0 and block_v % width == 0:
            return (plgpu.TilingTransform((8, width)), plgpu.SwizzleTransform(swizzle))
    return ()


def _mask_bytes(keep_mask, *, in_place: bool = False):
    """The keep mask as bytes (nonzero = kept) for a kernel operand: Mosaic GPU types
    bool refs as 1-bit (i1), so a bool array cannot be copied with TMA. A bool mask
    costs one pass over it in XLA (T * V_loc bytes read and written) per kernel call,
    unless `in_place` (the operand goes straight into a kernel launched on the GPU, not
    the interpreter) and `_mask_view.ENABLED`. Callers that can hand over uint8 masks
    avoid it either way."""
    if keep_mask.dtype in (jnp.uint8, jnp.int8):
        return keep_mask
    if in_place and _mask_view.ENABLED:
        return _mask_view.bytes_view(keep_mask)
    return keep_mask.astype(jnp.uint8)


def _mask_bool(keep_mask):
    """A uint8 keep mask (nonzero = kept) as bool, for the XLA fallback."""
    return None if keep_mask is None else keep_mask.astype(jnp.bool_)


def _chunking(num_vocab: int, block_v: int, chunk_v: int):
    """(tiles, chunks, tiles per chunk): a function of V_loc and the config only,
    never of T (batch invariance).

    Every chunk has the same static number of tiles (emit_pipeline's grid stays
    static); the last chunk is shifted back to end at the last tile, and the tiles
    it shares with its neighbour are masked out of its statistics (forward) or
    written twice with the same values (backward). The tiles per chunk are chosen
    near chunk_v / block_v so that this overlap is as small as possible (V = 151,936
    at 128-column tiles: 1187 tiles = 36 chunks of 33 minus one)."""
    tiles = pl.cdiv(num_vocab, block_v)
    target = max(1, chunk_v // block_v)
    if tiles <= target:
        return tiles, 1, tiles
    candidates = range(max(1, target // 2), target + target // 2 + 1)
    per_chunk = min(candidates,
                    key=lambda n: (pl.cdiv(tiles, n) * n - tiles, abs(n - target)))
    return tiles, pl.cdiv(tiles, per_chunk), per_chunk


def _chunk_start(chunk, tiles: int, per_chunk: int):
    """(first tile this CTA loads, first tile it owns)."""
    owned = chunk * per_chunk
    return jnp.minimum(owned, tiles - per_chunk), owned


def _warn_fallback(what: str):
    warnings.warn(
        f"pallas_mosaic: {what}: V_loc must be a multiple of 32 bytes of logits (and, "
        "with a keep mask, of 16) for the TMA tiles; computing this call with the XLA "
        "implementation instead.", RuntimeWarning, stacklevel=3)


def _neg_reference(max_x):
    """-m * log2(e) for a row max m in units of x (as pallas_gpu.py)."""
    return -(max_x * _LOG2E)


# --- forward -----------------------------------------------------------------------------

def num_partials(with_entropy: bool, masked: bool, with_target: bool = False) -> int:
    """Per-chunk partial statistics the forward kernel writes: (max, sum[, shifted]
    [, kept max, kept sum]) and, `with_target`, (target logit[, target kept])."""
    return 2 + with_entropy + 2 * masked + with_target * (1 + masked)


def fold_tile(raw, row_max, sum_exp, shifted, *, inv_tau):
    """One [64, width] float32 tile of raw logits (columns left out at _EXCLUDED) folded
    into its rows' running statistics: the row max m in raw units, sum 2^d and (unless
    `shifted` is None) sum 2^d d, d = (x - m) log2(e) relative to the running max.
    Returns them and the tile's 2^d and the old sums' rescale factor (the masked sums
    reuse both). Also the fused head's epilogue on its wgmma logits tiles
    (`linear_mosaic.py`)."""
    scale = inv_tau * _LOG2E
    shape = raw.shape
    new_max = jnp.maximum(row_max, raw.max(axis=1))
    d = raw * scale + _per_col(_neg_reference(new_max * inv_tau), shape)
    exp_d = jnp.exp2(d)
    d_old = (row_max - new_max) * scale
    rescale = jnp.exp2(d_old)
    if shifted is not None:  # before sum_exp is updated: the rescale needs the old sum
        shifted = rescale * (shifted + d_old * sum_exp) + (exp_d * d).sum(axis=1)
    sum_exp = sum_exp * rescale + exp_d.sum(axis=1)
    return new_max, sum_exp, shifted, exp_d, rescale


def _forward_kernel(*refs, num_vocab, inv_tau, with_entropy, masked, config, itemsize,
                    with_target=False, wide_targets=False, epilogue=None):
    """`with_target`: also read the rows' (shard-local) targets and sum, per chunk, the
    target's raw logit and its mask bit (0 in chunks that do not hold the target), so
    that no gather outside the kernel is needed (`mosaic_direct.py`); `wide_targets`:
    they are int64, as int32 word pairs (`read_targets`).

    `epilogue` (one vocabulary chunk only): `(fn, num_out)`; `fn(partials, targets)`
    turns the row block's partials into `num_out` row vectors, written to 1-D [padded]
    outputs instead of the partials (`mosaic_direct.forward_kernel`).

    Two choices keep the instruction count per element low (the bf16 kernels are as
    much instruction- as bandwidth-bound):
    - Only a chunk's edge tiles (the last chunk's tiles shared with its neighbour, the
      vocabulary's partial last tile) hold columns to leave out; a tile-uniform branch
      gives the others a body without the column mask (iota, two compares, a select).
    - With a mask, the kept sum shares the row's exponential: it accumulates relative
      to the running *row* maximum and is moved to the kept maximum per row at the end.
      That is exact to rounding while the kept maximum is within `_SHARED_EXP_GAP` of the
      row maximum (a top-p mask keeps the row maximum: the gap is 0). Otherwise one
      more pass over the chunk, taken by the whole CTA, sums the kept logits relative to
      their own maximum, as `xla.py` does; only the far rows take that sum, so a row's
      bits never depend on its neighbours."""
    refs = list(refs)
    logits_ref = refs.pop(0)
    mask_ref = refs.pop(0) if masked else None
    target_ref = refs.pop(0) if with_target else None
    num_out = epilogue[1] if epilogue else num_partials(with_entropy, masked, with_target)
    out_refs, smem_refs = refs[:num_out], refs[num_out:2 * num_out]
    block_v = config.block_v
    tiles, _, per_chunk = _chunking(num_vocab, block_v, config.chunk_v)
    row_block = lax.axis_index("rows")
    chunk = lax.axis_index("chunks")
    first_tile, first_owned = _chunk_start(chunk, tiles, per_chunk)
    target = None
    if with_target:
        target_smem, barrier = refs[2 * num_out:]
        copy_targets(target_ref, pl.ds(row_block * _ROWS, _ROWS), target_smem, barrier.at[0],
                     wide_targets)
        plgpu.barrier_wait(barrier.at[0])
        target = read_targets(target_smem, wide_targets, config)
    scale = inv_tau * _LOG2E
    shape = (_ROWS, block_v)
    wgmma = plgpu.Layout.WGMMA
    transforms, read_logits, mask_transforms, read_mask = _operand_tiles(
        logits_ref, num_vocab, itemsize, block_v, masked, config)
    # A float32 tile of ones (where(c, 1.0, 0.0) of two Python floats is float64 under x64).
    ones = _layout(jnp.full(shape, 1.0, jnp.float32), wgmma, config) if with_target else None

    def columns(j):
        """[64, block_v] int32: the tile's vocabulary columns."""
        return (first_tile + j) * block_v + _layout(
            lax.broadcasted_iota(jnp.int32, shape, 1), wgmma, config)

    def is_edge(j):
        tile = first_tile + j
        return (tile < first_owned) | ((tile + 1) * block_v > num_vocab)

    def read_raw(logits_smem, j, edge):
        """(stored tile, raw float32 tile with the columns left out at _EXCLUDED, in-vocab
        mask or None)."""
        stored = read_logits(logits_smem)
        raw = jnp.maximum(stored.astype(jnp.float32), _EXCLUDED)
        if not edge:
            return stored, raw, None
        cols = columns(j)
        in_vocab = (cols >= first_owned * block_v) & (cols < num_vocab)
        return stored, jnp.where(in_vocab, raw, _EXCLUDED), in_vocab

    def update(j, tile_refs, carry, edge):
        logits_smem, mask_smem = tile_refs if masked else (tile_refs[0], None)
        row_max, sum_exp, shifted, kept_max, kept_sum, target_sum, target_kept = carry
        stored, raw, in_vocab = read_raw(logits_smem, j, edge)

        row_max, sum_exp, shifted, exp_d, rescale = fold_tile(
            raw, row_max, sum_exp, shifted, inv_tau=inv_tau)

        keep = None
        if masked:  # columns left out are at _EXCLUDED: neither their max nor exp counts
            keep = read_mask(mask_smem)
            kept_max = jnp.maximum(kept_max, jnp.where(keep, raw, _EXCLUDED).max(axis=1))
            kept_sum = kept_sum * rescale + jnp.where(keep, exp_d, 0.0).sum(axis=1)
        if with_target:
            # One column at most matches (owned columns only): the sums are exact, and
            # the logit is the raw one (a -inf target gives a -inf log-prob).
            hit = columns(j) == _per_col(target, shape)
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

    neg = _row_vector(NEG, jnp.float32, config)
    zero = _row_vector(0.0, jnp.float32, config)
    carry = (neg, zero, zero if with_entropy else None,
             neg if masked else None, zero if masked else None,
             zero if with_target else None, zero if with_target and masked else None)
    row_max, sum_exp, shifted, kept_max, kept_sum, target_sum, target_kept = run(step, carry)
    if masked:
        # Relative to the kept maximum; no kept logit: kept_max is NEG, kept_sum 0.
        gap = (row_max - kept_max) * scale
        kept_sum = kept_sum * jnp.exp2(jnp.minimum(gap, _SHARED_EXP_GAP))
        far = (kept_max > NEG) & (gap > _SHARED_EXP_GAP)

        def exact_kept_sum():
            def kept_step(indices, logits_smem, mask_smem, kept):
                (j,) = indices
                _, raw, _ = read_raw(logits_smem, j, edge=True)
                kept_raw = jnp.where(read_mask(mask_smem), raw, _EXCLUDED)
                kept_exp = jnp.exp2(kept_raw * scale
                                    + _per_col(_neg_reference(kept_max * inv_tau), shape))
                return kept + kept_exp.sum(axis=1)
            return run(kept_step, zero)

        # One row far from its maximum sends the block through the pass; only the far
        # rows take its sum, so a row's result does not depend on its neighbours.
        kept_sum = lax.cond(_any_row(far, zero),
                            lambda: jnp.where(far, exact_kept_sum(), kept_sum),
                            lambda: kept_sum)
    results = [r for r in (row_max, sum_exp, shifted, kept_max, kept_sum, target_sum,
                           target_kept) if r is not None]
    rows = pl.ds(row_block * _ROWS, _ROWS)
    if epilogue:
        results = epilogue[0](results, target)
    for smem, value in zip(smem_refs, results):
        _write(smem, value, config)
    plgpu.commit_smem()
    for smem, out in zip(smem_refs, out_refs):
        plgpu.copy_smem_to_gmem(smem, out.at[rows] if epilogue else out.at[chunk, rows])
    plgpu.wait_smem_to_gmem(0)


def _combine(partials, inv_tau):
    """Per-chunk (max, sum) pairs -> the row's (max, sum[, shifted]), in raw units.

    Elementwise per row, chunks folded in index order: a row's arithmetic does not
    depend on T. `partials` is a list over chunks of (raw max, sum of 2^d, sum of
    2^d d or None), d in log2 units relative to that chunk's max."""
    scale = inv_tau * _LOG2E
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
    row_max, sum_exp, shifted = _combine(
        [(row_max[c], sum_exp[c], shifted[c] if with_entropy else None)
         for c in range(row_max.shape[0])], inv_tau)
    empty = row_max <= NEG  # no finite logit in this row
    return (jnp.where(empty, -jnp.inf, row_max * inv_tau), jnp.where(empty, 0.0, sum_exp),
            jnp.where(empty, 0.0, shifted * _LN2) if with_entropy else None)


def forward_stats(logits, local_targets, keep_mask, *, inv_tau, with_entropy,
                  config: MosaicConfig | None = None) -> LocalStats:
    num_tokens, num_vocab = logits.shape
    masked = keep_mask is not None
    itemsize = logits.dtype.itemsize
    if not mosaic_supported(num_vocab, itemsize, masked) or num_tokens == 0:
        if num_tokens:
            _warn_fallback(f"logits [{num_tokens}, {num_vocab}] {logits.dtype}")
        from jaxops import xla

        return xla.forward_stats(logits, local_targets, _mask_bool(keep_mask),
                                 inv_tau=inv_tau, with_entropy=with_entropy)
    config = mosaic_defaults(config or MosaicConfig(), itemsize=itemsize, masked=masked,
                             backward=False)
    inv_tau = float(inv_tau)
    _, chunks, _ = _chunking(num_vocab, config.block_v, config.chunk_v)
    row_blocks = pl.cdiv(num_tokens, _ROWS)
    padded = row_blocks * _ROWS
    num_out = num_partials(with_entropy, masked)
    part = varying_struct((chunks, padded), jnp.float32, logits, keep_mask)
    kernel = plgpu.kernel(
        functools.partial(_forward_kernel, num_vocab=num_vocab, inv_tau=inv_tau,
                          with_entropy=with_entropy, masked=masked, config=config,
                          itemsize=itemsize),
        out_type=[part] * num_out,
        scratch_types=[plgpu.SMEM((_ROWS,), jnp.float32)] * num_out,
        grid=(row_blocks, chunks),
        grid_names=("rows", "chunks"),
        compiler_params=_compiler_params(config),
        interpret=_interpret_params() if config.interpret else False,
    )
    outs = list(kernel(logits, *([_mask_bytes(keep_mask, in_place=not config.interpret)]
                              if masked else [])))
    outs = [o[:, :num_tokens] for o in outs]
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
    on_shard [T] bool. Also the fused head's (`linear_mosaic.forward_stats`)."""
    kept_max, kept_sum, _ = _combine(
        [(kept_max[c], kept_sum[c], None) for c in range(kept_max.shape[0])], inv_tau)
    target_kept = jnp.take_along_axis(keep_mask, safe_target[:, None], axis=1)[:, 0] != 0
    target_alone = on_shard & ~target_kept
    target_raw = jnp.where(target_alone, jnp.maximum(raw_target, _EXCLUDED), _EXCLUDED)
    total_max, total_sum, _ = _combine(
        [(kept_max, kept_sum, None),
         (target_raw, jnp.where(target_alone, 1.0, 0.0), None)], inv_tau)
    none_kept = total_max <= NEG
    return (jnp.where(none_kept, -jnp.inf, total_max * inv_tau),
            jnp.where(none_kept, 0.0, total_sum))


# --- backward ----------------------------------------------------------------------------

def softmax_terms(raw, neg_ref, coef_sum, coef_shifted, *, scale):
    """(2^d, the per-element coefficient) of a [64, width] float32 tile of raw logits, d =
    (x - m) log2(e) (`neg_ref` = -m log2(e), `scale` = log2(e) / tau): the gradient is
    2^d * coefficient plus the target's term (and the kept softmax's, with a mask). The
    coefficient is coef_sum + coef_shifted * d with entropy (`coef_shifted` not None).
    Also the fused head's backward epilogue (`linear_mosaic.backward_logits`)."""
    shape = raw.shape
    d = raw * scale + _per_col(neg_ref, shape)
    coef = _per_col(coef_sum, shape)
    if coef_shifted is not None:
        coef = coef + _per_col(coef_shifted, shape) * d
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

    vectors = [_neg_reference(finite_or_zero(max_logit)), coefs.coef_sum * inv_tau]
    if coefs.coef_shifted is not None:
        vectors.append(coefs.coef_shifted * (inv_tau * _LN2))
    vectors.append(coefs.coef_target * inv_tau)
    if masked_max is not None:
        vectors += [_neg_reference(finite_or_zero(masked_max)), coefs.coef_masked * inv_tau]
    vectors = jnp.stack([v.astype(jnp.float32) for v in vectors])
    return jnp.pad(vectors, [(0, 0), (0, padded - vectors.shape[1])])


def _backward_kernel(*refs, num_vocab, inv_tau, entropy, masked, config, itemsize,
                     num_vectors, prologue=None, write_through=False):
    """`prologue`: None reads the targets and the coefficient vectors computed by
    `backward_logits`; else `prologue(refs, rows)` -> (target, vectors, dlogits_ref,
    grad_smem) computes them in the kernel from whatever `refs` it was given
    (`mosaic_direct.py`). `write_through`: the gradient goes to an input buffer (the
    ref after the vectors) and the output is a `[padded]` ready-token (see
    `backward_logits`)."""
    refs = list(refs)
    logits_ref = refs.pop(0)
    mask_ref = refs.pop(0) if masked else None
    block_v = config.block_v
    stages = config.num_stages
    row_block = lax.axis_index("rows")
    chunk = lax.axis_index("chunks")
    tiles, _, per_chunk = _chunking(num_vocab, block_v, config.chunk_v)
    first_tile, _ = _chunk_start(chunk, tiles, per_chunk)
    rows = pl.ds(row_block * _ROWS, _ROWS)
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
        vectors = [_read(vectors_smem.at[i], _rows_layout(), config)
                   for i in range(num_vectors)]
    else:
        target, vectors, dlogits_ref, grad_smem = prologue(refs, rows)
    neg_ref, coef_sum = vectors.pop(0), vectors.pop(0)
    coef_shifted = vectors.pop(0) if entropy else None
    coef_target = vectors.pop(0)
    if masked:
        masked_neg_ref, coef_masked = vectors
    scale = inv_tau * _LOG2E
    shape = (_ROWS, block_v)
    wgmma = plgpu.Layout.WGMMA
    transforms, read_logits, mask_transforms, read_mask = _operand_tiles(
        logits_ref, num_vocab, itemsize, block_v, masked, config)

    def step(indices, *tile_refs, shared_exp=False):
        (j,) = indices
        if masked:
            logits_smem, mask_smem = tile_refs
        else:
            (logits_smem,) = tile_refs
        cols = (first_tile + j) * block_v + _layout(
            lax.broadcasted_iota(jnp.int32, shape, 1), wgmma, config)
        # Columns past V_loc are never stored (TMA clips them): no vocabulary mask.
        raw = jnp.maximum(read_logits(logits_smem).astype(jnp.float32), _EXCLUDED)
        exp_d, coef = softmax_terms(raw, neg_ref, coef_sum, coef_shifted, scale=scale)
        onehot = cols == _per_col(target, shape)
        if masked:
            kept = read_mask(mask_smem) | onehot
            # The kept softmax from the row's exponential (exact where the kept maximum
            # is near the row maximum) ...
            grad = exp_d * (coef + jnp.where(kept, _per_col(coef_shared, shape), 0.0))
            if not shared_exp:
                # ... and from its own exponential in the rows where it is not. The
                # other rows keep the expression above, bit for bit.
                far_rows = _per_col(far_flag, shape) != 0.0
                masked_exp = jnp.exp2(raw * scale + _per_col(masked_neg_ref, shape))
                far_grad = exp_d * coef + jnp.where(
                    kept, masked_exp * _per_col(coef_masked, shape), 0.0)
                grad = jnp.where(far_rows, far_grad, grad)
        else:
            grad = exp_d * coef
        grad = grad + jnp.where(onehot, _per_col(coef_target, shape), 0.0)
        # The gradient's own ring of `stages` SMEM slots: the slot written now was
        # last stored stages steps ago; wait until that TMA store has read it.
        # (Not emit_pipeline's out_specs: their predicated stores have no rule in
        # the 0.10 interpreter.)
        slot = lax.rem(j, jnp.int32(stages))
        plgpu.wait_smem_to_gmem(stages - 1, wait_read_only=True)
        _write(grad_smem.at[slot], grad.astype(grad_smem.dtype), config,
               tiled=bool(transforms))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            grad_smem.at[slot],
            dlogits_ref.at[pl.ds(row_block * _ROWS, _ROWS),
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
        # factor where the kept maximum is within _SHARED_EXP_GAP of the row maximum
        # (rows that keep nothing have coef_masked 0); a block with a row farther off
        # takes the body with a second exponential (CTA-uniform choice), used by the far
        # rows only (batch invariance).
        gap = masked_neg_ref - neg_ref  # (m - kept m) * log2(e) >= 0
        coef_shared = coef_masked * jnp.exp2(jnp.minimum(gap, _SHARED_EXP_GAP))
        zero = _row_vector(0.0, jnp.float32, config)
        far = (gap > _SHARED_EXP_GAP) & (coef_masked != 0.0)
        far_flag = jnp.where(far, zero + 1.0, zero)  # float: broadcast along the row
        lax.cond(_any_row(far, zero),
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
    that lowers a store into an input (`STORES_INTO_INPUTS`)."""
    return (STORES_INTO_INPUTS and not (config is not None and config.interpret)
            and logits.shape[0] > 0
            and mosaic_supported(logits.shape[-1], logits.dtype.itemsize,
                                 keep_mask is not None))


def backward_logits(logits, local_targets, keep_mask, max_logit, masked_max,
                    coefs: BackwardCoefs, *, inv_tau,
                    config: MosaicConfig | None = None, into=None,
                    out_dtype=None) -> jax.Array:
    """d loss / d logits `[T, V_loc]` in the logits' dtype (see `contract.py`); another
    `out_dtype` is a rounding of that after the kernel (the kernel stores through SMEM
    tiles of the logits' dtype), not a narrower store as in `pallas_gpu`.

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
    if not mosaic_supported(num_vocab, itemsize, masked) or num_tokens == 0:
        if num_tokens:
            _warn_fallback(f"logits [{num_tokens}, {num_vocab}] {logits.dtype}")
        from jaxops import xla

        return xla.backward_logits(logits, local_targets, _mask_bool(keep_mask), max_logit,
                                   masked_max, coefs, inv_tau=inv_tau)
    config = mosaic_defaults(config or MosaicConfig(), itemsize=itemsize, masked=masked,
                             backward=True)
    inv_tau = float(inv_tau)
    entropy = coefs.coef_shifted is not None
    _, chunks, per_chunk = _chunking(num_vocab, config.block_v, config.chunk_v)
    row_blocks = pl.cdiv(num_tokens, _ROWS)
    padded = row_blocks * _ROWS

    vectors = backward_vectors(max_logit, masked_max if masked else None, coefs, inv_tau,
                               padded)
    target = padded_targets(local_targets, num_vocab, padded)
    num_vectors = vectors.shape[0]
    # The interpreter cannot clip out-of-bounds TMA stores as the GPU does: there the
    # gradient is computed into a tile-aligned array and sliced.
    out_shape = ((padded, chunks * per_chunk * config.block_v) if config.interpret
                 else logits.shape)
    operands = ([logits] + ([_mask_bytes(keep_mask, in_place=not config.interpret)] if masked
                           else []) + [target, vectors] + ([] if into is None else [into]))
    out_type = ((out_shape, logits.dtype) if into is None else ((padded,), jnp.float32))
    kernel = plgpu.kernel(
        functools.partial(_backward_kernel, num_vocab=num_vocab, inv_tau=inv_tau,
                          entropy=entropy, masked=masked, config=config, itemsize=itemsize,
                          num_vectors=num_vectors, write_through=into is not None),
        out_type=varying_struct(*out_type, *operands, max_logit,
                                *[c for c in coefs if c is not None]),
        scratch_types=[target_smem(wide=False),
                       plgpu.SMEM((num_vectors, _ROWS), jnp.float32),
                       plgpu.SMEM((config.num_stages, _ROWS, config.block_v), logits.dtype,
                                  transforms=_transforms(num_tokens, num_vocab, itemsize,
                                                         config.block_v)),
                       # num_barriers explicit: its default is 1 (a [1] ref) in
                       # 0.10 and () (a scalar ref) in 0.11.
                       plgpu.Barrier(num_arrivals=2, num_barriers=1)],
        grid=(row_blocks, chunks),
        grid_names=("rows", "chunks"),
        compiler_params=_compiler_params(config),
        interpret=_interpret_params() if config.interpret else False,
    )
    dlogits = kernel(*operands)
    if into is not None:
        return dlogits[:num_tokens]
    return dlogits[:num_tokens, :num_vocab] if config.interpret else dlogits
