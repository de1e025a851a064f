"""The op fused with the output layer: log-prob and entropy of `hidden @ weight.T`, chunked.

`linear_logprob_entropy` never holds the `[T, V_loc]` logits (or their gradient) for
more than `chunk_size` vocabulary columns at a time (docs/design.md §10). It is the
per-shard statistics of `stats.local_stats`, with the logits computed chunk by chunk
inside the custom VJP:

  forward   for each chunk of columns c: logits_c = hidden @ weight_c.T `[T, C]` (fp32
            accumulation), the implementation's `forward_stats(logits_c)`, merged into
            the running O(T) row statistics (an online log-sum-exp over chunks, the
            same merge as over vocabulary shards). On Hopper+ GPUs, for bf16/fp16 (with
            a keep mask: V_loc % 16 == 0), instead one Mosaic GPU kernel that folds each wgmma tile of
            logits into the statistics in registers (`mosaic_linear.py`; no chunk of
            logits in HBM at all; beyond T = 4096 one launch per 2048 rows).
  backward  for each chunk (the narrower tail chunk first): recompute logits_c,
            `backward_logits` -> d logits_c (on Hopper+, bf16/fp16, T <= 4096:
            both in one Mosaic GPU kernel, `mosaic_linear.backward_logits`), then
            d weight_c = d logits_c^T @ hidden (complete: one GEMM over all T, written
            once) and d hidden += d logits_c @ weight_c (an fp32 `[T, H]` accumulator).

Why chunks of the vocabulary rather than of the tokens: a token chunk re-reads the
whole weight per chunk (V_loc * H, 1.2 GB at V = 151,936, H = 4096) and accumulates
d weight `[V_loc, H]` in fp32 across chunks; a vocabulary chunk re-reads only hidden
(T * H) and accumulates d hidden `[T, H]`, which is V_loc / T times smaller for the
sizes RL runs (H200 measurements in docs/performance.md, "The fused LM head").

Residuals are hidden, weight, targets, mask and the O(T) row maxima (and masked
reference points): nothing `[T, V_loc]`. The chunks' logits stay in fp32, the GEMM's
accumulator: design §2 computes x = logits / tau in fp32 and never rounds it to bf16,
and rounding the logits of bf16 inputs to bf16 would cost |x| * 2^-9 of accuracy,
far beyond §8's 1e-5. The cross-shard combine is `combine.combine`, plain
differentiable JAX around the custom VJP, exactly as in `api.logprob_entropy`.

V_loc is split into full chunks (a `lax.scan`) plus one narrower tail chunk, so
nothing is padded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxops import stats, validate
from jaxops.backends import registry
from jaxops.backends.triton.config import PallasConfig
from jaxops.combine import combine, shard_targets, unflatten
from jaxops.contract import LocalStats, backward_coefs, vary_like
from jaxops.reference import logprob_entropy_reference

# The default chunk: its fp32 logits take at most 1/24 of the bf16 [T, V_loc] logits'
# bytes (the chunk's temporaries -- fp32 logits and bf16 d logits -- then stay under 1/16
# of them, leaving room for the fp32 d hidden accumulator, 2H/V of them), and at least
# MIN_CHUNK_BYTES so that small T still gets wide, efficient GEMMs. 48 MiB gives 3072
# columns at T = 4096: on the H200 at H = 4096 the fused backward took the same time at
# 3072 as at 4096 columns (34.93 vs 34.94 ms forward+backward) with XLA's temporaries at
# 0.115x the bf16 logits instead of 0.135x (docs/performance.md, "The fused LM head").
MIN_CHUNK_BYTES = 48 * 2**20
_COLUMN_ALIGN = 128


def default_chunk_size(num_tokens: int, local_vocab: int) -> int:
    """Vocabulary columns per chunk when `chunk_size=None`: fp32 `[T, chunk]` logits of
    at most max(MIN_CHUNK_BYTES, T * V_loc * 2 / 24) bytes, a multiple of 128 columns
    (at least 128), capped at V_loc."""
    budget = max(MIN_CHUNK_BYTES, num_tokens * local_vocab * 2 // 24)
    columns = budget // (4 * max(num_tokens, 1)) // _COLUMN_ALIGN * _COLUMN_ALIGN
    return max(1, min(local_vocab, max(_COLUMN_ALIGN, columns)))


def chunk_columns(num_tokens: int, local_vocab: int, chunk_size: int | None) -> int:
    """Vocabulary columns per chunk for `num_tokens` rows: `chunk_size` (None:
    `default_chunk_size`), capped at `local_vocab`."""
    return max(1, min(local_vocab, chunk_size or default_chunk_size(num_tokens, local_vocab)))


def _dot(a, b, dims, out_dtype):
    """`lax.dot_general` at full precision for float32/float64 operands: XLA's default
    on GPUs rounds fp32 operands to TF32 (10-bit mantissa), a 1e-3 relative error in
    the logits, far beyond design §8. bf16/fp16 operands are exact products anyway."""
    wide = jnp.dtype(a.dtype).itemsize >= 4 or jnp.dtype(b.dtype).itemsize >= 4
    return lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=out_dtype,
                           precision=lax.Precision.HIGHEST if wide else None)


def _logits(hidden, weight_c):
    """[T, H] @ [C, H]^T with fp32 accumulation, kept in fp32 (float64 stays float64)."""
    return _dot(hidden, weight_c, ((1,), (1,)), jnp.promote_types(hidden.dtype, jnp.float32))


def _over_columns(body, carry, weight, keep_mask, local_targets, chunk: int,
                  tail_first: bool = False):
    """carry = body(carry, start, weight_c [C, H], mask_c [T, C] or None, targets_c [T])
    over vocabulary chunks of `chunk` columns: a scan over the full chunks, then the
    shorter tail (nothing padded), or the tail first with `tail_first`. `targets_c` are
    the local targets shifted to the chunk (outside [0, C): the target is in another
    chunk, as for another shard). `mask_c` is bool whatever the mask's dtype (uint8:
    nonzero = kept), converted in the slice's own pass."""
    num_vocab = weight.shape[0]
    num_full, tail = divmod(num_vocab, chunk)

    def run(carry, start, size, dynamic):
        if dynamic:
            weight_c = lax.dynamic_slice_in_dim(weight, start, size, 0)
            mask_c = (None if keep_mask is None
                      else lax.dynamic_slice_in_dim(keep_mask, start, size, 1))
        else:
            weight_c = weight[start:start + size]
            mask_c = None if keep_mask is None else keep_mask[:, start:start + size]
        if mask_c is not None:
            mask_c = mask_c.astype(jnp.bool_)
        return body(carry, start, weight_c, mask_c, local_targets - start)

    if tail and tail_first:
        carry = run(carry, num_full * chunk, tail, False)
    if num_full:
        carry, _ = lax.scan(lambda c, i: (run(c, i * chunk, chunk, True), None),
                            carry, jnp.arange(num_full, dtype=jnp.int32))
    if tail and not tail_first:
        carry = run(carry, num_full * chunk, tail, False)
    return carry


