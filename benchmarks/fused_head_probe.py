"""PROTOTYPE, not used by the package and never run on a GPU yet (issue 13): the LM head's
forward statistics in one Mosaic GPU kernel.

    python -m benchmarks.fused_head_probe          # CPU: interpret mode against XLA, tiny shapes
    python -m benchmarks.fused_head_probe --gpu    # H200: against XLA and timed next to the
                                                   # bf16 GEMM and the chunked op's forward

logits tile = hidden[64 rows, H] @ weight[block_n cols, H]^T accumulated by wgmma over H in
block_k steps; the accumulator (fp32, WGMMA layout) goes straight into the online
statistics update that pallas_mosaic._forward_kernel applies to a loaded logits tile.
No [T, V] or [T, chunk] array in HBM: per chunk of columns, partial (max, sum[, shifted],
target logit) per row, combined as pallas_mosaic.forward_stats combines its partials.

Per CTA (64 rows, one warpgroup, one chunk of vocabulary columns): for each column tile a
scoped accumulator and a pipeline over H (the hidden tile (row block, k) and the weight
tile (column tile, k) through SMEM, one wgmma in flight), then the tile's statistics. No
mask, no backward; T, V_loc multiples of 8, H of block_k. Known to cost: the pipeline
restarts per column tile, the hidden tiles are re-read per column tile (from L2), and one
warpgroup both issues the MMAs and runs the statistics (NOTES, session 7 and 15: the
structure a fast version needs). The interpreter's wgmma takes no transposed operand, so
interpret mode computes the tile with a jnp dot instead: on the CPU this checks the
tiling, the chunking and the statistics, not the wgmma call.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run by path: see benchmarks/__init__.py
    import os, sys  # noqa: E401
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxops import pallas_mosaic as pm
from jaxops.contract import NEG, LocalStats

_ROWS = 64


def fused_forward_stats(hidden, weight, local_targets, *, inv_tau, with_entropy,
                        block_n=128, block_k=64, chunk_v=2048, num_stages=4,
                        interpret=False):
    """LocalStats of logits = hidden @ weight.T (fp32 accumulation), no mask.

    hidden [T, H], weight [V_loc, H] (bf16/fp16), local_targets [T] int32."""
    num_tokens, hidden_size = hidden.shape
    num_vocab = weight.shape[0]
    assert hidden_size % block_k == 0 and num_tokens % 8 == 0 and num_vocab % 8 == 0
    itemsize = hidden.dtype.itemsize
    config = pm.MosaicConfig(block_v=block_n, chunk_v=chunk_v, num_stages=num_stages,
                             interpret=interpret)
    tiles, chunks, per_chunk = pm._chunking(num_vocab, block_n, chunk_v)
    k_steps = hidden_size // block_k
    row_blocks = pl.cdiv(num_tokens, _ROWS)
    padded = row_blocks * _ROWS
    swizzle = block_k * itemsize  # 64 bf16 columns: a 128-byte swizzle
    transforms = (plgpu.TilingTransform((8, block_k)), plgpu.SwizzleTransform(swizzle))
    inv_tau = float(inv_tau)
    num_out = 3 + with_entropy  # max, sum[, shifted], target

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
        wgmma_layout = plgpu.Layout.WGMMA

        def stats_update(j, acc, stats):
            row_max, sum_exp, shifted, target_sum = stats
            cols = (first_tile + j) * block_n + pm._layout(
                lax.broadcasted_iota(jnp.int32, shape, 1), wgmma_layout, config)
            in_vocab = (cols >= first_owned * block_n) & (cols < num_vocab)
            row_max, sum_exp, shifted, _, _ = pm.fold_tile(
                jnp.where(in_vocab, acc, pm._EXCLUDED), row_max, sum_exp, shifted,
                inv_tau=inv_tau)
            hit = (cols == pm._per_col(target, shape)) & in_vocab
            target_sum = target_sum + jnp.where(hit, acc, 0.0).sum(axis=1)
            return row_max, sum_exp, shifted, target_sum

        # delay_release=1: a step's SMEM slots are reused one step later, so the wgmma
        # that reads them may still be in flight when the step returns (wgmma_wait(1)).
        in_specs = lambda j: [  # noqa: E731
            plgpu.BlockSpec((_ROWS, block_k), lambda k: (row_block, k), transforms=transforms,
                            delay_release=1),
            plgpu.BlockSpec((block_n, block_k), lambda k: (first_tile + j, k),
                            transforms=transforms, delay_release=1)]

        def column_tile_interpret(j, stats):
            # The interpreter's wgmma takes no transposed operand: the same products in
            # a jnp dot (fp32 accumulation, another order).
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
                    plgpu.wgmma(acc_ref, h_smem, plgpu.transpose_ref(w_smem, (1, 0)))
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

    part = jax.ShapeDtypeStruct((chunks, padded), jnp.float32)
    call = plgpu.kernel(
        kernel, out_type=[part] * num_out,
        scratch_types=[plgpu.SMEM((_ROWS,), jnp.float32)] * num_out
        + [pm.target_smem(False), plgpu.Barrier(num_arrivals=1, num_barriers=1)],
        grid=(row_blocks, chunks), grid_names=("rows", "chunks"),
        compiler_params=pm._compiler_params(config),
        interpret=pm._interpret_params() if interpret else False)
    on_shard = (local_targets >= 0) & (local_targets < num_vocab)
    targets = jnp.pad(jnp.where(on_shard, local_targets, -1).astype(jnp.int32),
                      (0, padded - num_tokens))
    outs = [o[:, :num_tokens] for o in call(hidden, weight, targets)]
    row_max, sum_exp = outs[0], outs[1]
    shifted = outs[2] if with_entropy else None
    target_raw = outs[-1].sum(axis=0)
    max_logit, sum_exp, sum_exp_shifted = pm.row_statistics(row_max, sum_exp, shifted,
                                                            inv_tau)
    return LocalStats(max_logit, sum_exp, sum_exp_shifted,
                      jnp.where(on_shard, target_raw * inv_tau, 0.0), None, None)


def main(argv=None):
    import argparse

    import numpy as np

    from jaxops import xla

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true")
    args = parser.parse_args(argv)
    interpret = not args.gpu
    T, H, V = (128, 128, 1000) if interpret else (4096, 4096, 151936)
    k = jax.random.split(jax.random.key(0), 3)
    h = (jax.random.normal(k[0], (T, H), jnp.float32) * 0.5).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (V, H), jnp.float32) / 8).astype(jnp.bfloat16)
    y = jax.random.randint(k[2], (T,), 0, V).astype(jnp.int32)
    tau = 0.7
    got = jax.jit(functools.partial(fused_forward_stats, inv_tau=1 / tau, with_entropy=True,
                                    interpret=interpret, chunk_v=256 if interpret else 2048))(
        h, w, y)
    logits = jnp.dot(h, w.T, preferred_element_type=jnp.float32)
    want = xla.forward_stats(logits, y, None, inv_tau=1 / tau, with_entropy=True)
    worst = 0.0
    for name in ("max_logit", "sum_exp", "sum_exp_shifted", "target_logit"):
        a, b = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        err = float(np.max(np.abs(a - b) / (np.abs(b) + 1e-6)))
        worst = max(worst, err)
        print(f"{name}: max relative error {err:.2e}", flush=True)
    if interpret:
        return 0 if worst < 1e-4 else 1

    import jaxops
    from benchmarks import harness

    def ms(fn, *args):  # one warm-up call, then 5 calls back to back: mean per call
        return harness.time_calls(fn, (args,), reps=1, calls=5,
                                  sync=harness.block_jax).seconds * 1e3

    print("bf16 GEMM ms", ms(jax.jit(lambda h, w: jnp.dot(h, w.T)), h, w), flush=True)
    print("chunked forward ms", ms(jax.jit(lambda h, w, y: jaxops.linear_logprob_entropy(
        h, w, y, temperature=tau)), h, w, y), flush=True)
    for block_n in (128, 64, 256):
        f = jax.jit(functools.partial(fused_forward_stats, inv_tau=1 / tau,
                                      with_entropy=True, block_n=block_n))
        print(f"fused forward block_n={block_n} ms", ms(f, h, w, y), flush=True)
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
