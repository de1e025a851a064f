"""What every statistics implementation (`backends/xla.py`, `backends/triton/kernels.py`) provides and returns.

A leaf module: it imports nothing from `jaxops`, so the implementations, `stats.py`,
`combine.py` and `staged.py` can all depend on it without an import cycle.

An implementation module supplies two functions:

  forward_stats(logits, local_targets, keep_mask, *, inv_tau, with_entropy,
                config) -> LocalStats
  backward_logits(logits, local_targets, keep_mask, max_logit, masked_max,
                  coefs, *, inv_tau, config, out_dtype=None) -> dlogits

`logits` is this shard's `[T, V_loc]` (float32, bfloat16 or float16), `local_targets`
`[T]` int32 indices into the shard (out of range: the target lives elsewhere),
`keep_mask` `[T, V_loc]` bool (uint8, nonzero = kept, for "pallas_mosaic") or None, and
`config` the implementation's launch parameters (a `PallasConfig` for "pallas"; ignored
by "xla"). `max_logit` and `masked_max` are the forward's fields of the same names. The
backward computes,
per element (x = logits * inv_tau, m = max_logit, r = masked_max, e = exp(x - m)):

  dx_j = e_j * (coef_sum + coef_shifted * (x_j - m))            # entropy, LSE
       + [kept_j] * exp(x_j - r) * coef_masked                   # masked LSE
       + [j == target] * coef_target                            # target logit
  dlogits_j = dx_j * inv_tau, rounded once to the logits' dtype (or `out_dtype`: the
              fused head hands fp32 logits chunks in and wants d logits in bf16),

where kept_j = keep_mask_j or j == target (the target always counts as kept).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# A finite stand-in for -inf inside the kernels. Clamping logits to it keeps
# products like exp(x - m) * (x - m) at 0 instead of 0 * inf = NaN, while
# exp(NEG - m) still underflows to exactly 0 for any real row maximum m.
NEG = -1e30


class LocalStats(NamedTuple):
    """Row statistics of one vocabulary shard, all float32 `[T]`, x = logits * inv_tau.

    `max_logit` is -inf (and `sum_exp`, `sum_exp_shifted` are 0) where the shard holds
    no finite logit for that row.

    `masked_max` is *the reference point r of `masked_sum_exp`*, not necessarily the
    largest kept logit: masked_sum_exp = sum over kept_j of exp(x_j - r). An
    implementation may use either

      * the kept maximum, max over kept_j of x_j (the XLA implementation, and the
        Pallas forward's exact second pass), or
      * the row maximum, r = max_logit (the Pallas forward when the masked sum shares
        the row's exponentials; it does so only where that sum is >= 2**-60, so that
        the kept terms that underflowed are negligible).

    Either way r >= every kept x_j, so no term exceeds 1. Where this shard keeps no
    finite logit of the row, r = -inf and masked_sum_exp = 0.
    Consumers must only use r as the reference point that it is: the masked
    log-normaliser r + log(masked_sum_exp) is the same whichever r was chosen
    (`combine.py` rescales each shard's sum to the largest r over shards), and the
    backward recomputes exp(x_j - r) with the r the forward returned.
    """

    max_logit: jax.Array  # m = max_j x_j
    sum_exp: jax.Array  # s = sum_j exp(x_j - m)
    sum_exp_shifted: jax.Array | None  # a = sum_j exp(x_j - m) (x_j - m); None without entropy
    target_logit: jax.Array  # x_y if the target lives on this shard, else 0
    masked_max: jax.Array | None  # r, the reference point of masked_sum_exp (see above)
    masked_sum_exp: jax.Array | None  # sum over kept_j of exp(x_j - r); None without a mask


def present_fields(with_entropy: bool, masked: bool) -> tuple[str, ...]:
    """The `LocalStats` fields a forward returns (the others are None), in `LocalStats`
    order: every packing of the statistics (`staged.py`) uses this order. A new
    statistic is a new field of `LocalStats` and, if optional, a flag here."""
    optional = {"sum_exp_shifted": with_entropy, "masked_max": masked,
                "masked_sum_exp": masked}
    return tuple(f for f in LocalStats._fields if optional.get(f, True))


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


def ids_from_words(low, high):
    """int32 target ids from the two int32 words (`low`, `high`) of little-endian int64
    ids, as torch stores its targets (read without a conversion pass): the low word where
    the id is in [0, 2**31), else -1. Dropping the high word instead would turn an
    out-of-range id into a plausible one (2**32 + 5 into 5)."""
    return jnp.where((high == 0) & (low >= 0), low, -1)


def masked_sum_shares_row_reference(max_logit, masked_max):
    """True where the masked sum's reference point is the row maximum (r == m).

    There exp(x_j - r) is exp(x_j - m) bit for bit (same reference, same arithmetic),
    so a backward may compute one exponential per element for both the LSE and the
    masked-LSE terms. This is an exact shortcut, not a flag: it holds whichever way
    the forward chose r, including a kept maximum that happens to equal the row max.
    """
    return masked_max == max_logit


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


def vary_like(x, *like):
    """`x` typed as varying over every mesh axis that `like` vary over (check_vma=True);
    unchanged elsewhere. Its transpose sums the cotangent over the added axes. Mosaic GPU
    kernels need it on their outputs: `plgpu.kernel` traces with the check off, so their
    outputs come back invariant whatever `out_type` declares."""
    missing = tuple(sorted(varying_axes(*like) - varying_axes(x)))
    if not missing:
        return x
    from jax import lax

    pcast = getattr(lax, "pcast", None)
    return pcast(x, missing, to="varying") if pcast else lax.pvary(x, missing)
