"""Mosaic GPU kernels that carry a row's whole computation, for launching without XLA.

The bridge's *direct route* (`bridge/_direct.py`) launches these kernels on torch's
default stream (with a launcher built from `plgpu.as_torch_kernel`'s pieces), with
torch-allocated buffers and no JAX runtime in between (issue 12 item 4: the JAX runtime's dispatch, imports and exports
cost more host time per call than the whole torch-only floor). A launcher accepts
only a function made of one Mosaic GPU kernel, so everything the JAX route does
around `pallas_mosaic`'s kernels in XLA happens inside kernels here:

    forward   partials  = `mosaic.forward.statistics_kernel(with_target=True)`:
                          per vocabulary chunk: max, sum[, shifted][, kept max, kept
                          sum], the target's raw logit[, its mask bit]      [C, padded]
                          (or, `gathered_target`, without the target's: the caller
                          gathers them and hands them to finish)
              finish    = one CTA per 64 rows: fold the chunks in index order (as
                          `mosaic.forward.combine_partials`), then the combine of one shard
                          (`combine.combine` at R = 1): log_prob, entropy, and the
                          backward's per-row multipliers ("saved")           [padded]
              or, where V_loc is one chunk (`one_pass`), `forward_kernel`: the
                          partials kernel going on with finish's math in the same
                          CTA -- one launch instead of two
    backward  gradient  = `mosaic.backward.gradient_kernel` whose prologue forms the
                          coefficients from the saved multipliers and the incoming
                          d log_prob / d entropy, and stores d logits through a
                          buffer passed in as an *input* (torch's gradient: the
                          launcher would otherwise allocate a fresh output)

One vocabulary shard only (R = 1): the multi-rank bridge keeps the JAX route. The
saved multipliers are the VJP of `combine.combine` at R = 1 written out (d log_prob
and d entropy enter linearly), so the backward needs no other statistics:

    coef_sum     = g_lp * alpha + g_H * beta     alpha = -w [valid] / S     (no mask)
    coef_shifted = g_H * gamma                   beta  = w (1/S + A/S^2) + gamma
    coef_target  = g_lp * [valid]                gamma = -w / S
    coef_masked  = g_lp * delta                  delta = -w_m [valid] / S_m  (mask)

with S, A the row's sum of exp(x - m) and of exp(x - m)(x - m), S_m the masked sum,
w = [the row has a finite logit], w_m = [it keeps one], as in `combine.py`; with a mask,
[valid] is 0 where the kept set is the target alone (`combine.combine`'s point mass).

O(T) operands are separate 1-D arrays (a [K, b] array's rows would need b * 4 to be a
multiple of 16 bytes for TMA); outputs are `padded` = 64 * ceil(b / 64) long.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxops.backends.mosaic.backward import gradient_kernel
from jaxops.backends.mosaic import common as mosaic_common
from jaxops.backends.mosaic.common import (EXCLUDED, LN2, ROWS, copy_targets,
                                           interpret_params, mosaic_compiler_params,
                                           neg_reference, read_targets, read_tile,
                                           row_vector, rows_layout, target_smem,
                                           tile_transforms, vocab_chunks, write_tile)
from jaxops.backends.mosaic.config import MosaicConfig, mosaic_defaults, mosaic_supported
from jaxops.backends.mosaic.forward import (combine_partials, num_partials,
                                            statistics_kernel)
from jaxops.contract import NEG


def supported(num_vocab: int, itemsize: int, masked: bool) -> bool:
    """Shapes the kernels take (`mosaic.config.mosaic_supported`), on a JAX that lowers
    their stores into the caller's buffers (`mosaic_common.STORES_INTO_INPUTS`)."""
    return mosaic_common.STORES_INTO_INPUTS and mosaic_supported(num_vocab, itemsize, masked)


