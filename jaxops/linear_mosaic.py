"""The fused head's forward statistics in one Mosaic GPU kernel (Hopper and newer, issue 13).

`forward_stats(hidden [T, H], weight [V_loc, H], local_targets [T])` returns the
`LocalStats` of the logits `hidden @ weight.T` (fp32 accumulation) without storing them,
not even one chunk: each CTA (64 rows, one warpgroup, one chunk of `chunk_v` vocabulary
columns) computes a [64, block_n] logits tile with wgmma, accumulating over H in
block_k steps through a TMA pipeline (hidden tile and weight tile in SMEM, the weight
tile read transposed), and folds the fp32 accumulator straight into its rows' running
statistics (`pallas_mosaic.fold_tile`, the update the statistics kernel applies to a
loaded tile). The target's logit is summed in the kernel. Per-chunk partials are folded
over the chunks as `pallas_mosaic.forward_stats` folds its own (`row_statistics`).

Used by `linear.linear_logprob_entropy` for its forward where `applies` says so: no keep
mask, bf16/fp16, T a multiple of 8, H of 64, T <= MAX_FUSED_TOKENS and `hidden` within
MAX_HIDDEN_BYTES. The backward stays chunked (`linear.chunked_backward`).

The grid is (chunks, row blocks), row blocks fastest: the CTAs resident at one time
work on one chunk of the weight, which L2 then serves to all of them. Each CTA re-reads
its rows of `hidden` per column tile, which costs little only while the resident CTAs
span all of T. Forward ms on the H200 (benchmarks/NOTES.md, session 16;
`benchmarks/fused_head_probe.py`), V = 151,936 bf16, this kernel / the chunked forward /
the bf16 GEMM alone: T = 512, H = 4096: 0.98 / 1.82 / 0.95; T = 1024, H = 4096: 1.84 /
2.73 / 1.67; T = 2048, H = 8192: 6.88 / 8.60 / 6.41; T = 4096, H = 4096: 7.2 / 8.8 / 6.2;
T = 4096, H = 8192: 15.1 / 16.6 / 15.0; T = 8192, H = 4096: 17.2 / 17.1 / 14.6;
T = 16,384, H = 4096: 35.6 / 32.3 / 28.3; T = 16,384, H = 8192: 69.4 / 64.4 / 58.1.
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

from jaxops import pallas_mosaic as pm
from jaxops.contract import NEG, LocalStats, varying_struct
from jaxops.pallas_config import MosaicConfig

_ROWS = 64  # rows per CTA: the M extent of one warpgroup's wgmma
# Where the fused forward is used: measured faster than the chunked one up to T = 4096
# (hidden up to 64 MiB), even at T = 8192, slower at T = 16,384 (module docstring).
MAX_FUSED_TOKENS = 4096
MAX_HIDDEN_BYTES = 64 * 2**20
# Tile and pipeline defaults, from the probe's sweep at T = H = 4096 (ms): block_n 256 /
# block_k 64 / 4 stages 7.2; 5 stages 7.5; 3 stages 9.5; block_n 128 8.7-11.4; chunk_v
# 4096 7.3, 8192 7.5. block_n 256 with 4 stages fills 160 KiB of SMEM: one CTA per SM.
BLOCK_N, BLOCK_K, NUM_STAGES, CHUNK_V = 256, 64, 4, 2048


def applies(num_tokens: int, hidden_size: int, num_vocab: int, dtype, masked: bool) -> bool:
    """Whether the fused forward takes this call's shapes (the caller checks that the
    Mosaic GPU backend is wanted and runs here)."""
    return (not masked and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and 0 < num_tokens <= MAX_FUSED_TOKENS and num_tokens % 8 == 0
            and hidden_size % BLOCK_K == 0 and num_vocab % 8 == 0
            and num_tokens * hidden_size * jnp.dtype(dtype).itemsize <= MAX_HIDDEN_BYTES)


def forward_stats(hidden, weight, local_targets, *, inv_tau: float, with_entropy: bool,
                  interpret: bool = False, block_n: int = BLOCK_N, block_k: int = BLOCK_K,
                  chunk_v: int = CHUNK_V, num_stages: int = NUM_STAGES,
                  grid_order: str = "chunks,rows", row_group: int | None = None
                  ) -> LocalStats:
    """`LocalStats` of logits = hidden @ weight.T (fp32 accumulation), no keep mask.

    hidden `[T, H]`, weight `[V_loc, H]` (bf16 or fp16, T a multiple of 8, H of block_k),
    local_targets `[T]` int32 shard-local ids (outside [0, V_loc): not on this shard).
    `grid_order` "rows,chunks" exists for the probe's comparison only (see above).
    `row_group` (a multiple of 64; tuning, for the probe: not measured yet): one kernel
    launch per group of that many rows. A row's statistics need no other row, and the
    64-row blocks are the same, so the results are bitwise those of one launch.

    In interpret mode (CPU tests) the tile comes from a jnp dot instead of wgmma: the
    interpreter's wgmma takes no transposed operand. The CPU thus checks the tiling, the
    chunking and the statistics; the wgmma path is checked on the GPU."""
    num_tokens, hidden_size = hidden.shape
    num_vocab = weight.shape[0]
    if row_group is not None and num_tokens > row_group:
        if row_group % _ROWS:
            raise ValueError(f"row_group must be a multiple of {_ROWS}, got {row_group}")
        parts = [forward_stats(hidden[start:start + row_group], weight,
                               local_targets[start:start + row_group], inv_tau=inv_tau,
                               with_entropy=with_entropy, interpret=interpret,
                               block_n=block_n, block_k=block_k, chunk_v=chunk_v,
                               num_stages=num_stages, grid_order=grid_order)
                 for start in range(0, num_tokens, row_group)]
        return jax.tree.map(lambda *groups: jnp.concatenate(groups), *parts)
    if hidden_size % block_k or num_tokens % 8:
        raise ValueError(f"fused forward: T % 8 and H % {block_k} must be 0, got hidden "
                         f"{hidden.shape}")
    itemsize = hidden.dtype.itemsize
    config = MosaicConfig(block_v=block_n, chunk_v=chunk_v, num_stages=num_stages,
                          interpret=interpret)
    tiles, chunks, per_chunk = pm._chunking(num_vocab, block_n, chunk_v)
    k_steps = hidden_size // block_k
    row_blocks = pl.cdiv(num_tokens, _ROWS)
    padded = row_blocks * _ROWS
    swizzle = min(128, block_k * itemsize)  # 64 bf16 columns: a 128-byte swizzle
    transforms = (plgpu.TilingTransform((8, swizzle // itemsize)),
                  plgpu.SwizzleTransform(swizzle))
    inv_tau = float(inv_tau)
    num_out = 3 + with_entropy  # max, sum[, shifted], target logit
    grid_names = tuple(grid_order.split(","))
    if sorted(grid_names) != ["chunks", "rows"]:
        raise ValueError(f"grid_order must name rows and chunks, got {grid_order!r}")

    def kernel(h_ref, w_ref, t_ref, *refs):
        out_refs, smem_refs = refs[:num_out], refs[num_out:2 * num_out]
        target_smem, barrier = refs[2 * num_out:]
        row_block = lax.axis_index("rows")
        chunk = lax.axis_index("chunks")
        first_tile, first_owned = pm._chunk_start(chunk, tiles, per_chunk)
        pm.copy_targets(t_ref, pl.ds(row_block * _ROWS, _ROWS), target_smem, barrier.at[0],
                        False)
        plgpu.barrier_wait(barrier.at[0])
        target = pm.read_targets(target_smem, False, config)
        shape = (_ROWS, block_n)

        def stats_update(j, acc, stats):
            row_max, sum_exp, shifted, target_sum = stats
            cols = (first_tile + j) * block_n + pm._layout(
                lax.broadcasted_iota(jnp.int32, shape, 1), plgpu.Layout.WGMMA, config)
            # Tiles shared with the previous chunk and columns past V_loc (zero-filled
            # by TMA on the GPU, NaN in the interpreter) are left out.
            in_vocab = (cols >= first_owned * block_n) & (cols < num_vocab)
            row_max, sum_exp, shifted, _, _ = pm.fold_tile(
                jnp.where(in_vocab, acc, pm._EXCLUDED), row_max, sum_exp, shifted,
                inv_tau=inv_tau)
            hit = (cols == pm._per_col(target, shape)) & in_vocab
            target_sum = target_sum + jnp.where(hit, acc, 0.0).sum(axis=1)
            return row_max, sum_exp, shifted, target_sum

        # delay_release=1: a step's SMEM slots are reused one step later, so the wgmma
        # that reads them may still be in flight when the step returns (wgmma_wait(1)).
        def in_specs(j):
            return [plgpu.BlockSpec((_ROWS, block_k), lambda k: (row_block, k),
                                    transforms=transforms, delay_release=1),
                    plgpu.BlockSpec((block_n, block_k), lambda k: (first_tile + j, k),
                                    transforms=transforms, delay_release=1)]

        def column_tile_interpret(j, stats):
            def k_step(indices, h_smem, w_smem, acc):
                return acc + lax.dot_general(
                    h_smem[...].astype(jnp.float32), w_smem[...].astype(jnp.float32),
                    (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

            acc = plgpu.emit_pipeline(k_step, grid=(k_steps,), in_specs=in_specs(j),
                                      max_concurrent_steps=num_stages,
                                      init_carry=jnp.zeros(shape, jnp.float32))(h_ref, w_ref)
            return stats_update(j, acc, stats)

        def column_tile(j, stats):
            def logits_tile(acc_ref):
                def k_step(indices, h_smem, w_smem):
                    plgpu.wgmma(acc_ref, h_smem, w_smem.transpose((1, 0)))
                    plgpu.wgmma_wait(1)

                plgpu.emit_pipeline(k_step, grid=(k_steps,), in_specs=in_specs(j),
                                    max_concurrent_steps=num_stages)(h_ref, w_ref)
                plgpu.wgmma_wait(0)
                return acc_ref[...]

            acc = pl.run_scoped(logits_tile, plgpu.ACC(shape, jnp.float32))
            return stats_update(j, acc, stats)

        neg = pm._row_vector(NEG, jnp.float32, config)
        zero = pm._row_vector(0.0, jnp.float32, config)
        stats = (neg, zero, zero if with_entropy else None, zero)
        stats = lax.fori_loop(0, per_chunk,
                              column_tile_interpret if interpret else column_tile, stats)
        results = [s for s in stats if s is not None]
        rows = pl.ds(row_block * _ROWS, _ROWS)
        for smem, value in zip(smem_refs, results):
            smem[...] = value
        plgpu.commit_smem()
        for smem, out in zip(smem_refs, out_refs):
            plgpu.copy_smem_to_gmem(smem, out.at[chunk, rows])
        plgpu.wait_smem_to_gmem(0)

    part = varying_struct((chunks, padded), jnp.float32, hidden, weight, local_targets)
    call = plgpu.kernel(
        kernel, out_type=[part] * num_out,
        scratch_types=[plgpu.SMEM((_ROWS,), jnp.float32)] * num_out
        + [pm.target_smem(False), plgpu.Barrier(num_arrivals=1, num_barriers=1)],
        grid=tuple(dict(rows=row_blocks, chunks=chunks)[n] for n in grid_names),
        grid_names=grid_names,
        compiler_params=pm._compiler_params(config),
        interpret=pm._interpret_params() if interpret else False)
    on_shard = (local_targets >= 0) & (local_targets < num_vocab)
    targets = jnp.pad(jnp.where(on_shard, local_targets, -1).astype(jnp.int32),
                      (0, padded - num_tokens))
    outs = [o[:, :num_tokens] for o in call(hidden, weight, targets)]
    shifted = outs[2] if with_entropy else None
    # One chunk at most holds a row's target (the others add 0): the sum is exact.
    target_raw = outs[-1].sum(axis=0)
    max_logit, sum_exp, sum_exp_shifted = pm.row_statistics(outs[0], outs[1], shifted,
                                                            inv_tau)
    return LocalStats(max_logit, sum_exp, sum_exp_shifted,
                      jnp.where(on_shard, target_raw * inv_tau, 0.0), None, None)