def _merge(acc: LocalStats, part: LocalStats) -> LocalStats:
    """Statistics of two disjoint sets of columns of the same rows -> of their union
    (the online log-sum-exp step, per row). A side with no finite logit (max -inf)
    contributes nothing; its -inf must not meet another -inf in a subtraction."""
    def rescale(new_max, old_max):
        live = old_max > -jnp.inf
        shift = jnp.where(live, old_max - new_max, 0.0)
        return shift, jnp.where(live, jnp.exp(shift), 0.0)

    row_max = jnp.maximum(acc.max_logit, part.max_logit)
    (d_acc, w_acc), (d_part, w_part) = rescale(row_max, acc.max_logit), rescale(
        row_max, part.max_logit)
    shifted = None
    if acc.sum_exp_shifted is not None:
        shifted = (w_acc * (acc.sum_exp_shifted + acc.sum_exp * d_acc)
                   + w_part * (part.sum_exp_shifted + part.sum_exp * d_part))
    masked_max = masked_sum = None
    if acc.masked_max is not None:
        masked_max = jnp.maximum(acc.masked_max, part.masked_max)
        (_, m_acc), (_, m_part) = rescale(masked_max, acc.masked_max), rescale(
            masked_max, part.masked_max)
        masked_sum = m_acc * acc.masked_sum_exp + m_part * part.masked_sum_exp
    return LocalStats(
        max_logit=row_max, sum_exp=w_acc * acc.sum_exp + w_part * part.sum_exp,
        sum_exp_shifted=shifted, target_logit=acc.target_logit + part.target_logit,
        masked_max=masked_max, masked_sum_exp=masked_sum)