def saved_names(with_entropy: bool, masked: bool) -> tuple[str, ...]:
    """The per-row multipliers `finish` saves for the backward, in order (the entropy's
    whether or not the backward will use them: entropy_grad is the backward's choice)."""
    names = ["neg_ref", "valid"]
    names += ["masked_neg_ref", "delta"] if masked else ["alpha"]
    names += ["beta", "gamma"] if with_entropy else []
    return tuple(names)


def padded_rows(num_tokens: int) -> int:
    """Rows of every O(T) buffer the kernels read or write: whole 64-row blocks."""
    return pl.cdiv(num_tokens, ROWS) * ROWS


def layout(num_tokens: int, num_vocab: int, dtype, *, masked: bool, with_entropy: bool,
           gathered_target: bool = False, config: MosaicConfig | None = None) -> dict:
    """The buffers' sizes, for a caller that allocates them: vocabulary chunks,
    padded rows, partials (each [chunks, padded]) and finish outputs (each [padded])."""
    itemsize = jnp.dtype(dtype).itemsize
    config, _ = _configs(itemsize, masked, config)
    _, chunks, _ = vocab_chunks(num_vocab, config.block_v, config.chunk_v)
    return dict(chunks=chunks, padded=padded_rows(num_tokens),
                num_partials=num_partials(with_entropy, masked,
                                             with_target=not gathered_target),
                num_finish=1 + with_entropy + len(saved_names(with_entropy, masked)))


def _configs(itemsize, masked, config):
    config = config or MosaicConfig()
    return (mosaic_defaults(config, itemsize=itemsize, masked=masked, backward=False),
            mosaic_defaults(config, itemsize=itemsize, masked=masked, backward=True))


def _interpret(config):
    return interpret_params() if config.interpret else False


# --- forward: partial statistics per chunk ----------------------------------------------

