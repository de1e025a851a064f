"""The fused head's Mosaic GPU kernels (Hopper and newer, issue 13): the forward statistics
and the backward's d logits, each computing its logits tiles with wgmma, never storing
the logits.

`forward_stats(hidden [T, H], weight [V_loc, H], local_targets [T])` returns the
`LocalStats` of the logits `hidden @ weight.T` (fp32 accumulation) without storing them,
not even one chunk: each CTA (64 rows, one warpgroup, one chunk of `chunk_v` vocabulary
columns) computes a [64, block_n] logits tile with wgmma, accumulating over H in
block_k steps through a TMA pipeline (hidden tile and weight tile in SMEM, the weight
tile read transposed; `_logits_tile`), and folds the fp32 accumulator straight into its
rows' running statistics (`mosaic.forward.fold_tile`, the update the statistics kernel
applies to a loaded tile). The target's logit is summed in the kernel. Per-chunk
partials are folded over the chunks as `mosaic.forward.forward_stats` folds its own
(`row_statistics`). Beyond MAX_ONE_LAUNCH_TOKENS rows: one launch per ROW_GROUP rows.

`backward_logits(hidden, weight_c [C, H], ...)` returns d logits `[T, C]` (bf16/fp16)
for one chunk of the backward (`linear.chunked_backward`): the same logits tiles, the
statistics kernels' gradient arithmetic on them in registers
(`mosaic.backward.softmax_terms`), stored through SMEM with TMA. It replaces the chunk's
fp32 logits GEMM and the statistics kernel's pass over them.

`linear.linear_logprob_entropy` takes both where `applies` says so (bf16/fp16, T a
multiple of 8, H of 64, V_loc of 8), the backward only up to
MAX_FUSED_BACKWARD_TOKENS rows and with chunks of a multiple of 8 columns (16 with a mask). Both also
take a keep mask (V_loc a multiple of 16 then; `MASKED` switches that off).

The grid is (chunks, row blocks), row blocks fastest: the CTAs resident at one time
work on one chunk of the weight, which L2 then serves to all of them. Each CTA re-reads
its rows of `hidden` per column tile, which costs little only while the resident CTAs
span enough of T (hence the row groups). Forward ms on the H200, V = 151,936 bf16,
this kernel / the chunked forward / the bf16 GEMM alone (docs/performance.md, "The fused
LM head"): T = 512, H = 4096: 0.98 / 1.82 / 0.95; T = 1024,
H = 4096: 1.84 / 2.73 / 1.67; T = 2048, H = 8192: 6.88 / 8.60 / 6.41; T = 4096,
H = 4096: 7.2 / 8.8 / 6.2; T = 4096, H = 8192: 15.1 / 16.6 / 15.0; in row groups of 2048
(one launch in brackets): T = 8192, H = 4096: 15.3 (17.6) / 17.5 / 13.8; T = 16,384,
H = 4096: 32.4 (36.8) / 33.9 / 29.1; T = 16,384, H = 8192: 64.1 (72.3) / 65.2 / 60.7.
With the grid the other way round, T = H = 4096 took 17.4 ms: every row block re-read
the whole weight from HBM (93% of its bandwidth, 25% L2 hits).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxops.backends.mosaic.backward import backward_vectors, padded_targets, softmax_terms
from jaxops.backends.mosaic.common import (EXCLUDED, LOG2E, chunk_start, copy_targets,
                                           interpret_params, mask_bytes, mask_reader,
                                           mosaic_compiler_params, per_col, read_targets,
                                           read_tile, row_vector, rows_layout, target_smem,
                                           tile_transforms, to_layout, vocab_chunks,
                                           write_tile)
from jaxops.backends.mosaic.config import MosaicConfig
from jaxops.backends.mosaic.forward import (fold_tile, forward_stats, kept_statistics,
                                            row_statistics)
from jaxops.contract import NEG, BackwardCoefs, LocalStats, vary_like, varying_struct

_ROWS = 64  # rows per CTA: the M extent of one warpgroup's wgmma
# Up to MAX_ONE_LAUNCH_TOKENS rows the forward is one launch; beyond, one launch per
# ROW_GROUP rows. One launch at T = 16,384, H = 4096 took 36.8 ms (the chunked forward
# 33.9): its resident CTAs span too few rows of a chunk for L2 to keep serving the
# weight. Groups of 2048 rows: 32.4 ms (4096: 33.4); T = 8192: 15.3 (chunked 17.5);
# T = 16,384, H = 8192: 64.1 (65.2). H200; docs/performance.md, "The fused LM head".
MAX_ONE_LAUNCH_TOKENS = 4096
ROW_GROUP = 2048
# Tile and pipeline defaults, from the probe's sweep at T = H = 4096 (ms): block_n 256 /
# block_k 64 / 4 stages 7.2; 5 stages 7.5; 3 stages 9.5; block_n 128 8.7-11.4; chunk_v
# 4096 7.3, 8192 7.5. block_n 256 with 4 stages fills 160 KiB of SMEM: one CTA per SM.
BLOCK_N, BLOCK_K, NUM_STAGES, CHUNK_V = 256, 64, 4, 2048
# The backward's CTAs each cover chunk_v columns of one call's chunk of the vocabulary
# (4096 columns at T = 4096): 512 gives 8 CTAs per row block there. Per 4096-column
# chunk at T = H = 4096 (single calls, host latency included): 2048 0.44 ms, 1024 0.38,
# 512 0.36; the chunked GEMM + statistics kernel 0.47 (docs/performance.md, "The fused
# LM head").
BACKWARD_CHUNK_V = 512
# Where the linear backward takes `backward_logits`: forward+backward at T = 4096, V =
# 151,936 bf16, chunk 4096: H = 4096 34.35 ms (35.24 with the GEMM + statistics
# kernel), H = 8192 67.40 (68.53); at T = 16,384, H = 4096 (chunk 3072) 136.1 (135.3).
MAX_FUSED_BACKWARD_TOKENS = 4096


# Whether `applies` admits a keep mask. On the H200 at T = H = 4096 (docs/performance.md,
# "The fused LM head") the masked fused kernels beat the chunked path: forward 8.83 vs
# 9.24 ms (uint8 mask) and 9.57 vs 9.90 ms (bool), forward+backward 37.5 vs 38.5 ms and
# 38.0 vs 38.5 ms. Off, a masked call takes the chunked path (the benchmark's switch).
MASKED = True


def applies(num_tokens: int, hidden_size: int, num_vocab: int, dtype, masked: bool) -> bool:
    """Whether the fused kernels take this call's shapes (the caller checks that the
    Mosaic GPU backend is wanted and runs here): bf16/fp16, T a multiple of 8 (the
    targets' and d logits' TMA rows), H of BLOCK_K, V_loc of 8 (TMA's 16-byte row stride
    of d logits); with a keep mask only where MASKED, and V_loc of 16 (the uint8 mask's
    16-byte TMA row stride)."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and num_tokens > 0 and num_tokens % 8 == 0
            and hidden_size % BLOCK_K == 0 and num_vocab % 8 == 0
            and (not masked or (MASKED and num_vocab % 16 == 0)))


