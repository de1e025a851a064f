"""What the Mosaic GPU kernels share: constants, the version shims, moving tiles and
targets, and how the vocabulary is cut into chunks. See `forward.py` for the kernels.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxops.backends.mosaic import mask_view
from jaxops.backends.mosaic.config import MosaicConfig, mosaic_rows_tile
from jaxops.contract import NEG, ids_from_words


ROWS = 64  # rows per CTA: the M extent of the WGMMA register layout
EXCLUDED = 2 * NEG  # as in backends/triton/kernels.py: strictly below the running max's start NEG
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# With a keep mask, the kept logits' sum shares the row's exponential (relative to the
# row maximum) while the kept maximum is at most this far below it, in log2 units. The
# terms that underflow there (below 2^-126) are below 2^-62 of the kept maximum's own
# term: over 2^20 columns still far below float32's epsilon.
SHARED_EXP_GAP = 64.0


# --- version shims (jax 0.10.2, 0.11.2 and 0.12.1 checked) ------------------------------

# jax 0.12 refuses a kernel that stores into an input passed as an array (it wants a
# Ref, or the input aliased to an output); 0.10 and 0.11 lower it. The kernels that store
# into a buffer their caller owns -- the in-place gradient (`backward_logits(into=)`) and
# the bridge's direct route (`mosaic_direct`) -- are therefore used up to 0.11 only;
# from 0.12 the gradient is JAX's and the bridge goes through JAX (docs/bridge.md).
STORES_INTO_INPUTS = tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 12)


def interpret_params():
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


def mosaic_compiler_params(config: MosaicConfig):
    # Lane semantics pinned: the default changed from Lane (0.10) to Warpgroup (0.11);
    # the layouts below are chosen explicitly, which is what Lane semantics means.
    return plgpu.CompilerParams(approx_math=config.approx_math,
                                lowering_semantics=plgpu.LoweringSemantics.Lane)


def to_layout(x, layout, config: MosaicConfig):
    # The 0.10 interpreter has no rule for layout_cast; layouts mean nothing there.
    return x if config.interpret else plgpu.layout_cast(x, layout)


def read_tile(ref, layout, config: MosaicConfig):
    """A whole SMEM (or GMEM) ref as a register array in `layout`.

    `ref[...]` immediately followed by a layout cast is how the Lane lowering
    learns the layout to load in (`plgpu.load` has no interpret rule in 0.10 and
    deprecates its index argument in 0.11)."""
    return to_layout(ref[...], layout, config)


def _read_unoptimized(ref, layout, config: MosaicConfig):
    """As `read_tile`, allowing a load with shared-memory bank conflicts (the mask tile
    where V_loc admits no swizzle, see `tile_transforms`)."""
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


def write_tile(ref, value, config: MosaicConfig, *, tiled: bool = False):
    """`ref[...] = value` into SMEM, a ref without tiling transforms (row vectors, the
    untiled tiles of `tile_transforms`) allowing bank conflicts, as jax 0.10 and 0.11 store
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
        return lambda ref: read_tile(ref, plgpu.Layout.WGMMA, config)
    return lambda ref: _read_unoptimized(ref, plgpu.Layout.WGMMA, config)


def mask_reader(num_tokens: int, num_vocab: int, block_v: int, masked: bool,
                 config: MosaicConfig):
    """(the mask tiles' SMEM transforms, fn reading a mask tile as bool [64, block_v] in
    the WGMMA layout)."""
    transforms = tile_transforms(num_tokens, num_vocab, 1, block_v) if masked else ()
    read = _tile_reader(transforms, config)
    return transforms, lambda ref: read(ref) != 0


def operand_tiles(logits_ref, num_vocab: int, itemsize: int, block_v: int, masked: bool,
                   config: MosaicConfig):
    """(logits tiles' SMEM transforms, fn reading a logits tile, the mask tiles'
    transforms, fn reading a mask tile as bool), for the [T, V_loc] operands of a kernel
    whose logits are `logits_ref`."""
    num_tokens = logits_ref.shape[0]
    transforms = tile_transforms(num_tokens, num_vocab, itemsize, block_v)
    return (transforms, _tile_reader(transforms, config),
            *mask_reader(num_tokens, num_vocab, block_v, masked, config))


def rows_layout():
    return plgpu.Layout.WGMMA.reduce(1)


def target_smem(wide: bool):
    """SMEM for a 64-row block's targets: int32 ids, or (`wide`) the two int32 words of
    each little-endian int64 id, as torch stores them (`mosaic_direct`)."""
    return plgpu.SMEM((ROWS * (2 if wide else 1),), jnp.int32)


def copy_targets(target_ref, rows, smem, barrier, wide: bool):
    """Start the TMA copy of the targets of `rows` (a 64-row `pl.ds`) into
    `target_smem(wide)`."""
    if wide:
        rows = pl.ds(rows.start * 2, 2 * ROWS)
    plgpu.copy_gmem_to_smem(target_ref.at[rows], smem, barrier)


def read_targets(smem, wide: bool, config: MosaicConfig):
    """[64] int32 ids in the rows layout from `target_smem(wide)`; a wide id outside
    [0, 2**31) reads as -1 (`contract.ids_from_words`), which the range test fails."""
    if not wide:
        return read_tile(smem, rows_layout(), config)
    if config.interpret:  # the interpreter has no reshape transform for SMEM refs
        low, high = smem[pl.ds(0, ROWS, stride=2)], smem[pl.ds(1, ROWS, stride=2)]
    else:  # Mosaic GPU lowers no strided slice; a column of the [64, 2] view it does
        words = smem.reshape(ROWS, 2)
        low, high = (to_layout(words[:, k], rows_layout(), config) for k in (0, 1))
    return ids_from_words(low, high)


def row_vector(value, dtype, config):
    return to_layout(jnp.full((ROWS,), value, dtype), rows_layout(), config)


def per_col(row_vec, shape):
    return lax.broadcast_in_dim(row_vec, shape, (0,))


def any_row(flags, zero):
    """Whether any of the block's rows is flagged (`flags`: bool [64] in the rows
    layout; `zero`: a float32 row vector of 0.0): one value for the whole CTA, so a
    branch on it is uniform."""
    return jnp.max(jnp.where(flags, zero + 1.0, zero)) > 0


# --- shapes, tiles, chunks ---------------------------------------------------------------

def tile_transforms(num_tokens: int, num_vocab: int, itemsize: int, block_v: int):
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


def mask_bytes(keep_mask, *, in_place: bool = False):
    """The keep mask as bytes (nonzero = kept) for a kernel operand: Mosaic GPU types
    bool refs as 1-bit (i1), so a bool array cannot be copied with TMA. A bool mask
    costs one pass over it in XLA (T * V_loc bytes read and written) per kernel call,
    unless `in_place` (the operand goes straight into a kernel launched on the GPU, not
    the interpreter) and `mask_view.ENABLED`. Callers that can hand over uint8 masks
    avoid it either way."""
    if keep_mask.dtype in (jnp.uint8, jnp.int8):
        return keep_mask
    if in_place and mask_view.ENABLED:
        return mask_view.bytes_view(keep_mask)
    return keep_mask.astype(jnp.uint8)


def vocab_chunks(num_vocab: int, block_v: int, chunk_v: int):
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


def chunk_start(chunk, tiles: int, per_chunk: int):
    """(first tile this CTA loads, first tile it owns)."""
    owned = chunk * per_chunk
    return jnp.minimum(owned, tiles - per_chunk), owned


def neg_reference(max_x):
    """-m * log2(e) for a row max m in units of x (as backends/triton/kernels.py)."""
    return -(max_x * LOG2E)


