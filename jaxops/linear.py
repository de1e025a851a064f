"""The op fused with the output layer: log-prob and entropy of `hidden @ weight.T`, chunked.

`linear_logprob_entropy` never holds the `[T, V_loc]` logits (or their gradient) for
more than `chunk_size` rows at a time (docs/design.md §10). It is the per-shard
statistics of `stats.local_stats`, with the logits computed chunk by chunk inside the
custom VJP:

  forward   for each chunk of rows: logits_c = hidden_c @ weight.T (fp32 accumulation),
            the implementation's `forward_stats(logits_c)`; keep the O(T) statistics.
  backward  for each chunk: recompute logits_c, `backward_logits` -> d logits_c, then
            d hidden_c = d logits_c @ weight and d weight += d logits_c^T @ hidden_c,
            both accumulated in fp32.

Residuals are hidden, weight, targets, mask and the O(T) row maxima (and masked
reference points): nothing `[T, V_loc]`. The chunks' logits stay in fp32, the GEMM's
accumulator: design §2 computes x = logits / tau in fp32 and never rounds it to bf16,
and rounding the logits of bf16 inputs to bf16 would cost |x| * 2^-9 of accuracy,
far beyond §8's 1e-5. The cross-shard combine is `combine.combine`, plain
differentiable JAX around the custom VJP, exactly as in `api.logprob_entropy`.

T is split into full chunks (a `lax.scan`) plus one shorter tail chunk, so nothing
is padded, not even the O(T) arrays.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxops import implementations, validate
from jaxops.combine import combine, shard_targets, unflatten
from jaxops.contract import backward_coefs, varying_axes
from jaxops.pallas_config import PallasConfig
from jaxops.reference import logprob_entropy_reference

# Default rows per chunk: as many as keep one fp32 chunk of logits within this many bytes.
DEFAULT_CHUNK_BYTES = 256 * 2**20


def default_chunk_size(num_tokens: int, local_vocab: int) -> int:
    """Rows per chunk when `chunk_size=None`: one fp32 `[chunk, V_loc]` logits chunk
    of at most DEFAULT_CHUNK_BYTES (a multiple of 8 rows, at least 8), capped at T."""
    rows = max(8, (DEFAULT_CHUNK_BYTES // (4 * local_vocab)) // 8 * 8)
    return max(1, min(num_tokens, rows))


def _dot(a, b, dims, out_dtype):
    """`lax.dot_general` at full precision for float32/float64 operands: XLA's default
    on GPUs rounds fp32 operands to TF32 (10-bit mantissa), a 1e-3 relative error in
    the logits, far beyond design §8. bf16/fp16 operands are exact products anyway."""
    wide = jnp.dtype(a.dtype).itemsize >= 4 or jnp.dtype(b.dtype).itemsize >= 4
    return lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=out_dtype,
                           precision=lax.Precision.HIGHEST if wide else None)


def _logits(hidden_c, weight):
    """[C, H] @ [V_loc, H]^T with fp32 accumulation, kept in fp32 (float64 stays float64)."""
    return _dot(hidden_c, weight, ((1,), (1,)), jnp.promote_types(hidden_c.dtype, jnp.float32))


def _vary_like(x, *like):
    """`x` typed as varying over every mesh axis that `like` vary over (check_vma=True);
    unchanged elsewhere. Its transpose sums the cotangent over the added axes."""
    missing = tuple(sorted(varying_axes(*like) - varying_axes(x)))
    if not missing:
        return x
    pcast = getattr(lax, "pcast", None)
    return pcast(x, missing, to="varying") if pcast else lax.pvary(x, missing)


def _over_chunks(body, carry, xs, num_rows: int, chunk: int):
    """body(carry, xs_c) -> (carry, ys_c) over row chunks of the pytree `xs` (leading dim
    `num_rows`; None leaves allowed): a scan over the full chunks, then the tail.
    Returns (carry, ys concatenated over rows)."""
    num_full, tail = divmod(num_rows, chunk)
    parts = []
    if num_full:
        def step(carry, index):
            xs_c = jax.tree.map(
                lambda x: lax.dynamic_slice_in_dim(x, index * chunk, chunk), xs)
            return body(carry, xs_c)

        carry, ys = lax.scan(step, carry, jnp.arange(num_full))
        parts.append(jax.tree.map(lambda y: y.reshape((num_full * chunk,) + y.shape[2:]), ys))
    if tail:
        carry, ys = body(carry, jax.tree.map(lambda x: x[num_full * chunk:], xs))
        parts.append(ys)
    if len(parts) == 1:
        return carry, parts[0]
    return carry, jax.tree.map(lambda *ys: jnp.concatenate(ys), *parts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _linear_local_stats(hidden, weight, local_targets, keep_mask, inv_tau, with_entropy,
                        entropy_grad, implementation, config, chunk):
    """`stats.local_stats(hidden @ weight.T, ...)`, chunk by chunk over the rows."""
    del entropy_grad
    kernels = implementations.kernels(implementation)

    def body(carry, xs_c):
        hidden_c, targets_c, mask_c = xs_c
        return carry, kernels.forward_stats(
            _logits(hidden_c, weight), targets_c, mask_c, inv_tau=inv_tau,
            with_entropy=with_entropy, config=config)

    _, stats = _over_chunks(body, None, (hidden, local_targets, keep_mask),
                            hidden.shape[0], chunk)
    return stats


def _linear_local_stats_fwd(hidden, weight, local_targets, keep_mask, inv_tau, with_entropy,
                            entropy_grad, implementation, config, chunk):
    stats = _linear_local_stats(hidden, weight, local_targets, keep_mask, inv_tau,
                                with_entropy, entropy_grad, implementation, config, chunk)
    residuals = (hidden, weight, local_targets, keep_mask, stats.max_logit, stats.masked_max)
    return stats, residuals


def chunked_backward(hidden, weight, local_targets, keep_mask, max_logit, masked_max, coefs, *,
                     inv_tau, implementation, config, chunk, d_weight=None,
                     want_d_hidden=True):
    """The backward's chunk loop: recompute each chunk's logits, form its d logits and
    contract them at once into d hidden and d weight.

    hidden `[T, H]`, weight `[V_loc, H]`, local_targets/max_logit/masked_max/coefs `[T]`,
    keep_mask `[T, V_loc]` or None. `d_weight`: an accumulator `[V_loc, H]` (fp32, or
    float64 for float64 inputs) that this call adds its rows' d weight to -- callers
    that cut T into pieces (the PyTorch bridge's row windows) chain it through them and
    round once at the end; None: d weight is not computed. Returns (d hidden `[T, H]` in
    hidden's dtype or None without `want_d_hidden`, the accumulator or None)."""
    kernels = implementations.kernels(implementation)
    acc = jnp.promote_types(weight.dtype, jnp.float32)

    def body(d_weight, xs_c):
        hidden_c, targets_c, mask_c, max_c, masked_max_c, coefs_c = xs_c
        d_logits = kernels.backward_logits(
            _logits(hidden_c, weight), targets_c, mask_c, max_c, masked_max_c, coefs_c,
            inv_tau=inv_tau, config=config)  # [C, V_loc] fp32, like the logits
        # The GEMMs take d logits in the inputs' dtype, as the unfused op's gradient of
        # bf16 logits is: an fp32 operand would turn both into fp32 GEMMs (~10x slower).
        d_logits = d_logits.astype(jnp.promote_types(hidden.dtype, weight.dtype))
        d_hidden_c = None
        if want_d_hidden:
            d_hidden_c = _dot(d_logits, weight, ((1,), (0,)), acc).astype(hidden.dtype)
        if d_weight is not None:
            d_weight = d_weight + _dot(d_logits, hidden_c, ((0,), (0,)), d_weight.dtype)
        return d_weight, d_hidden_c

    d_weight, d_hidden = _over_chunks(
        body, d_weight, (hidden, local_targets, keep_mask, max_logit, masked_max, coefs),
        hidden.shape[0], chunk)
    return d_hidden, d_weight


def _linear_local_stats_bwd(inv_tau, with_entropy, entropy_grad, implementation, config,
                            chunk, residuals, cotangents):
    hidden, weight, local_targets, keep_mask, max_logit, masked_max = residuals
    coefs = backward_coefs(cotangents, with_entropy and entropy_grad, keep_mask is not None)
    acc = jnp.promote_types(weight.dtype, jnp.float32)
    # Under check_vma=True the scan's carry must vary over the axes the weight shard does.
    d_weight0 = _vary_like(jnp.zeros(weight.shape, acc), weight)
    d_hidden, d_weight = chunked_backward(
        hidden, weight, local_targets, keep_mask, max_logit, masked_max, coefs,
        inv_tau=inv_tau, implementation=implementation, config=config, chunk=chunk,
        d_weight=d_weight0)
    return d_hidden, d_weight.astype(weight.dtype), None, None


_linear_local_stats.defvjp(_linear_local_stats_fwd, _linear_local_stats_bwd)


def _check_linear(hidden, weight, chunk_size, implementation):
    validate.check_array("hidden", hidden)
    validate.check_array("weight", weight)
    if hidden.ndim < 1 or hidden.shape[-1] < 1:
        raise ValueError(f"hidden must have shape [..., H] with H >= 1, got {hidden.shape}")
    if weight.ndim != 2 or weight.shape[0] < 1:
        raise ValueError(f"weight must have shape [V_loc, H] with V_loc >= 1, got {weight.shape}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight [V_loc, H] = {tuple(weight.shape)} does not match hidden [..., H] = "
            f"{tuple(hidden.shape)}: H must agree")
    if jnp.dtype(hidden.dtype) != jnp.dtype(weight.dtype):
        raise TypeError(f"hidden and weight must have the same dtype, got "
                        f"{jnp.dtype(hidden.dtype).name} and {jnp.dtype(weight.dtype).name}")
    allowed = ("float32", "bfloat16", "float16") + (
        ("float64",) if implementation == "reference" else ())
    if jnp.dtype(hidden.dtype).name not in allowed:
        raise TypeError(f"hidden and weight must be one of {list(allowed)} for implementation "
                        f"{implementation!r}, got {jnp.dtype(hidden.dtype).name}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(
            chunk_size, (int, np.integer)) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")


def linear_logprob_entropy(
    hidden: jax.Array,  # [..., H]
    weight: jax.Array,  # [V_loc, H]: this shard's rows of the output layer
    targets: jax.Array,  # [...] integer global vocabulary ids
    *,
    keep_mask: jax.Array | None = None,  # [..., V_loc] bool
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
    `chunk_size` rows at a time, in fp32 (the matmul's fp32 accumulator; not rounded to
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
        unsharded, float64-capable).
      chunk_size: rows per chunk (any int >= 1; it need not divide T). None:
        `default_chunk_size(T, V_loc)`, one fp32 chunk of logits of <= 256 MiB.

    Returns:
      `(log_prob, entropy)`, float32 `[...]`; `entropy` is None without entropy.
      Gradients w.r.t. `hidden` and `weight` have their dtypes (fp32 accumulation,
      rounded once).

    Memory beyond the inputs, outputs and gradients: one chunk of fp32 logits and
    its fp32 gradient, `chunk_size * V_loc * 4 * 2` bytes, plus the fp32 `d weight`
    accumulator, `V_loc * H * 4` bytes, and O(T) floats of statistics. (XLA may keep
    a few more `[chunk_size, V_loc]` fp32 temporaries within a chunk; never `[T, V_loc]`.)

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
    impl, config = implementations.resolve(implementation, pallas_config=pallas_config)
    _check_linear(hidden, weight, chunk_size, impl)
    lead_shape, num_vocab = tuple(hidden.shape[:-1]), weight.shape[0]
    logits_like = jax.ShapeDtypeStruct(lead_shape + (num_vocab,), hidden.dtype)
    tau = validate.check_op_call(
        logits_like, targets, keep_mask, impl, temperature=temperature,
        with_entropy=with_entropy, entropy_grad=entropy_grad, axis_name=axis_name,
        device_array=hidden)

    num_tokens = int(np.prod(lead_shape))
    if num_tokens == 0:
        empty = jnp.zeros(lead_shape, jnp.promote_types(hidden.dtype, jnp.float32))
        return empty, (empty if with_entropy else None)
    flat_hidden = jnp.reshape(hidden, (num_tokens, hidden.shape[-1]))
    flat_targets = jnp.reshape(targets, (num_tokens,))
    flat_mask = None if keep_mask is None else jnp.reshape(keep_mask, (num_tokens, num_vocab))

    if impl == "reference":
        log_prob, entropy = logprob_entropy_reference(
            _logits(flat_hidden, weight), flat_targets, flat_mask, tau, with_entropy,
            entropy_grad)
    else:
        if axis_name is not None:
            # check_vma=True: hidden (replicated) becomes varying like the weight shard;
            # the transpose of that cast is the psum of the shards' d hidden.
            flat_hidden = _vary_like(flat_hidden, weight)
        targets_valid, local_targets = shard_targets(flat_targets, num_vocab, axis_name)
        validate.check_interpret_outside_vma(impl, config, flat_hidden, weight,
                                             local_targets, flat_mask)
        chunk = chunk_size or default_chunk_size(num_tokens, num_vocab)
        stats = _linear_local_stats(flat_hidden, weight, local_targets, flat_mask, 1.0 / tau,
                                    bool(with_entropy), bool(entropy_grad), impl, config,
                                    int(min(chunk, num_tokens)))
        log_prob, entropy = combine(stats, targets_valid, entropy_grad=bool(entropy_grad),
                                    axis_name=axis_name)

    return unflatten(log_prob, entropy, lead_shape)
