"""Extreme logits through `jaxops.logprob_entropy` and the backends' statistics: ±1e4 and
-inf logits, kept logits far below the row maximum, the masked sum's reference point,
and the backward's rounded `out_dtype`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from _logprob_cases import (
    BASE_LEAD, BASE_TAU, BASE_V, BF16, DTYPES, F32, IMPLEMENTATIONS, check_against_reference,
    dtype_id, interpret_config, make_inputs, random_cotangents,
)
from _oracle import VALUE_RTOL, assert_values_close, reference64, to_float64


# ------------------------------------------------------------------ extreme logits


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_extreme_logits(implementation, dtype):
    """±1e4 logits: finite outputs and gradients, within the (scaled) precision bound."""
    rng = np.random.default_rng(6)
    logits, targets, keep_mask = make_inputs(6, BASE_LEAD, BASE_V, dtype, mask="mixed")
    extreme = rng.choice([-1e4, 1e4, 0.0], size=logits.shape, p=[0.3, 0.02, 0.68])
    extreme[:, 17] = 1e4  # every row holds +1e4 somewhere ...
    extreme[:, 23] = -1e4
    targets = targets.at[0].set(23)  # ... and row 0's target sits at -1e4
    logits = jnp.asarray(np.where(extreme != 0, extreme, np.asarray(logits, np.float32)), dtype)
    check_against_reference(logits, targets, keep_mask=keep_mask,
                            implementation=implementation, seed=6)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", (F32, BF16), ids=dtype_id)
def test_minus_inf_logits_removed_by_the_mask(implementation, dtype):
    logits, targets, keep_mask = make_inputs(7, BASE_LEAD, BASE_V, dtype, mask="random")
    rng = np.random.default_rng(7)
    target_onehot = np.arange(BASE_V) == np.asarray(targets)[:, None]
    minus_inf = (rng.random(logits.shape) < 0.3) & ~target_onehot
    minus_inf[3] = ~target_onehot[3]  # a row where only the target is finite
    logits = jnp.where(minus_inf, -jnp.inf, logits)
    keep_mask = keep_mask & ~minus_inf
    out = check_against_reference(logits, targets, keep_mask=keep_mask,
                                  implementation=implementation, seed=7)
    assert np.all(np.asarray(out.grad)[minus_inf] == 0)
    np.testing.assert_allclose(np.asarray(out.entropy)[3], 0.0, atol=1e-6)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", (F32, BF16), ids=dtype_id)
def test_kept_logits_far_below_the_row_max(implementation, dtype):
    """Max 1e4 outside the mask, kept logits around 0: the masked log-prob must not
    underflow. Checked to 1e-5 * max(1, max |kept x|), far tighter than the row bound."""
    rng = np.random.default_rng(8)
    logits, targets, keep_mask = make_inputs(8, BASE_LEAD, BASE_V, dtype, mask="random",
                                             scale=1.0)
    target_onehot = np.arange(BASE_V) == np.asarray(targets)[:, None]
    free = ~np.asarray(keep_mask) & ~target_onehot
    far = (rng.random(logits.shape) < 0.05) & free
    far[np.arange(len(far)), np.argmax(free, axis=-1)] = True  # at least one per row
    logits = jnp.where(far, 1e4, logits)
    out = check_against_reference(logits, targets, keep_mask=keep_mask,
                                  implementation=implementation, seed=8)
    lp64, _, _ = reference64(to_float64(logits), targets, keep_mask,
                             *random_cotangents(8, BASE_LEAD), temperature=BASE_TAU)
    assert np.all(np.asarray(lp64) > -20), "the test data should give moderate log-probs"
    kept_x = np.where(np.asarray(keep_mask) | target_onehot,
                      np.abs(np.asarray(logits).astype(np.float64)) / BASE_TAU, 0)
    assert_values_close("masked log_prob", out.log_prob, lp64,
                        VALUE_RTOL * np.maximum(1.0, kept_x.max(axis=-1)))


@pytest.mark.parametrize("dtype", (F32, BF16), ids=dtype_id)
def test_masked_max_is_the_reference_point_of_the_masked_sum(dtype):
    """`LocalStats.masked_max` (contract.py): the reference point r of masked_sum_exp,
    the kept max or the row max. Pallas returns the row max where the masked sum shares
    the row's exponentials and the kept max after its exact pass; r + log(masked_sum_exp)
    is the masked log-normaliser either way (here against XLA, which uses the kept max)."""
    from jaxops.backends import registry

    logits, targets, keep_mask = make_inputs(12, (4,), BASE_V, dtype, mask="random")
    # Rows 0, 1: an unkept max 2 above the others: the kept mass is large, shared path.
    # Rows 2, 3: an unkept max of 1e4: the kept terms underflow, exact pass.
    unkept = ~np.asarray(keep_mask) & (np.arange(BASE_V) != np.asarray(targets)[:, None])
    high = np.asarray(logits, np.float32).copy()
    for row, value in ((0, 2.0 + high[0].max()), (1, 2.0 + high[1].max()), (2, 1e4), (3, 1e4)):
        high[row, np.argmax(unkept[row])] = value
    logits = jnp.asarray(high, dtype)
    local_targets = targets.astype(jnp.int32)

    def stats(name, config=None):
        return registry.kernels(name).forward_stats(
            logits, local_targets, keep_mask, inv_tau=1 / BASE_TAU, with_entropy=True,
            config=config)

    pallas, xla = stats("pallas", interpret_config(block_v=128)), stats("xla")
    row_max, masked_max = np.asarray(pallas.max_logit), np.asarray(pallas.masked_max)
    kept_max = np.asarray(xla.masked_max)
    np.testing.assert_array_equal(row_max, np.asarray(xla.max_logit))
    assert np.all(kept_max < row_max - 1.0)  # no row keeps its max
    np.testing.assert_array_equal(masked_max[:2], row_max[:2])  # shared: the row max
    np.testing.assert_allclose(masked_max[2:], kept_max[2:], rtol=1e-6)  # exact pass
    assert np.all(masked_max[2:] < row_max[2:] - 1e3)
    normaliser = masked_max + np.log(np.asarray(pallas.masked_sum_exp))
    want = kept_max + np.log(np.asarray(xla.masked_sum_exp))
    np.testing.assert_allclose(normaliser, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("mask", [None, "random"])
@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_backward_out_dtype_is_the_rounded_gradient(implementation, mask):
    """`backward_logits(..., out_dtype=bf16)` on fp32 logits (what the fused head asks for)
    is bitwise the fp32 gradient rounded to bf16: the Triton kernel rounds as it stores,
    the XLA path after its arithmetic."""
    from jaxops import contract
    from jaxops.backends import registry

    logits, targets, keep_mask = make_inputs(13, (37,), 300, F32, mask=mask)
    local_targets = targets.astype(jnp.int32)
    config = interpret_config(block_v=128) if implementation == "pallas" else None
    kernels = registry.kernels(implementation)
    stats = kernels.forward_stats(logits, local_targets, keep_mask, inv_tau=1 / BASE_TAU,
                                  with_entropy=True, config=config)
    rng = np.random.default_rng(0)
    cot = contract.LocalStats(*[jnp.asarray(rng.standard_normal(37), F32) for _ in range(6)])
    coefs = contract.backward_coefs(cot, True, keep_mask is not None)

    def grad(out_dtype):
        return kernels.backward_logits(
            logits, local_targets, keep_mask, stats.max_logit, stats.masked_max, coefs,
            inv_tau=1 / BASE_TAU, config=config, out_dtype=out_dtype)

    wide, narrow = grad(None), grad(jnp.bfloat16)
    assert wide.dtype == F32 and narrow.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(narrow.astype(F32)),
                                  np.asarray(wide.astype(jnp.bfloat16).astype(F32)))
    assert np.any(np.asarray(wide) != np.asarray(narrow.astype(F32)))  # it did round