def _empty_stats(num_tokens, with_entropy, masked, like) -> LocalStats:
    """The statistics of no columns: the identity of `_merge`."""
    neg = vary_like(jnp.full((num_tokens,), -jnp.inf, jnp.float32), *like)
    zero = jnp.zeros_like(neg)
    return LocalStats(max_logit=neg, sum_exp=zero,
                      sum_exp_shifted=zero if with_entropy else None, target_logit=zero,
                      masked_max=neg if masked else None,
                      masked_sum_exp=zero if masked else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9, 10, 11))
def linear_local_stats(hidden, weight, local_targets, keep_mask, inv_tau, with_entropy,
                        entropy_grad, implementation, config, chunk, fused_forward=False,
                        fused_backward=False):
    """`stats.local_stats(hidden @ weight.T, ...)`, vocabulary chunk by chunk, or with
    `fused_forward` in one Mosaic GPU kernel (`backends/mosaic/linear.py`).
    `fused_backward`: the backward's d logits from `mosaic_linear.backward_logits`.
    keep_mask `[T, V_loc]` bool or uint8 (nonzero = kept) or None."""
    del entropy_grad
    if fused_forward:
        from jaxops.backends.mosaic import linear as mosaic_linear

        return mosaic_linear.forward_stats(
            hidden, weight, local_targets, keep_mask, inv_tau=inv_tau,
            with_entropy=with_entropy, interpret=bool(getattr(config, "interpret", False)))
    kernels = registry.kernels(implementation)

    def body(acc, start, weight_c, mask_c, targets_c):
        del start
        return _merge(acc, kernels.forward_stats(
            _logits(hidden, weight_c), targets_c, mask_c, inv_tau=inv_tau,
            with_entropy=with_entropy, config=config))

    init = _empty_stats(hidden.shape[0], with_entropy, keep_mask is not None,
                        (hidden, weight, local_targets, keep_mask))
    return _over_columns(body, init, weight, keep_mask, local_targets, chunk)


def _local_stats_fwd(hidden, weight, local_targets, keep_mask, inv_tau, with_entropy,
                            entropy_grad, implementation, config, chunk, fused_forward=False,
                            fused_backward=False):
    stats = linear_local_stats(hidden, weight, local_targets, keep_mask, inv_tau,
                                with_entropy, entropy_grad, implementation, config, chunk,
                                fused_forward, fused_backward)
    residuals = (hidden, weight, local_targets, keep_mask, stats.max_logit, stats.masked_max)
    return stats, residuals


