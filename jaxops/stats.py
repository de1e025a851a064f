"""Per-shard softmax statistics: the one place where the `[T, V_loc]` logits are touched.

`local_stats` reduces each row of this shard's logits to a handful of numbers
(SPEC §3). Everything downstream -- the cross-shard combine, log-prob,
entropy -- is plain differentiable JAX on `[T]` arrays (see `combine.py`).

Its custom VJP differentiates the sums with the row maxima held constant.
That is exact for anything computed from the statistics that does not depend
on which reference maximum was used (log-sum-exp, entropy, log-prob), and it
lets the backward recompute every probability from the logits and the saved
maxima: O(T) residuals, no saved softmax, one write of the gradient.

A backend (`xla.py`, `pallas_gpu.py`) supplies two functions:

  forward_stats(logits, local_targets, keep_mask, *, inv_tau, with_entropy,
                config) -> LocalStats
  backward_logits(logits, local_targets, keep_mask, max_logit, masked_max,
                  coefs, *, inv_tau, config) -> dlogits

with the backward computing, per element (x = logits * inv_tau, e = exp(x - m)):

  dx_j = e_j * (coef_sum + coef_shifted * (x_j - m))            # entropy, LSE
       + [kept_j] * exp(x_j - masked_max) * coef_masked          # masked LSE
       + [j == target] * coef_target                            # target logit
  dlogits_j = dx_j * inv_tau, rounded once to the logits' dtype.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

# A finite stand-in for -inf inside the kernels. Clamping logits to it keeps
# products like exp(x - m) * (x - m) at 0 instead of 0 * inf = NaN, while
# exp(NEG - m) still underflows to exactly 0 for any real row maximum m.
NEG = -1e30


class LocalStats(NamedTuple):
    """Row statistics of one vocabulary shard, all float32 `[T]`.

    `max_logit` / `masked_max` are -inf (and the matching sums 0) where the
    shard holds no finite logit / no kept logit for that row.
    """

    max_logit: jax.Array  # m = max_j x_j
    sum_exp: jax.Array  # s = sum_j exp(x_j - m)
    sum_exp_shifted: jax.Array | None  # a = sum_j exp(x_j - m) (x_j - m); None without entropy
    target_logit: jax.Array  # x_y if the target lives on this shard, else 0
    masked_max: jax.Array | None  # over kept_j = keep_mask_j or j == target
    masked_sum_exp: jax.Array | None  # sum over kept_j of exp(x_j - masked_max)


class BackwardCoefs(NamedTuple):
    """Per-row cotangent coefficients for `backward_logits`, float32 `[T]`."""

    coef_sum: jax.Array
    coef_shifted: jax.Array | None
    coef_target: jax.Array
    coef_masked: jax.Array | None


def backward_coefs(cotangents: LocalStats, entropy_grad: bool, masked: bool) -> BackwardCoefs:
    """Backward-kernel coefficients from the cotangents of the statistics."""
    # d a / d x_j = e_j (x_j - m) + e_j, so the entropy cotangent also feeds coef_sum.
    coef_sum = cotangents.sum_exp
    coef_shifted = None
    if entropy_grad:
        coef_shifted = cotangents.sum_exp_shifted
        coef_sum = coef_sum + coef_shifted
    return BackwardCoefs(
        coef_sum=coef_sum,
        coef_shifted=coef_shifted,
        coef_target=cotangents.target_logit,
        coef_masked=cotangents.masked_sum_exp if masked else None,
    )


def _backend(name: str):
    if name == "pallas":
        from jaxops import pallas_gpu

        return pallas_gpu
    if name == "xla":
        from jaxops import xla

        return xla
    raise ValueError(f"unknown statistics backend {name!r}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def local_stats(
    logits: jax.Array,  # [T, V_loc] float32 | bfloat16 | float16
    local_targets: jax.Array,  # [T] int32, index into this shard (may be out of range)
    keep_mask: jax.Array | None,  # [T, V_loc] bool or None
    inv_tau: float,
    with_entropy: bool,
    entropy_grad: bool,
    backend: str,
    config: tuple,
) -> LocalStats:
    """This shard's row statistics; see the module docstring."""
    del entropy_grad
    return _backend(backend).forward_stats(
        logits, local_targets, keep_mask, inv_tau=inv_tau,
        with_entropy=with_entropy, config=config)


def _local_stats_fwd(logits, local_targets, keep_mask, inv_tau, with_entropy,
                     entropy_grad, backend, config):
    stats = local_stats(logits, local_targets, keep_mask, inv_tau, with_entropy,
                        entropy_grad, backend, config)
    residuals = (logits, local_targets, keep_mask, stats.max_logit, stats.masked_max)
    return stats, residuals


def _local_stats_bwd(inv_tau, with_entropy, entropy_grad, backend, config,
                     residuals, cotangents: LocalStats):
    logits, local_targets, keep_mask, max_logit, masked_max = residuals
    coefs = backward_coefs(cotangents, with_entropy and entropy_grad, keep_mask is not None)
    dlogits = _backend(backend).backward_logits(
        logits, local_targets, keep_mask, max_logit, masked_max, coefs,
        inv_tau=inv_tau, config=config)
    return dlogits, None, None


local_stats.defvjp(_local_stats_fwd, _local_stats_bwd)


def varying_axes(*arrays) -> frozenset:
    """Manual mesh axes any of `arrays` varies over (inside `shard_map` with `check_vma=True`).

    Empty outside `shard_map` and under `check_vma=False`, where values carry no
    varying-manual-axes type. `None` entries are ignored.
    """
    axes = frozenset()
    for x in arrays:
        if x is None:
            continue
        aval = jax.typeof(x)
        mat = getattr(aval, "manual_axis_type", None)  # jax 0.10, 0.11 (checked)
        axes |= frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))
    return axes


def varying_struct(shape, dtype, *like) -> jax.ShapeDtypeStruct:
    """`out_shape` for a per-shard kernel output computed from the arrays `like`.

    Under `shard_map(check_vma=True)` a `pallas_call` must declare the mesh axes
    its outputs vary over; a kernel that works on this shard's data produces
    values that vary over every axis any of its inputs varies over. Elsewhere the
    set is empty and changes nothing.
    """
    varying = varying_axes(*like)
    try:
        return jax.ShapeDtypeStruct(
            shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=varying))
    except (AttributeError, TypeError):  # the older spelling of the same field
        return jax.ShapeDtypeStruct(shape, dtype, vma=varying)
