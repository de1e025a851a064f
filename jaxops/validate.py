"""Argument checks shared by `api.logprob_entropy`, `linear.linear_logprob_entropy` and
`sharding.vocab_parallel_logprob_entropy`.

Everything that can be checked before any kernel runs raises TypeError / ValueError
naming the argument. Only the range check of `targets` looks at values, and only in
eager calls (inside `jit` the values are unknown; a bad target gives NaN in its row).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jaxops.backends import registry
from jaxops.contract import varying_axes

_KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def check_array(name, x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")


def check_inputs(logits, targets, keep_mask, implementation: str):
    """Types, dtypes and shapes of the arrays: `logits [..., V]` (V >= 1) in a dtype
    `implementation` takes, integer `targets [...]`, bool (or uint8) `keep_mask [..., V]` or None."""
    check_array("logits", logits)
    check_array("targets", targets)
    allowed = _KERNEL_DTYPES + ((jnp.float64,) if implementation == registry.REFERENCE else ())
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {logits.shape}")
    if jnp.dtype(logits.dtype) not in [jnp.dtype(d) for d in allowed]:
        raise TypeError(
            f"logits must be one of {[jnp.dtype(d).name for d in allowed]} for "
            f"implementation {implementation!r}, got {jnp.dtype(logits.dtype).name}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"targets must hold integer ids, got dtype {jnp.dtype(targets.dtype).name}")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"targets must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, "
            f"got {tuple(targets.shape)}")
    if keep_mask is not None:
        check_array("keep_mask", keep_mask)
        if jnp.dtype(keep_mask.dtype) not in (jnp.dtype(jnp.bool_), jnp.dtype(jnp.uint8)):
            raise TypeError("keep_mask must be bool (or uint8, nonzero = kept), got dtype "
                            f"{jnp.dtype(keep_mask.dtype).name}")
        if tuple(keep_mask.shape) != tuple(logits.shape):
            raise ValueError(
                f"keep_mask must have the logits' shape {tuple(logits.shape)}, "
                f"got {tuple(keep_mask.shape)}")


def check_flags(**flags):
    for name, flag in flags.items():
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {flag!r}")


def check_temperature(temperature) -> float:
    if is_tracer(temperature):
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


def check_same_device(logits, targets):
    """Single-device, committed arrays on different devices: a user error, not a silent copy."""
    if is_tracer(logits) or is_tracer(targets):
        return
    if not (isinstance(logits, jax.Array) and isinstance(targets, jax.Array)):
        return
    if not (getattr(logits, "committed", False) and getattr(targets, "committed", False)):
        return
    if len(logits.devices()) == 1 and logits.devices() != targets.devices():
        raise ValueError(
            f"logits are on {logits.devices()} but targets on {targets.devices()}; "
            "put them on the same device")


def check_targets_in_range(targets, num_vocab):
    """Eager calls only: inside jit an out-of-range target gives NaN in its row.

    For a global array spread over several processes, each process checks the shards
    it holds."""
    if is_tracer(targets):
        return
    parts = [targets]
    if isinstance(targets, jax.Array) and not targets.is_fully_addressable:
        parts = [shard.data for shard in targets.addressable_shards]
    for part in parts:
        _check_values_in_range(np.asarray(part), num_vocab)


def check_op_call(logits, targets, keep_mask, implementation: str, *, temperature,
                  with_entropy, entropy_grad, axis_name, device_array) -> float:
    """Every check of one call of the op (or of the op fused with its output layer, which
    passes a `ShapeDtypeStruct` of its logits and its `hidden` as `device_array`), before
    any kernel runs. Returns the temperature as a float."""
    check_inputs(logits, targets, keep_mask, implementation)
    check_flags(with_entropy=with_entropy, entropy_grad=entropy_grad)
    tau = check_temperature(temperature)
    if axis_name is not None and implementation == registry.REFERENCE:
        raise ValueError("implementation='reference' is unsharded; it does not take axis_name")
    check_same_device(device_array, targets)
    if axis_name is None:
        check_targets_in_range(targets, logits.shape[-1])
    return tau


def check_interpret_outside_vma(implementation: str, config, *arrays) -> None:
    """Pallas in interpret mode (off-GPU) cannot take inputs typed as varying over mesh
    axes (inside `shard_map(check_vma=True)`): a clear error instead of JAX's."""
    if registry.is_pallas(implementation) and config.interpret and varying_axes(*arrays):
        raise NotImplementedError(
            "implementation='pallas' in interpret mode (off-GPU) cannot run inside "
            "shard_map(check_vma=True): JAX's Pallas interpreter rejects inputs "
            "typed as varying over mesh axes. Use check_vma=False or "
            "implementation='xla' (or, for logits, jaxops.vocab_parallel_logprob_entropy); "
            "compiled Pallas on GPU works in both modes.")


def _check_values_in_range(host, num_vocab):
    bad = (host < 0) | (host >= num_vocab)
    if bad.any():
        rows = np.argwhere(bad)[:5]
        shown = ", ".join(
            f"{tuple(int(i) for i in r) if len(r) > 1 else int(r[0])}: {host[tuple(r)]}"
            for r in rows)
        raise ValueError(
            f"targets must lie in [0, {num_vocab}); {int(bad.sum())} row(s) do not "
            f"(row: value) {shown}")


def check_linear_call(hidden, weight, chunk_size, implementation):
    """The fused head's own arguments: `hidden` `[..., H]`, `weight` `[V_loc, H]` of one
    dtype the implementation takes, `chunk_size` None or an int >= 1."""
    check_array("hidden", hidden)
    check_array("weight", weight)
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
        ("float64",) if implementation == registry.REFERENCE else ())
    if jnp.dtype(hidden.dtype).name not in allowed:
        raise TypeError(f"hidden and weight must be one of {list(allowed)} for implementation "
                        f"{implementation!r}, got {jnp.dtype(hidden.dtype).name}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(
            chunk_size, (int, np.integer)) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
