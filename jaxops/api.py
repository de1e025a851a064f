"""Public entry point: validate the call, flatten leading dims, dispatch to an implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxops import validate
from jaxops.backends import registry
from jaxops.backends.triton.config import PallasConfig
from jaxops.combine import combine, shard_targets, unflatten
from jaxops.reference import logprob_entropy_reference
from jaxops.stats import local_stats


def logprob_entropy(
    logits: jax.Array,  # [..., V] (this shard's [..., V_loc] when axis_name is set)
    targets: jax.Array,  # [...] integer global vocabulary ids
    *,
    keep_mask: jax.Array | None = None,  # [..., V] bool (or uint8)
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    implementation: str | None = None,
    axis_name=None,
    pallas_config: PallasConfig | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Per-token log-prob of `targets` and entropy of softmax(logits / temperature).

    Args:
      logits: `[..., V]` float32, bfloat16 or float16 (float64 for
        `implementation="reference"` only). Divided by `temperature` in float32.
      targets: `[...]` integer ids into the (global) vocabulary.
      keep_mask: optional `[..., V]` bool. The log-prob is renormalised over the
        kept tokens plus the target (which always counts); entropy stays over
        the full vocabulary. May be uint8 (nonzero = kept): the Mosaic GPU
        kernels read bytes, so a bool mask costs them one conversion pass over
        the mask per kernel (inside a jit that builds the mask, producing uint8
        can let XLA fuse it into the producer); the other implementations compare
        a uint8 mask with 0 first.
      temperature: a concrete number > 0.
      with_entropy: if False, no entropy work is done and `entropy` is None.
      entropy_grad: if False, entropy is returned but is a constant for autodiff.
      implementation: None ("pallas" on GPU, "xla" elsewhere); "pallas": the Pallas
        backend measured faster for this call's V, dtype and mask dtype on this GPU
        (`registry.pallas_backend`; the Triton kernels in interpret mode
        off-GPU); "pallas_triton" or "pallas_mosaic" (Hopper+) by name; "xla" or
        "reference".
      axis_name: inside `shard_map` over the vocabulary, the mesh axis the
        vocabulary is split over. Each shard holds `[..., V_loc]` columns
        `[axis_index * V_loc, (axis_index + 1) * V_loc)`, global `targets` and the
        matching slice of `keep_mask`; outputs are identical on every shard.
        For global arrays (e.g. under `jit` with a `NamedSharding` over the
        vocabulary) use `jaxops.vocab_parallel_logprob_entropy`.
      pallas_config: launch parameters for the Pallas kernels (tuning only): a
        `PallasConfig` (Triton) or a `MosaicConfig`; with "pallas", a `MosaicConfig` or
        non-default `PallasConfig` fields also pick that backend.

    Returns:
      `(log_prob, entropy)`, float32 `[...]`; `entropy` is None when
      `with_entropy=False`. Gradients w.r.t. `logits` have the logits' dtype.

    Raises:
      TypeError / ValueError on malformed calls, naming the argument. Targets
      outside `[0, V)` raise ValueError in eager calls; under `jit` (where
      values are unknown) those rows' log-prob is NaN.
    """
    impl, config = registry.resolve(implementation, pallas_config=pallas_config)
    tau = validate.check_op_call(
        logits, targets, keep_mask, impl, temperature=temperature, with_entropy=with_entropy,
        entropy_grad=entropy_grad, axis_name=axis_name, device_array=logits)

    lead_shape, num_vocab = tuple(logits.shape[:-1]), logits.shape[-1]
    num_tokens = int(np.prod(lead_shape))
    impl, config = registry.for_call(
        impl, config, pallas_config, num_vocab=num_vocab, itemsize=jnp.dtype(logits.dtype).itemsize,
        mask_dtype=None if keep_mask is None else keep_mask.dtype)
    if num_tokens == 0:
        # float32, or float64 for the float64 reference: the dtype a non-empty call returns.
        empty = jnp.zeros(lead_shape, jnp.promote_types(logits.dtype, jnp.float32))
        return empty, (empty if with_entropy else None)
    flat_logits = jnp.reshape(logits, (num_tokens, num_vocab))
    flat_targets = jnp.reshape(targets, (num_tokens,))
    flat_mask = None if keep_mask is None else jnp.reshape(keep_mask, (num_tokens, num_vocab))
    if flat_mask is not None and impl != registry.MOSAIC:
        flat_mask = flat_mask.astype(jnp.bool_)  # uint8: nonzero = kept; bool: no-op

    if impl == registry.REFERENCE:
        log_prob, entropy = logprob_entropy_reference(
            flat_logits, flat_targets, flat_mask, tau, with_entropy, entropy_grad)
    else:
        targets_valid, local_targets = shard_targets(flat_targets, num_vocab, axis_name)
        validate.check_interpret_outside_vma(impl, config, flat_logits, local_targets,
                                             flat_mask)
        stats = local_stats(flat_logits, local_targets, flat_mask, 1.0 / tau,
                            bool(with_entropy), bool(entropy_grad), impl, config)
        log_prob, entropy = combine(stats, targets_valid, entropy_grad=bool(entropy_grad),
                                    axis_name=axis_name)

    return unflatten(log_prob, entropy, lead_shape)