def chunked_backward(hidden, weight, local_targets, keep_mask, max_logit, masked_max, coefs, *,
                     inv_tau, implementation, config, chunk, d_weight=None,
                     want_d_hidden=True, want_d_weight=None, fused_logits=False):
    """The backward's chunk loop over the vocabulary: recompute a chunk's logits
    `[T, C]`, form its d logits, and contract them at once into this chunk's rows of d
    weight (complete: the contraction over T happens in one GEMM) and into the fp32
    d hidden accumulator `[T, H]`.

    hidden `[T, H]`, weight `[V_loc, H]`, local_targets/max_logit/masked_max/coefs `[T]`,
    keep_mask `[T, V_loc]` or None. d weight, three ways:
      * `d_weight` an accumulator `[V_loc, H]` (fp32, or float64 for float64 inputs):
        this call adds its d weight to it and returns it (callers that cut T into
        pieces, the PyTorch bridge's row windows, round once after the last piece);
      * `want_d_weight=True` (and no accumulator): returned in weight's dtype, each
        chunk's rows rounded once from their fp32 GEMM;
      * neither: not computed.
    `fused_logits`: each chunk's d logits from `mosaic_linear.backward_logits`, which
    recomputes the logits in the kernel (no fp32 `[T, C]` chunk; the caller checks
    `mosaic_linear.applies`), and d weight's rows straight from their GEMM in weight's
    dtype (no fp32 `[C, H]` either: see the body).
    Returns (d hidden `[T, H]` in hidden's dtype or None without `want_d_hidden`,
    d weight or None)."""
    acc = jnp.promote_types(weight.dtype, jnp.float32)
    compute = jnp.promote_types(hidden.dtype, weight.dtype)
    if d_weight is not None:
        out_weight, accumulate = d_weight, True
    elif want_d_weight:
        out_weight, accumulate = vary_like(jnp.zeros(weight.shape, weight.dtype), weight), False
    else:
        out_weight, accumulate = None, False
    d_hidden = None
    if want_d_hidden:
        d_hidden = vary_like(jnp.zeros(hidden.shape, acc), hidden, weight, local_targets)

    def body(carry, start, weight_c, mask_c, targets_c):
        d_hidden, out_weight = carry
        # The GEMMs take d logits in the inputs' dtype, as the unfused op's gradient of
        # bf16 logits is: an fp32 operand would turn both into fp32 GEMMs (~10x slower).
        # The kernel rounds them as it stores them: no fp32 [T, C] array, no pass over it.
        if fused_logits:
            d_logits = _fused_backward_logits(hidden, weight_c, targets_c, mask_c, max_logit,
                                              masked_max, coefs, inv_tau=inv_tau,
                                              out_dtype=compute, config=config)
        else:
            d_logits = stats.backward_logits(
                implementation, _logits(hidden, weight_c), targets_c, mask_c, max_logit,
                masked_max, coefs, inv_tau=inv_tau, config=config, out_dtype=compute)  # [T, C]
        if d_hidden is not None:
            d_hidden = d_hidden + _dot(d_logits, weight_c, ((1,), (0,)), acc)
        if out_weight is not None:
            # [C, H] in fp32, rounded once. A dot with a bf16 result saves that fp32
            # temporary, but XLA may then sum in bf16: on the H200 it did at T = 7, H = 1,
            # 0.4% off (docs/performance.md, "The fused LM head"), and the fp32-accumulation
            # algorithm that forbids it is rejected by XLA's CPU emitter at such shapes.
            # The fused path's shapes (T % 8 == 0, H % 64 == 0: a real GEMM, which
            # accumulates in fp32) take the bf16 result.
            direct = fused_logits and not accumulate
            rows = _dot(d_logits, hidden, ((0,), (0,)), out_weight.dtype if direct else acc)
            if accumulate:
                rows = rows + lax.dynamic_slice_in_dim(out_weight, start, rows.shape[0], 0)
            out_weight = lax.dynamic_update_slice_in_dim(
                out_weight, rows.astype(out_weight.dtype), start, 0)
        return d_hidden, out_weight

    # The narrower tail chunk first: its d hidden product then becomes the accumulator
    # (zeros + x folds away) and the scan's adds fuse into their GEMMs. Last, the tail's
    # add fused with the final rounding instead, and its GEMM wrote a second fp32
    # [T, H] array (512 MiB at T = 16,384, H = 8192: docs/performance.md, "The fused LM head").
    d_hidden, out_weight = _over_columns(body, (d_hidden, out_weight), weight, keep_mask,
                                         local_targets, chunk, tail_first=True)
    return (None if d_hidden is None else d_hidden.astype(hidden.dtype)), out_weight


def _fused_backward_logits(hidden, weight_c, targets_c, mask_c, max_logit, masked_max,
                           coefs, *, inv_tau, out_dtype, config):
    """d logits `[T, C]` from `mosaic_linear.backward_logits` (the logits recomputed in
    the kernel), differentiable through XLA's `backward_logits` of the same logits
    (`stats.with_xla_derivative`)."""
    from jaxops.backends.mosaic import linear as mosaic_linear
    from jaxops.backends import xla

    def kernel(hidden, weight_c, targets_c, mask_c, max_logit, masked_max, coefs):
        return mosaic_linear.backward_logits(
            hidden, weight_c, targets_c, max_logit, coefs, mask_c, masked_max,
            inv_tau=inv_tau, out_dtype=out_dtype,
            interpret=bool(getattr(config, "interpret", False)))

    def jnp_fn(hidden, weight_c, targets_c, mask_c, max_logit, masked_max, coefs):
        return xla.backward_logits(_logits(hidden, weight_c), targets_c, mask_c, max_logit,
                                   masked_max, coefs, inv_tau=inv_tau, out_dtype=out_dtype)

    return stats.with_xla_derivative(kernel, jnp_fn)(hidden, weight_c, targets_c, mask_c,
                                                      max_logit, masked_max, coefs)


