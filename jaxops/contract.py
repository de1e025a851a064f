"""What every statistics implementation (`xla.py`, `pallas_gpu.py`) provides and returns.

A leaf module: it imports nothing from `jaxops`, so the implementations, `stats.py`,
`combine.py` and `staged.py` can all depend on it without an import cycle.

An implementation module supplies two functions:

  forward_stats(logits, local_targets, keep_mask, *, inv_tau, with_entropy,
                config) -> LocalStats
  backward_logits(logits, local_targets, keep_mask, max_logit, masked_max,
                  coefs, *, inv_tau, config) -> dlogits

`logits` is this shard's `[T, V_loc]` (float32, bfloat16 or float16), `local_targets`
`[T]` int32 indices into the shard (out of range: the target lives elsewhere),
`keep_mask` `[T, V_loc]` bool or None, and `config` the implementation's launch
parameters (a `PallasConfig` for "pallas"; ignored by "xla"). `max_logit` and
`masked_max` are the forward's fields of the same names. The backward computes,
per element (x = logits * inv_tau, m = max_logit, e = exp(x - m)):

  dx_j = e_j * (coef_sum + coef_shifted * (x_j - m))            # entropy, LSE
       + [kept_j] * exp(x_j - masked_max) * coef_masked          # masked LSE
       + [j == target] * coef_target                            # target logit
  dlogits_j = dx_j * inv_tau, rounded once to the logits' dtype,

where kept_j = keep_mask_j or j == target (the target always counts as kept).
"""

from __future__ import annotations

from typing import NamedTuple

import jax

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