def _operand_transforms(block_k: int, itemsize: int):
    """SMEM tiling + swizzle of the hidden and weight tiles ([rows, block_k]): 64 bf16
    columns take a 128-byte swizzle."""
    swizzle = min(128, block_k * itemsize)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _logits_tile(h_ref, w_ref, row_block, tile, *, hidden_size: int, block_n: int,
                 block_k: int, num_stages: int, interpret: bool):
    """The fp32 `[64, block_n]` logits tile of rows `row_block` and weight rows `tile`:
    wgmma over H in block_k steps, the hidden and weight tiles streamed through SMEM by a
    TMA pipeline of `num_stages` (the weight tile read transposed). In interpret mode a
    jnp dot: the interpreter's wgmma takes no transposed operand."""
    shape = (_ROWS, block_n)
    transforms = _operand_transforms(block_k, h_ref.dtype.itemsize)
    # delay_release=1: a step's SMEM slots are reused one step later, so the wgmma that
    # reads them may still be in flight when the step returns (wgmma_wait(1)).
    in_specs = [plgpu.BlockSpec((_ROWS, block_k), lambda k: (row_block, k),
                                transforms=transforms, delay_release=1),
                plgpu.BlockSpec((block_n, block_k), lambda k: (tile, k),
                                transforms=transforms, delay_release=1)]
    pipeline = functools.partial(plgpu.emit_pipeline, grid=(hidden_size // block_k,),
                                 in_specs=in_specs, max_concurrent_steps=num_stages)
    if interpret:
        def k_step_interpret(indices, h_smem, w_smem, acc):
            return acc + lax.dot_general(
                h_smem[...].astype(jnp.float32), w_smem[...].astype(jnp.float32),
                (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

        return pipeline(k_step_interpret, init_carry=jnp.zeros(shape, jnp.float32))(
            h_ref, w_ref)

    def scoped(acc_ref):
        def k_step(indices, h_smem, w_smem):
            plgpu.wgmma(acc_ref, h_smem, w_smem.transpose((1, 0)))
            plgpu.wgmma_wait(1)

        pipeline(k_step)(h_ref, w_ref)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    return pl.run_scoped(scoped, plgpu.ACC(shape, jnp.float32))


def _check_operands(hidden, weight, block_k: int, what: str):
    """The shapes TMA and the SMEM tiling need (`applies`), as a clear error: Mosaic
    GPU's own, at lowering, names a tiling rather than the argument."""
    if hidden.shape[1] % block_k or hidden.shape[0] % 8 or weight.shape[0] % 8:
        raise ValueError(f"fused {what}: T % 8, H % {block_k} and the weight's rows % 8 "
                         f"must be 0, got hidden {hidden.shape}, weight {weight.shape}")


def _mask_scratch(block_n: int, transforms):
    """Scratch for the kernels' keep mask: one SMEM slot for a [64, block_n] uint8 mask
    tile and the barrier of its TMA copy (`_start_mask_tile`, `_mask_tile`)."""
    return [plgpu.SMEM((_ROWS, block_n), jnp.uint8, transforms=transforms),
            plgpu.Barrier(num_arrivals=1, num_barriers=1)]


def _start_mask_tile(mask_ref, scratch, row_block, tile, block_n: int):
    """Start the TMA copy of mask tile (`row_block`, `tile`) into the one slot, so that it
    runs under the tile's wgmma loop. The previous tile's reads of the slot are done in
    every warp before TMA overwrites it: commit_smem ends in a warpgroup barrier."""
    mask_smem, barrier = scratch
    plgpu.commit_smem()
    plgpu.copy_gmem_to_smem(
        mask_ref.at[pl.ds(row_block * _ROWS, _ROWS), pl.ds(tile * block_n, block_n)],
        mask_smem, barrier.at[0])


def _mask_tile(scratch, read_mask):
    """The mask tile `_start_mask_tile` copied, as bool [64, block_n] (WGMMA layout)."""
    mask_smem, barrier = scratch
    plgpu.barrier_wait(barrier.at[0])
    return read_mask(mask_smem)


def forward_stats(hidden, weight, local_targets, keep_mask=None, *, inv_tau: float,
                  with_entropy: bool, interpret: bool = False, block_n: int = BLOCK_N,
                  block_k: int = BLOCK_K, chunk_v: int = CHUNK_V,
                  num_stages: int = NUM_STAGES, grid_order: str = "chunks,rows",
                  row_group: int | None = -1) -> LocalStats:
    """`LocalStats` of logits = hidden @ weight.T (fp32 accumulation).

    hidden `[T, H]`, weight `[V_loc, H]` (bf16 or fp16, T a multiple of 8, H of block_k),
    local_targets `[T]` int32 shard-local ids (outside [0, V_loc): not on this shard),
    keep_mask `[T, V_loc]` bool or uint8 (nonzero = kept; V_loc % 16 == 0) or None. With
    a mask, each logits tile's mask tile comes by TMA while its wgmma loop runs, and the
    kept statistics are an online max and sum of their own (`mosaic.forward.fold_tile`
    on the kept columns: a second exponential per element, but no second pass for rows
    whose kept maximum is far below their maximum, as the statistics kernel needs).
    A bool mask costs one XLA pass to bytes per launch (`mosaic.common.mask_bytes`),
    none where `mask_view.ENABLED`.
    `grid_order` "rows,chunks" exists for the probe's comparison only (see above).
    `row_group` (a multiple of 64): one kernel launch per group of that many rows; None:
    one launch; -1 (default): ROW_GROUP rows per launch where T > MAX_ONE_LAUNCH_TOKENS.
    A row's statistics need no other row, and the 64-row blocks are the same, so the
    results are bitwise those of one launch.

    In interpret mode (CPU tests) the tile comes from a jnp dot instead of wgmma: the
    interpreter's wgmma takes no transposed operand. The CPU thus checks the tiling, the
    chunking and the statistics; the wgmma path is checked on the GPU."""
    num_tokens, hidden_size = hidden.shape
    num_vocab = weight.shape[0]
    if row_group == -1:
        row_group = ROW_GROUP if num_tokens > MAX_ONE_LAUNCH_TOKENS else None
    if row_group is not None and num_tokens > row_group:
        if row_group % _ROWS:
            raise ValueError(f"row_group must be a multiple of {_ROWS}, got {row_group}")
        parts = [forward_stats(hidden[start:start + row_group], weight,
                               local_targets[start:start + row_group],
                               None if keep_mask is None
                               else keep_mask[start:start + row_group], inv_tau=inv_tau,
                               with_entropy=with_entropy, interpret=interpret,
                               block_n=block_n, block_k=block_k, chunk_v=chunk_v,
                               num_stages=num_stages, grid_order=grid_order, row_group=None)
                 for start in range(0, num_tokens, row_group)]
        return jax.tree.map(lambda *groups: jnp.concatenate(groups), *parts)
    _check_operands(hidden, weight, block_k, "forward")
    masked = keep_mask is not None
    if masked and num_vocab % 16:
        raise ValueError(f"fused forward: a keep mask needs V_loc % 16 == 0, got {num_vocab}")
    config = MosaicConfig(block_v=block_n, chunk_v=chunk_v, num_stages=num_stages,
                          interpret=interpret)
    tiles, chunks, per_chunk = vocab_chunks(num_vocab, block_n, chunk_v)
    row_blocks = pl.cdiv(num_tokens, _ROWS)
    padded = row_blocks * _ROWS
    tile_fn = functools.partial(_logits_tile, hidden_size=hidden_size, block_n=block_n,
                                block_k=block_k, num_stages=num_stages, interpret=interpret)
    inv_tau = float(inv_tau)
    # max, sum, shifted[, kept max, kept sum], target logit. The kernel sums 2^d d even
    # without the entropy (dropped at the end): on the H200 at T = H = 4096 the kernel
    # without that sum took 9.51 ms against 8.51 with it, and the op's forward without
    # the entropy 9.61 against 8.32 ms with the sum computed and dropped, bitwise the
    # same log-probs (docs/performance.md, "The fused LM head"; why the smaller kernel
    # is slower was not traced).
    num_out = 4 + 2 * masked
    grid_names = tuple(grid_order.split(","))
    if sorted(grid_names) != ["chunks", "rows"]:
        raise ValueError(f"grid_order must name rows and chunks, got {grid_order!r}")
    mask_transforms, read_mask = mask_reader(num_tokens, num_vocab, block_n, masked,
                                                 config)

    def kernel(h_ref, w_ref, t_ref, *refs):
        refs = list(refs)
        m_ref = refs.pop(0) if masked else None
        out_refs, smem_refs = refs[:num_out], refs[num_out:2 * num_out]
        target_smem, barrier, *mask_scratch = refs[2 * num_out:]
        row_block = lax.axis_index("rows")
        chunk = lax.axis_index("chunks")
        first_tile, first_owned = chunk_start(chunk, tiles, per_chunk)
        copy_targets(t_ref, pl.ds(row_block * _ROWS, _ROWS), target_smem, barrier.at[0],
                        False)
        plgpu.barrier_wait(barrier.at[0])
        target = read_targets(target_smem, False, config)
        shape = (_ROWS, block_n)

        def stats_update(j, acc, stats, keep):
            row_max, sum_exp, shifted, kept_max, kept_sum, target_sum = stats
            cols = (first_tile + j) * block_n + to_layout(
                lax.broadcasted_iota(jnp.int32, shape, 1), plgpu.Layout.WGMMA, config)
            # Tiles shared with the previous chunk and columns past V_loc (zero-filled
            # by TMA on the GPU, NaN in the interpreter) are left out.
            in_vocab = (cols >= first_owned * block_n) & (cols < num_vocab)
            raw = jnp.where(in_vocab, acc, EXCLUDED)
            row_max, sum_exp, shifted, _, _ = fold_tile(raw, row_max, sum_exp, shifted,
                                                           inv_tau=inv_tau)
            if keep is not None:
                kept_max, kept_sum, _, _, _ = fold_tile(
                    jnp.where(keep, raw, EXCLUDED), kept_max, kept_sum, None,
                    inv_tau=inv_tau)
            hit = (cols == per_col(target, shape)) & in_vocab
            target_sum = target_sum + jnp.where(hit, acc, 0.0).sum(axis=1)
            return row_max, sum_exp, shifted, kept_max, kept_sum, target_sum

        def column_tile(j, stats):
            tile = first_tile + j
            if masked:
                _start_mask_tile(m_ref, mask_scratch, row_block, tile, block_n)
            acc = tile_fn(h_ref, w_ref, row_block, tile)
            keep = _mask_tile(mask_scratch, read_mask) if masked else None
            return stats_update(j, acc, stats, keep)

        neg = row_vector(NEG, jnp.float32, config)
        zero = row_vector(0.0, jnp.float32, config)
        stats = (neg, zero, zero, neg if masked else None,
                 zero if masked else None, zero)
        stats = lax.fori_loop(0, per_chunk, column_tile, stats)
        results = [s for s in stats if s is not None]
        rows = pl.ds(row_block * _ROWS, _ROWS)
        for smem, value in zip(smem_refs, results):
            write_tile(smem, value, config)
        plgpu.commit_smem()
        for smem, out in zip(smem_refs, out_refs):
            plgpu.copy_smem_to_gmem(smem, out.at[chunk, rows])
        plgpu.wait_smem_to_gmem(0)

    operands = [o for o in (hidden, weight, local_targets, keep_mask) if o is not None]
    part = varying_struct((chunks, padded), jnp.float32, *operands)
    mask_scratch = _mask_scratch(block_n, mask_transforms) if masked else []
    call = plgpu.kernel(
        kernel, out_type=[part] * num_out,
        scratch_types=[plgpu.SMEM((_ROWS,), jnp.float32)] * num_out
        + [target_smem(False), plgpu.Barrier(num_arrivals=1, num_barriers=1)]
        + mask_scratch,
        grid=tuple(dict(rows=row_blocks, chunks=chunks)[n] for n in grid_names),
        grid_names=grid_names,
        compiler_params=mosaic_compiler_params(config),
        interpret=interpret_params() if interpret else False)
    on_shard = (local_targets >= 0) & (local_targets < num_vocab)
    targets = padded_targets(local_targets, num_vocab, padded)
    outs = [vary_like(o[:, :num_tokens], *operands)
            for o in call(hidden, weight, targets,
                          *([mask_bytes(keep_mask, in_place=not interpret)] if masked
                            else []))]
    row_max, sum_exp = outs.pop(0), outs.pop(0)
    shifted = outs.pop(0)
    # One chunk at most holds a row's target (the others add 0): the sum is exact.
    target_raw = outs.pop().sum(axis=0)
    max_logit, sum_exp, sum_exp_shifted = row_statistics(row_max, sum_exp, shifted,
                                                            inv_tau)
    masked_max = masked_sum_exp = None
    if masked:
        safe_target = jnp.where(on_shard, local_targets, 0).astype(jnp.int32)
        masked_max, masked_sum_exp = kept_statistics(
            *outs, target_raw, keep_mask, safe_target, on_shard, inv_tau)
    return LocalStats(max_logit, sum_exp, sum_exp_shifted if with_entropy else None,
                      jnp.where(on_shard, target_raw * inv_tau, 0.0), masked_max,
                      masked_sum_exp)


def backward_logits(hidden, weight, local_targets, max_logit, coefs: BackwardCoefs,
                    keep_mask=None, masked_max=None, *, inv_tau: float, out_dtype=None,
                    interpret: bool = False, block_n: int = BLOCK_N, block_k: int = BLOCK_K,
                    chunk_v: int = BACKWARD_CHUNK_V, num_stages: int = NUM_STAGES
                    ) -> jax.Array:
    """d loss / d logits `[T, V_loc]` of logits = hidden @ weight.T, with the logits
    recomputed in the kernel: each CTA computes a [64, block_n] fp32 logits tile with
    wgmma (as `forward_stats`), forms its gradient in registers
    (`mosaic.backward.softmax_terms`, the statistics kernels' backward arithmetic) and
    stores it rounded to `out_dtype` (default: hidden's dtype) through SMEM with TMA. No
    fp32 logits in HBM. The linear backward calls it per vocabulary chunk
    (`linear.chunked_backward`).

    hidden `[T, H]`, weight `[V_loc, H]` (bf16/fp16, T % 8 == 0, H % block_k == 0),
    local_targets `[T]` shard-local ids, max_logit `[T]` (units of logits / tau),
    coefs `[T]` each (`contract.BackwardCoefs`). With keep_mask `[T, V_loc]` (bool or
    uint8, V_loc % 16 == 0), masked_max `[T]` and coefs.coef_masked: the kept softmax's
    term, from an exponential of its own (relative to masked_max) in every row, where the
    statistics kernel shares the row's exponential except in far rows."""
    _check_operands(hidden, weight, block_k, "backward")
    masked = keep_mask is not None
    if masked != (coefs.coef_masked is not None) or masked != (masked_max is not None):
        raise ValueError("mosaic.linear.backward_logits: keep_mask, masked_max and "
                         "coefs.coef_masked go together")
    if masked and weight.shape[0] % 16:
        raise ValueError(f"fused backward: a keep mask needs V_loc % 16 == 0, got "
                         f"{weight.shape[0]}")
    num_tokens, hidden_size = hidden.shape
    num_vocab = weight.shape[0]
    out_dtype = jnp.dtype(out_dtype or hidden.dtype)
    config = MosaicConfig(block_v=block_n, chunk_v=chunk_v, num_stages=num_stages,
                          interpret=interpret)
    tiles, chunks, per_chunk = vocab_chunks(num_vocab, block_n, chunk_v)
    row_blocks = pl.cdiv(num_tokens, _ROWS)
    padded = row_blocks * _ROWS
    inv_tau = float(inv_tau)
    scale = inv_tau * LOG2E
    entropy = coefs.coef_shifted is not None
    vectors = backward_vectors(max_logit, masked_max, coefs, inv_tau, padded)
    num_vectors = vectors.shape[0]
    tile_fn = functools.partial(_logits_tile, hidden_size=hidden_size, block_n=block_n,
                                block_k=block_k, num_stages=num_stages, interpret=interpret)
    shape = (_ROWS, block_n)
    mask_transforms, read_mask = mask_reader(num_tokens, num_vocab, block_n, masked,
                                                 config)
    grad_transforms = tile_transforms(num_tokens, num_vocab, out_dtype.itemsize, block_n)

    def kernel(h_ref, w_ref, t_ref, vectors_ref, *refs):
        refs = list(refs)
        m_ref = refs.pop(0) if masked else None
        out_ref, target_smem, vectors_smem, grad_smem, barrier, *mask_scratch = refs
        row_block = lax.axis_index("rows")
        first_tile, _ = chunk_start(lax.axis_index("chunks"), tiles, per_chunk)
        rows = pl.ds(row_block * _ROWS, _ROWS)
        copy_targets(t_ref, rows, target_smem, barrier.at[0], False)
        plgpu.copy_gmem_to_smem(vectors_ref.at[:, rows], vectors_smem, barrier.at[0])
        plgpu.barrier_wait(barrier.at[0])
        target = read_targets(target_smem, False, config)
        neg_ref, coef_sum, *rest = [read_tile(vectors_smem.at[i], rows_layout(), config)
                                    for i in range(num_vectors)]
        coef_shifted = rest.pop(0) if entropy else None
        coef_target = rest.pop(0)
        if masked:
            masked_neg_ref, coef_masked = rest

        def column_tile(j, carry):
            tile = first_tile + j
            if masked:
                _start_mask_tile(m_ref, mask_scratch, row_block, tile, block_n)
            raw = tile_fn(h_ref, w_ref, row_block, tile)
            cols = tile * block_n + to_layout(
                lax.broadcasted_iota(jnp.int32, shape, 1), plgpu.Layout.WGMMA, config)
            exp_d, coef = softmax_terms(raw, neg_ref, coef_sum, coef_shifted, scale=scale)
            grad = exp_d * coef
            onehot = cols == per_col(target, shape)
            grad = grad + jnp.where(onehot, per_col(coef_target, shape), 0.0)
            if masked:
                # the target always counts as kept
                kept = _mask_tile(mask_scratch, read_mask) | onehot
                kept_exp = jnp.exp2(raw * scale + per_col(masked_neg_ref, shape))
                grad = grad + jnp.where(kept, kept_exp * per_col(coef_masked, shape),
                                        0.0)
            # One SMEM slot: the previous tile's TMA store has had this tile's whole
            # wgmma loop to read it. Columns past V_loc (and rows past T) are clipped
            # by the store on the GPU; the interpreter gets a padded output instead.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            write_tile(grad_smem, grad.astype(out_dtype), config,
                      tiled=bool(grad_transforms))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(grad_smem, out_ref.at[rows, pl.ds(tile * block_n,
                                                                      block_n)])
            return carry

        lax.fori_loop(0, per_chunk, column_tile, 0)
        plgpu.wait_smem_to_gmem(0)

    targets = padded_targets(local_targets, num_vocab, padded)
    out_shape = (padded, tiles * block_n) if interpret else (num_tokens, num_vocab)
    operands = (hidden, weight, targets, vectors) + (
        (mask_bytes(keep_mask, in_place=not interpret),) if masked else ())
    mask_scratch = _mask_scratch(block_n, mask_transforms) if masked else []
    call = plgpu.kernel(
        kernel, out_type=varying_struct(out_shape, out_dtype, *operands, max_logit,
                                        *[c for c in coefs if c is not None]),
        scratch_types=[target_smem(False), plgpu.SMEM((num_vectors, _ROWS), jnp.float32),
                       plgpu.SMEM(shape, out_dtype, transforms=grad_transforms),
                       plgpu.Barrier(num_arrivals=2, num_barriers=1)] + mask_scratch,
        grid=(chunks, row_blocks), grid_names=("chunks", "rows"),
        compiler_params=mosaic_compiler_params(config),
        interpret=interpret_params() if interpret else False)
    d_logits = vary_like(call(*operands), *operands, max_logit,
                         *[c for c in coefs if c is not None])
    return d_logits[:num_tokens, :num_vocab] if interpret else d_logits
