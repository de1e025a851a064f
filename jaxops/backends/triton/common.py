"""What the Triton kernels share: tile loading, the online-softmax update, launch
specs, and the check that the lowering indexes large operands safely.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxops.backends.triton import offsets
from jaxops.backends.triton.config import PallasConfig
from jaxops.contract import NEG



# Excluded entries (-inf logits, padding, masked-out columns) are clamped to
# EXCLUDED, strictly below the running max's start value NEG: while a row has
# seen nothing real (max = NEG), their exponent is still ~ -1e30, never ~0, so
# no sum counts them, whatever the rounding of the 1e30-sized FMA.
EXCLUDED = 2 * NEG


LOG2E = 1.4426950408889634


LN2 = 0.6931471805599453


def exp2(x, config: PallasConfig):
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


def tile_loader(logits_ref, mask_ref, block_v, num_vocab):
    """`load(start, bounded) -> (stored logits, keep mask or None)` for `stream_tiles`."""
    def load(start, bounded):
        stored = _load_tile(logits_ref, start, block_v, num_vocab, bounded)
        keep = (None if mask_ref is None
                else _load_keep(mask_ref, start, block_v, num_vocab, bounded))
        return stored, keep

    return load


def widen(stored):
    """fp32 logits clamped at EXCLUDED (-inf and padding -> EXCLUDED).

    The kernels work on raw logits and apply 1/tau and log2(e) inside one FMA
    per element: exp(x - m) = exp2(raw * (log2e / tau) - m * log2e).
    """
    return jnp.maximum(stored.astype(jnp.float32), EXCLUDED)


def _load_keep(mask_ref, start, block_v, num_vocab, bounded: bool):
    cols = start + jnp.arange(block_v, dtype=jnp.int32)
    if bounded:
        return plt.load(mask_ref.at[cols], mask=cols < num_vocab, other=False)
    return plt.load(mask_ref.at[cols])


def stream_tiles(load, fold, acc, *, num_vocab, block_v, prefetch):
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


def online_update(row_max, sum_vec, shifted_vec, masked_vec, raw, keep, inv_tau, config):
    """Fold one tile into the row's accumulators.

    Accumulators: the scalar raw max m and per-lane vectors of sum 2^d, sum 2^d d
    and (with `keep`) the kept tokens' sum 2^d, where d = (x - m) * log2(e) for the
    running max m; the vectors are rescaled when m grows. `shifted_vec` and
    `masked_vec` may be None (not tracked). With `config.scalar_sums` the three
    sums are scalars and each tile is reduced before it is added.
    """
    new_max = jnp.maximum(row_max, jnp.max(raw))
    scale = inv_tau * LOG2E
    d = raw * scale + neg_reference(new_max * inv_tau)
    exp_d = exp2(d, config)
    tile_sum = exp_d
    tile_shifted = None if shifted_vec is None else exp_d * d
    tile_kept = None if keep is None else jnp.where(keep, exp_d, 0.0)
    if config.scalar_sums:
        tile_sum, tile_shifted, tile_kept = (
            None if t is None else jnp.sum(t) for t in (tile_sum, tile_shifted, tile_kept))

    def rescaled():
        d_old = (row_max - new_max) * scale
        rescale = exp2(d_old, config)
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


def neg_reference(max_x):
    """-m * log2(e) for a row max m in units of x; forward and backward share these bits."""
    return -(max_x * LOG2E)


def row_spec():
    return pl.BlockSpec((None,), lambda i: (i,))


def matrix_spec(num_vocab):
    return pl.BlockSpec((None, num_vocab), lambda i: (i, 0))


def triton_compiler_params(config: PallasConfig):
    return plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)


def indexes_safely(config: PallasConfig, *operands) -> bool:
    """False where the Triton lowering would index an operand with wrapping 32-bit
    offsets (see `offsets.py`; the registry then sends the call to the XLA backend);
    interpret mode indexes in XLA, always safely."""
    return config.interpret or offsets.large_byte_operands_ok(*operands)


def require_safe_indexing(config: PallasConfig, *operands) -> None:
    """Before lowering a kernel: install the lowering's 64-bit offsets where `operands`
    need them (`offsets.py`). Raises where this JAX cannot be corrected; the registry
    sends those calls to the XLA backend before they get here (`registry.kernels`)."""
    if not indexes_safely(config, *operands):
        raise ValueError(
            "this JAX's Pallas Triton lowering would index a 2**31+-element bool operand "
            "with 32-bit offsets; call the kernels through jaxops.backends.registry.kernels, "
            "which computes such calls with the XLA backend")
