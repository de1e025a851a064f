"""Public entry point: validate the call, flatten leading dims, dispatch to an implementation."""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxops.combine import combine
from jaxops.contract import varying_axes
from jaxops.implementations import IMPLEMENTATIONS
from jaxops.implementations import default as default_implementation
from jaxops.pallas_config import PallasConfig
from jaxops.reference import logprob_entropy_reference
from jaxops.stats import local_stats

_KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _check_array(name, x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")


def _check_temperature(temperature) -> float:
    if _is_tracer(temperature):
        raise TypeError(
            "temperature must be a concrete number (it is baked into the kernel); "
            "got a traced value. Pass it as a static Python float.")
    if isinstance(temperature, bool) or not (
            isinstance(temperature, numbers.Real)
            or (hasattr(temperature, "shape") and np.shape(temperature) == ())):
        raise TypeError(f"temperature must be a real number, got {temperature!r}")
    value = float(temperature)
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"temperature must be finite and > 0, got {value}")
    return value


def _check_same_device(logits, targets):
    """Single-device, committed arrays on different devices: a user error, not a silent copy."""
    if _is_tracer(logits) or _is_tracer(targets):
        return
    if not (isinstance(logits, jax.Array) and isinstance(targets, jax.Array)):
        return
    if not (getattr(logits, "committed", False) and getattr(targets, "committed", False)):
        return
    if len(logits.devices()) == 1 and logits.devices() != targets.devices():
        raise ValueError(
            f"logits are on {logits.devices()} but targets on {targets.devices()}; "
            "put them on the same device")


def _check_targets_in_range(targets, num_vocab):
    """Eager calls only: inside jit an out-of-range target gives NaN in its row."""
    if _is_tracer(targets):
        return
    host = np.asarray(targets)
    bad = (host < 0) | (host >= num_vocab)
    if bad.any():
        rows = np.argwhere(bad)[:5]
        shown = ", ".join(
            f"{tuple(int(i) for i in r) if len(r) > 1 else int(r[0])}: {host[tuple(r)]}"
            for r in rows)
        raise ValueError(
            f"targets must lie in [0, {num_vocab}); {int(bad.sum())} row(s) do not "
            f"(row: value) {shown}")