def _local_stats_bwd(inv_tau, with_entropy, entropy_grad, implementation, config,
                            chunk, fused_forward, fused_backward, residuals, cotangents):
    del fused_forward
    hidden, weight, local_targets, keep_mask, max_logit, masked_max = residuals
    coefs = backward_coefs(cotangents, with_entropy and entropy_grad, keep_mask is not None)
    d_hidden, d_weight = chunked_backward(
        hidden, weight, local_targets, keep_mask, max_logit, masked_max, coefs,
        inv_tau=inv_tau, implementation=implementation, config=config, chunk=chunk,
        want_d_weight=True, fused_logits=fused_backward)
    return d_hidden, d_weight, None, None


linear_local_stats.defvjp(_local_stats_fwd, _local_stats_bwd)


def linear_logprob_entropy(
    hidden: jax.Array,  # [..., H]
    weight: jax.Array,  # [V_loc, H]: this shard's rows of the output layer
    targets: jax.Array,  # [...] integer global vocabulary ids
    *,
    keep_mask: jax.Array | None = None,  # [..., V_loc] bool (or uint8)
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    axis_name=None,
    implementation: str | None = None,
    chunk_size: int | None = None,
    pallas_config: PallasConfig | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """`jaxops.logprob_entropy(hidden @ weight.T, targets, ...)` without the `[T, V_loc]` logits.

    The output layer fused into the op (docs/design.md §10): the logits are computed
    `chunk_size` vocabulary columns at a time, in fp32 (the matmul's fp32 accumulator; not rounded to
    the inputs' dtype), folded into the row statistics and discarded; the backward
    recomputes them chunk by chunk. Values, flags and errors are those of
    `jaxops.logprob_entropy` on fp32 logits `hidden @ weight.T`.

    Args:
      hidden: `[..., H]` float32, bfloat16 or float16 (float64 for "reference").
      weight: `[V_loc, H]`, the same dtype: logits = hidden @ weight.T. With
        `axis_name`, this shard's rows `[i * V_loc, (i + 1) * V_loc)` of the
        vocabulary; `hidden` and `targets` are the same on every shard.
      targets, keep_mask (`[..., V_loc]`), temperature, with_entropy, entropy_grad,
        pallas_config: as for `jaxops.logprob_entropy`.
      axis_name: inside `shard_map` over the vocabulary, the mesh axis it is split over.
      implementation: None, "xla" or "pallas" pick the statistics kernels run on each
        chunk; "reference" forms the full logits and runs the reference op (the oracle;
        unsharded, float64-capable). "pallas" on a Hopper+ GPU (and "pallas_mosaic")
        run the forward as one fused GEMM + statistics kernel where
        `mosaic_linear.applies` (bf16/fp16, T a multiple of 8, H of 64, V_loc of 8; of
        16 with a keep mask), and the backward's d logits with a kernel that recomputes the
        logits where it also holds and T <= 4096 (where each was measured faster); a
        Triton `PallasConfig` keeps both chunked.
      chunk_size: vocabulary columns per chunk (any int >= 1; it need not divide
        V_loc). None: `default_chunk_size(T, V_loc)`: fp32 `[T, chunk]` logits of at
        most 1/24 of the bf16 logits' bytes (at least 48 MiB), 128-column aligned.

    Returns:
      `(log_prob, entropy)`, float32 `[...]`; `entropy` is None without entropy.
      Gradients w.r.t. `hidden` and `weight` have their dtypes (fp32 accumulation,
      rounded once).

    Memory beyond the inputs, outputs and gradients: one chunk of fp32 logits and its
    gradient in the inputs' dtype, `T * chunk_size * 6` bytes for bf16 (8 for fp32;
    the fused forward holds no chunk, only O(T * V_loc / 2048) partial statistics; the
    fused backward no fp32 chunk, `T * chunk_size * 2`, but see docs/design.md §10),
    plus the fp32 `d hidden` accumulator `T * H * 4` and O(T) floats of statistics;
    never `[T, V_loc]`. With the default chunk (at T * V_loc * 2 / 24 >= 48 MiB) that
    is under 1/16 of the bf16 logits' size plus `T * H * 4`.

    Vocab parallel `d hidden`: every shard's logits depend on all of `hidden`, so
    its gradient is the sum over shards. The op returns the full sum: under
    `check_vma=True` it marks `hidden` as varying over `axis_name` (`lax.pcast`),
    whose transpose is the O(T * H) psum; under `check_vma=False` each shard's value
    is its own part and `shard_map`'s transpose sums it for a replicated (`P()`)
    `hidden`, as JAX does for any replicated input. (Each shard's part has
    `hidden`'s dtype when it is summed: for bf16, a bf16 all-reduce of fp32-accumulated
    parts, as in Megatron.) A `hidden` already typed as varying over `axis_name`
    is taken as this shard's own and gets this shard's part. Megatron's column-parallel
    output layer instead returns each rank's partial `d hidden` and leaves the
    all-reduce to `copy_to_tensor_model_parallel_region` in front of it; do not
    add that all-reduce again around this op.
    """
    impl, config = registry.resolve(implementation, pallas_config=pallas_config)
    validate.check_linear_call(hidden, weight, chunk_size, impl)
    lead_shape, num_vocab = tuple(hidden.shape[:-1]), weight.shape[0]
    logits_like = jax.ShapeDtypeStruct(lead_shape + (num_vocab,), hidden.dtype)
    tau = validate.check_op_call(
        logits_like, targets, keep_mask, impl, temperature=temperature,
        with_entropy=with_entropy, entropy_grad=entropy_grad, axis_name=axis_name,
        device_array=hidden)

    num_tokens = int(np.prod(lead_shape))
    chunk = chunk_columns(num_tokens, num_vocab, chunk_size)
    shapes = (num_tokens, hidden.shape[-1], num_vocab, hidden.dtype, keep_mask is not None)
    fused = (registry.use_fused_forward(impl, config, pallas_config, *shapes),
             registry.use_fused_backward(impl, config, pallas_config, *shapes, chunk))
    # The kernels read one chunk's fp32 logits [T, chunk] at a time, and the keep mask as
    # bool (below), whatever its dtype here: "pallas" picks its backend for those.
    impl, config = registry.for_call(
        impl, config, pallas_config, num_vocab=chunk, itemsize=4,
        mask_dtype=None if keep_mask is None else jnp.bool_,
        min_mosaic_vocab=registry.FUSED_CHUNK_MOSAIC_MIN_VOCAB)
    if num_tokens == 0:
        empty = jnp.zeros(lead_shape, jnp.promote_types(hidden.dtype, jnp.float32))
        return empty, (empty if with_entropy else None)
    flat_hidden = jnp.reshape(hidden, (num_tokens, hidden.shape[-1]))
    flat_targets = jnp.reshape(targets, (num_tokens,))
    # bool or uint8 (nonzero = kept), as given: the chunks convert their slices to bool
    # (`_over_columns`), the fused forward reads bytes.
    flat_mask = None if keep_mask is None else jnp.reshape(keep_mask, (num_tokens, num_vocab))

    if impl == registry.REFERENCE:
        log_prob, entropy = logprob_entropy_reference(
            _logits(flat_hidden, weight), flat_targets,
            None if flat_mask is None else flat_mask.astype(jnp.bool_), tau, with_entropy,
            entropy_grad)
    else:
        if axis_name is not None:
            # check_vma=True: hidden (replicated) becomes varying like the weight shard;
            # the transpose of that cast is the psum of the shards' d hidden.
            flat_hidden = vary_like(flat_hidden, weight)
        targets_valid, local_targets = shard_targets(flat_targets, num_vocab, axis_name)
        validate.check_interpret_outside_vma(impl, config, flat_hidden, weight,
                                             local_targets, flat_mask)
        stats = linear_local_stats(flat_hidden, weight, local_targets, flat_mask, 1.0 / tau,
                                    bool(with_entropy), bool(entropy_grad), impl, config,
                                    chunk, *fused)
        log_prob, entropy = combine(stats, targets_valid, entropy_grad=bool(entropy_grad),
                                    axis_name=axis_name)

    return unflatten(log_prob, entropy, lead_shape)