def partials_kernel(num_tokens, num_vocab, dtype, *, masked, with_entropy, inv_tau,
                    gathered_target: bool = False, wide_targets: bool = False,
                    config: MosaicConfig | None = None):
    """fn(logits [b, V], (mask uint8 [b, V]), (targets int32 [b])) -> partials, each
    float32 [C, padded] (`mosaic.forward.num_partials` of them). `wide_targets`: the
    targets are int64 ids as their int32 words, [2b] (`mosaic.common.read_targets`).

    gathered_target: the caller gathers the target's logit (and mask bit) itself and
    hands them to `finish`; then this kernel takes no targets and does no per-element
    target test (which costs ~20% of an instruction-bound kernel at large T * V)."""
    with_target = not gathered_target
    itemsize = jnp.dtype(dtype).itemsize
    sizes = layout(num_tokens, num_vocab, dtype, masked=masked, with_entropy=with_entropy,
                   gathered_target=gathered_target, config=config)
    chunks, padded, num_out = sizes["chunks"], sizes["padded"], sizes["num_partials"]
    config, _ = _configs(itemsize, masked, config)
    return plgpu.kernel(
        functools.partial(statistics_kernel, num_vocab=num_vocab, inv_tau=float(inv_tau),
                          with_entropy=with_entropy, masked=masked, config=config,
                          itemsize=itemsize, with_target=with_target,
                          wide_targets=wide_targets),
        out_type=[jax.ShapeDtypeStruct((chunks, padded), jnp.float32)] * num_out,
        scratch_types=([plgpu.SMEM((ROWS,), jnp.float32)] * num_out
                       + ([target_smem(wide_targets),
                           plgpu.Barrier(num_arrivals=1, num_barriers=1)] if with_target
                          else [])),
        grid=(padded // ROWS, chunks),
        grid_names=("rows", "chunks"),
        compiler_params=mosaic_compiler_params(config),
        interpret=_interpret(config),
    )


# --- forward in one kernel: a vocabulary of one chunk ----------------------------------

def one_pass(num_vocab: int, dtype, masked: bool, config: MosaicConfig | None = None) -> bool:
    """Whether V_loc is one vocabulary chunk (`mosaic.common.vocab_chunks`: up to 2048-3072
    columns at the default chunk_v, 4096-6144 with a mask), so that `forward_kernel` does the partials' and
    finish's work in one launch."""
    config, _ = _configs(jnp.dtype(dtype).itemsize, masked, config)
    return vocab_chunks(num_vocab, config.block_v, config.chunk_v)[1] == 1


def forward_kernel(num_tokens, num_vocab, dtype, *, masked, with_entropy, inv_tau,
                   wide_targets: bool = False, config: MosaicConfig | None = None):
    """`one_pass` vocabularies: fn(logits [b, V], (mask uint8 [b, V]), targets int32 [b]
    (`wide_targets`: [2b], as in `partials_kernel`)) -> (log_prob, [entropy], *saved),
    float32 [padded]: `partials_kernel` whose CTA,
    holding its rows' whole vocabulary, goes on with `finish`'s math (one launch less;
    the same arithmetic, so the same bits)."""
    sizes = layout(num_tokens, num_vocab, dtype, masked=masked, with_entropy=with_entropy,
                   config=config)
    padded, num_out = sizes["padded"], sizes["num_finish"]
    itemsize = jnp.dtype(dtype).itemsize
    config, _ = _configs(itemsize, masked, config)
    if not one_pass(num_vocab, dtype, masked, config):
        raise ValueError(f"forward_kernel needs a vocabulary of one chunk (chunk_v = "
                         f"{config.chunk_v}); V_loc = {num_vocab} has more: use "
                         f"partials_kernel and finish_kernel")
    names = saved_names(with_entropy, masked)

    def finish(partials, target):
        log_prob, entropy, saved = _finish_rows(
            [[p] for p in partials], target, chunks=1, num_vocab=num_vocab,
            inv_tau=float(inv_tau), with_entropy=with_entropy, masked=masked,
            one=row_vector(1.0, jnp.float32, config))
        return [log_prob] + ([entropy] if with_entropy else []) + [saved[n] for n in names]

    return plgpu.kernel(
        functools.partial(statistics_kernel, num_vocab=num_vocab, inv_tau=float(inv_tau),
                          with_entropy=with_entropy, masked=masked, config=config,
                          itemsize=itemsize, with_target=True, wide_targets=wide_targets,
                          epilogue=(finish, num_out)),
        out_type=[jax.ShapeDtypeStruct((padded,), jnp.float32)] * num_out,
        scratch_types=([plgpu.SMEM((ROWS,), jnp.float32)] * num_out
                       + [target_smem(wide_targets),
                          plgpu.Barrier(num_arrivals=1, num_barriers=1)]),
        grid=(padded // ROWS, 1),
        grid_names=("rows", "chunks"),
        compiler_params=mosaic_compiler_params(config),
        interpret=_interpret(config),
    )


# --- forward: fold the chunks, combine, outputs and saved multipliers --------------------

def _finish_rows(parts, target, *, chunks, num_vocab, inv_tau, with_entropy, masked, one):
    """Per-row math of `finish` on [64]-row vectors. `parts[k][c]`: partial k of chunk c;
    `one`: a float32 vector of ones (where(c, 1.0, 0.0) would be float64 under x64).
    Returns (log_prob, entropy or None, {saved name: vector})."""
    parts = list(parts)
    maxes, sums = parts.pop(0), parts.pop(0)
    shifts = parts.pop(0) if with_entropy else [None] * chunks
    if masked:
        kept_maxes, kept_sums = parts.pop(0), parts.pop(0)
    target_parts = parts.pop(0)
    row_max, sum_exp, shifted = combine_partials(list(zip(maxes, sums, shifts)), inv_tau)
    target_raw = functools.reduce(lambda a, b: a + b, target_parts)

    empty = row_max <= NEG  # no finite logit in this row
    max_x = jnp.where(empty, -jnp.inf, row_max * inv_tau)
    sum_exp = jnp.where(empty, 0.0, sum_exp)
    valid = (target >= 0) & (target < num_vocab)
    target_x = jnp.where(valid, target_raw * inv_tau, 0.0)
    # combine.combine at R = 1: the shard's weight is 1 where it has a finite logit.
    weight = jnp.where(empty, 0.0, one)
    total_sum = weight * sum_exp
    log_sum_exp = jnp.log(total_sum)
    valid_f = jnp.where(valid, one, 0.0)
    saved = {"neg_ref": neg_reference(jnp.where(empty, 0.0, max_x)), "valid": valid_f}

    if masked:
        target_kept = functools.reduce(lambda a, b: a + b, parts.pop(0))
        kept_max, kept_sum, _ = combine_partials(
            [(m, s, None) for m, s in zip(kept_maxes, kept_sums)], inv_tau)
        # The target always counts as kept: fold it in where its mask bit is off.
        target_alone = valid & (target_kept == 0.0)
        target_ref = jnp.where(target_alone, jnp.maximum(target_raw, EXCLUDED),
                               EXCLUDED)
        total_max, kept_total, _ = combine_partials(
            [(kept_max, kept_sum, None),
             (target_ref, jnp.where(target_alone, one, 0.0), None)], inv_tau)
        none_kept = total_max <= NEG
        masked_max = jnp.where(none_kept, -jnp.inf, total_max * inv_tau)
        masked_weight = jnp.where(none_kept, 0.0, one)
        masked_sum = masked_weight * jnp.where(none_kept, 0.0, kept_total)
        normaliser = masked_max + jnp.log(masked_sum)
        saved["masked_neg_ref"] = neg_reference(jnp.where(none_kept, 0.0, masked_max))
        # As `combine.combine`: where the kept set is the target alone (to fp32), log_prob
        # is 0 for all nearby logits and has no gradient.
        point_mass = (target_x == masked_max) & (masked_sum == 1.0)
        saved["valid"] = jnp.where(point_mass, 0.0, valid_f)
        saved["delta"] = masked_weight * (-saved["valid"] / masked_sum)
    else:
        normaliser = max_x + log_sum_exp
        saved["alpha"] = weight * (-valid_f / total_sum)
    log_prob = jnp.where(valid, target_x - normaliser, jnp.nan)

    entropy = None
    if with_entropy:
        total_shifted = weight * jnp.where(empty, 0.0, shifted * LN2)
        entropy = log_sum_exp - total_shifted / total_sum
        inv_sum = 1.0 / total_sum
        gamma = -weight * inv_sum
        saved["gamma"] = gamma
        saved["beta"] = weight * (inv_sum + total_shifted * inv_sum * inv_sum) + gamma
    return log_prob, entropy, saved


def _finish_kernel(*refs, chunks, num_vocab, inv_tau, with_entropy, masked, config,
                   gathered_target, wide_targets):
    num_parts = num_partials(with_entropy, masked, with_target=not gathered_target)
    num_gathered = gathered_target * (1 + masked)  # target logit[, its mask bit], [b]
    names = saved_names(with_entropy, masked)
    num_out = 1 + with_entropy + len(names)
    refs = list(refs)
    part_refs = [refs.pop(0) for _ in range(num_parts)]
    target_ref = refs.pop(0)
    gathered_refs = [refs.pop(0) for _ in range(num_gathered)]
    out_refs = [refs.pop(0) for _ in range(num_out)]
    part_smems = [refs.pop(0) for _ in range(num_parts)]
    target_smem = refs.pop(0)
    gathered_smems = [refs.pop(0) for _ in range(num_gathered)]
    out_smems = [refs.pop(0) for _ in range(num_out)]
    (barrier,) = refs
    rows = pl.ds(lax.axis_index("rows") * ROWS, ROWS)
    for ref, smem in zip(part_refs, part_smems):
        plgpu.copy_gmem_to_smem(ref.at[:, rows], smem, barrier.at[0])
    copy_targets(target_ref, rows, target_smem, barrier.at[0], wide_targets)
    for ref, smem in zip(gathered_refs, gathered_smems):
        plgpu.copy_gmem_to_smem(ref.at[rows], smem, barrier.at[0])
    plgpu.barrier_wait(barrier.at[0])
    layout = rows_layout()
    parts = [[read_tile(smem.at[c], layout, config) for c in range(chunks)]
             for smem in part_smems]
    # The gathered values stand where the partials would hold them: one "chunk" each.
    parts += [[read_tile(smem, layout, config)] for smem in gathered_smems]
    target = read_targets(target_smem, wide_targets, config)
    log_prob, entropy, saved = _finish_rows(
        parts, target, chunks=chunks, num_vocab=num_vocab, inv_tau=inv_tau,
        with_entropy=with_entropy, masked=masked,
        one=row_vector(1.0, jnp.float32, config))
    values = [log_prob] + ([entropy] if with_entropy else []) + [saved[n] for n in names]
    for smem, value in zip(out_smems, values):
        write_tile(smem, value, config)
    plgpu.commit_smem()
    for smem, out in zip(out_smems, out_refs):
        plgpu.copy_smem_to_gmem(smem, out.at[rows])
    plgpu.wait_smem_to_gmem(0)


def finish_kernel(num_tokens, num_vocab, dtype, *, masked, with_entropy, inv_tau,
                  gathered_target: bool = False, wide_targets: bool = False,
                  config: MosaicConfig | None = None):
    """fn(*partials, targets int32 [b][, target logit f32 [b][, its mask bit f32 [b]]])
    -> (log_prob, [entropy], *saved), float32 [padded]. The bracketed inputs with
    `gathered_target` (the target's raw logit, and 1.0 where its mask bit is set);
    `wide_targets`: targets [2b] as in `partials_kernel`."""
    sizes = layout(num_tokens, num_vocab, dtype, masked=masked, with_entropy=with_entropy,
                   gathered_target=gathered_target, config=config)
    chunks, padded = sizes["chunks"], sizes["padded"]
    num_parts, num_out = sizes["num_partials"], sizes["num_finish"]
    num_gathered = gathered_target * (1 + masked)
    config, _ = _configs(jnp.dtype(dtype).itemsize, masked, config)
    vector = jax.ShapeDtypeStruct((padded,), jnp.float32)
    return plgpu.kernel(
        functools.partial(_finish_kernel, chunks=chunks, num_vocab=num_vocab,
                          inv_tau=float(inv_tau), with_entropy=with_entropy, masked=masked,
                          config=config, gathered_target=gathered_target,
                          wide_targets=wide_targets),
        out_type=[vector] * num_out,
        scratch_types=([plgpu.SMEM((chunks, ROWS), jnp.float32)] * num_parts
                       + [target_smem(wide_targets)]
                       + [plgpu.SMEM((ROWS,), jnp.float32)] * (num_gathered + num_out)
                       + [plgpu.Barrier(num_arrivals=num_parts + 1 + num_gathered,
                                        num_barriers=1)]),
        grid=(padded // ROWS,),
        grid_names=("rows",),
        compiler_params=mosaic_compiler_params(config),
        interpret=_interpret(config),
    )


# --- backward ----------------------------------------------------------------------------

def _coefficient_prologue(refs, rows, *, names, has_d_log_prob, has_d_entropy, entropy,
                          masked, inv_tau, config, into, wide_targets):
    """The backward's per-row vectors from the saved multipliers and d log_prob / d
    entropy, in `mosaic.backward.gradient_kernel`'s order and units."""
    num_in = 1 + len(names) + has_d_log_prob + has_d_entropy
    in_refs, dlogits_ref = refs[:num_in], refs[num_in]
    first = num_in + 1 + into  # into: the unused placeholder output follows
    smems = refs[first:first + num_in]
    grad_smem, barrier = refs[first + num_in:]
    copy_targets(in_refs[0], rows, smems[0], barrier.at[0], wide_targets)
    for ref, smem in zip(in_refs[1:], smems[1:]):
        plgpu.copy_gmem_to_smem(ref.at[rows], smem, barrier.at[0])
    plgpu.barrier_wait(barrier.at[0])
    layout = rows_layout()
    target = read_targets(smems[0], wide_targets, config)
    values = [read_tile(smem, layout, config) for smem in smems[1:]]
    saved = {n: values.pop(0) for n in names}
    d_log_prob = values.pop(0) if has_d_log_prob else None
    d_entropy = values.pop(0) if has_d_entropy else None

    zero = row_vector(0.0, jnp.float32, config)
    coef_sum = zero
    if d_log_prob is not None and not masked:
        coef_sum = d_log_prob * saved["alpha"]
    if entropy:
        coef_sum = coef_sum + d_entropy * saved["beta"]
    vectors = [saved["neg_ref"], coef_sum * inv_tau]
    if entropy:
        vectors.append(d_entropy * saved["gamma"] * (inv_tau * LN2))
    vectors.append(zero if d_log_prob is None else d_log_prob * saved["valid"] * inv_tau)
    if masked:
        vectors += [saved["masked_neg_ref"],
                    zero if d_log_prob is None else d_log_prob * saved["delta"] * inv_tau]
    return target, vectors, dlogits_ref, grad_smem


def backward_kernel(num_tokens, num_vocab, dtype, *, masked, with_entropy, entropy_grad,
                    has_d_log_prob, has_d_entropy, inv_tau, wide_targets: bool = False,
                    config: MosaicConfig | None = None, into: bool = True):
    """d loss / d logits of the rows.

    into=True (the launcher's form): fn(logits, (mask), targets, *saved, (d_log_prob),
    (d_entropy), grad [b, V]) stores the gradient through `grad`, an *input* (the
    launcher passes pointers; nothing else reads it), and returns a placeholder
    int32 [1] that the kernel never writes (a kernel without outputs is dropped by
    `jit` before the launcher can find it).
    into=False (for JAX, tests): the same operands without `grad`; returns it."""
    itemsize = jnp.dtype(dtype).itemsize
    _, config = _configs(itemsize, masked, config)
    has_d_entropy = has_d_entropy and with_entropy and entropy_grad
    entropy = has_d_entropy
    names = saved_names(with_entropy, masked)
    _, chunks, per_chunk = vocab_chunks(num_vocab, config.block_v, config.chunk_v)
    padded = padded_rows(num_tokens)
    num_vectors = 3 + entropy + 2 * masked
    num_in = 1 + len(names) + has_d_log_prob + has_d_entropy
    prologue = functools.partial(
        _coefficient_prologue, names=names, has_d_log_prob=has_d_log_prob,
        has_d_entropy=has_d_entropy, entropy=entropy, masked=masked, inv_tau=float(inv_tau),
        config=config, into=into, wide_targets=wide_targets)
    # The interpreter cannot clip out-of-bounds TMA stores as the GPU does.
    grad_shape = ((padded, chunks * per_chunk * config.block_v) if config.interpret
                  else (num_tokens, num_vocab))
    scratch = ([target_smem(wide_targets)]
               + [plgpu.SMEM((ROWS,), jnp.float32)] * (num_in - 1)
               + [plgpu.SMEM((config.num_stages, ROWS, config.block_v), dtype,
                             transforms=tile_transforms(num_tokens, num_vocab, itemsize,
                                                       config.block_v)),
                  plgpu.Barrier(num_arrivals=num_in, num_barriers=1)])
    return plgpu.kernel(
        functools.partial(gradient_kernel, num_vocab=num_vocab, inv_tau=float(inv_tau),
                          entropy=entropy, masked=masked, config=config, itemsize=itemsize,
                          num_vectors=num_vectors, prologue=prologue),
        out_type=jax.ShapeDtypeStruct((1,), jnp.int32) if into
        else jax.ShapeDtypeStruct(grad_shape, dtype),
        scratch_types=scratch,
        grid=(padded // ROWS, chunks),
        grid_names=("rows", "chunks"),
        compiler_params=mosaic_compiler_params(config),
        interpret=_interpret(config),
    )