def logprob_entropy(
    logits: jax.Array,  # [..., V] (this shard's [..., V_loc] when axis_name is set)
    targets: jax.Array,  # [...] integer global vocabulary ids
    *,
    keep_mask: jax.Array | None = None,  # [..., V] bool
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
        the full vocabulary.
      temperature: a concrete number > 0.
      with_entropy: if False, no entropy work is done and `entropy` is None.
      entropy_grad: if False, entropy is returned but is a constant for autodiff.
      implementation: None (pallas on GPU, xla elsewhere), "pallas" (runs in
        interpret mode off-GPU), "xla" or "reference".
      axis_name: inside `shard_map` over the vocabulary, the mesh axis the
        vocabulary is split over. Each shard holds `[..., V_loc]` columns
        `[axis_index * V_loc, (axis_index + 1) * V_loc)`, global `targets` and the
        matching slice of `keep_mask`; outputs are identical on every shard.
        For global arrays (e.g. under `jit` with a `NamedSharding` over the
        vocabulary) use `jaxops.vocab_parallel_logprob_entropy`.
      pallas_config: launch parameters for the Pallas kernels (tuning only).

    Returns:
      `(log_prob, entropy)`, float32 `[...]`; `entropy` is None when
      `with_entropy=False`. Gradients w.r.t. `logits` have the logits' dtype.

    Raises:
      TypeError / ValueError on malformed calls, naming the argument. Targets
      outside `[0, V)` raise ValueError in eager calls; under `jit` (where
      values are unknown) those rows' log-prob is NaN.
    """
    _check_array("logits", logits)
    _check_array("targets", targets)
    if implementation not in (None, *IMPLEMENTATIONS):
        raise ValueError(
            f"implementation must be None or one of {IMPLEMENTATIONS}, got {implementation!r}")
    impl = implementation or default_implementation()
    allowed = _KERNEL_DTYPES + ((jnp.float64,) if impl == "reference" else ())
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {logits.shape}")
    if jnp.dtype(logits.dtype) not in [jnp.dtype(d) for d in allowed]:
        raise TypeError(
            f"logits must be one of {[jnp.dtype(d).name for d in allowed]} for "
            f"implementation {impl!r}, got {jnp.dtype(logits.dtype).name}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"targets must hold integer ids, got dtype {jnp.dtype(targets.dtype).name}")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"targets must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, "
            f"got {tuple(targets.shape)}")
    if keep_mask is not None:
        _check_array("keep_mask", keep_mask)
        if jnp.dtype(keep_mask.dtype) != jnp.dtype(jnp.bool_):
            raise TypeError(f"keep_mask must be bool, got dtype {jnp.dtype(keep_mask.dtype).name}")
        if tuple(keep_mask.shape) != tuple(logits.shape):
            raise ValueError(
                f"keep_mask must have the logits' shape {tuple(logits.shape)}, "
                f"got {tuple(keep_mask.shape)}")
    for flag_name, flag in (("with_entropy", with_entropy), ("entropy_grad", entropy_grad)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{flag_name} must be a bool, got {flag!r}")
    tau = _check_temperature(temperature)
    if axis_name is not None and impl == "reference":
        raise ValueError("implementation='reference' is unsharded; it does not take axis_name")
    _check_same_device(logits, targets)
    if axis_name is None:
        _check_targets_in_range(targets, logits.shape[-1])

    lead_shape, num_vocab = tuple(logits.shape[:-1]), logits.shape[-1]
    num_tokens = int(np.prod(lead_shape))
    if num_tokens == 0:
        # float32, or float64 for the float64 reference: the dtype a non-empty call returns.
        empty = jnp.zeros(lead_shape, jnp.promote_types(logits.dtype, jnp.float32))
        return empty, (empty if with_entropy else None)
    flat_logits = jnp.reshape(logits, (num_tokens, num_vocab))
    flat_targets = jnp.reshape(targets, (num_tokens,))
    flat_mask = None if keep_mask is None else jnp.reshape(keep_mask, (num_tokens, num_vocab))

    if impl == "reference":
        log_prob, entropy = logprob_entropy_reference(
            flat_logits, flat_targets, flat_mask, tau, with_entropy, entropy_grad)
    else:
        if axis_name is None:
            vocab_start, total_vocab = 0, num_vocab
        else:
            vocab_start = lax.axis_index(axis_name) * num_vocab
            total_vocab = lax.axis_size(axis_name) * num_vocab
        targets_valid = (flat_targets >= 0) & (flat_targets < total_vocab)
        local_targets = flat_targets.astype(jnp.int32) - vocab_start
        config = None
        if impl == "pallas":
            config = pallas_config or PallasConfig()
            if jax.default_backend() != "gpu" and not config.interpret:
                config = dataclasses.replace(config, interpret=True)
            if config.interpret and varying_axes(flat_logits, local_targets, flat_mask):
                raise NotImplementedError(
                    "implementation='pallas' in interpret mode (off-GPU) cannot run inside "
                    "shard_map(check_vma=True): JAX's Pallas interpreter rejects inputs "
                    "typed as varying over mesh axes. Use check_vma=False, "
                    "implementation='xla', or jaxops.vocab_parallel_logprob_entropy; "
                    "compiled Pallas on GPU works in both modes.")
        stats = local_stats(flat_logits, local_targets, flat_mask, 1.0 / tau,
                            bool(with_entropy), bool(entropy_grad), impl, config)
        log_prob, entropy = combine(stats, targets_valid, entropy_grad=bool(entropy_grad),
                                    axis_name=axis_name)

    log_prob = jnp.reshape(log_prob, lead_shape)
    if entropy is not None:
        entropy = jnp.reshape(entropy, lead_shape)
    return log_prob, entropy
