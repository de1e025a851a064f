"""Bad calls of `jaxops.logprob_entropy` raise naming the argument (docs/design.md §2); the
temperature's accepted and refused forms; out-of-range targets: an error eagerly, NaN
rows under jit."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxops

from _logprob_cases import (
    BASE_LEAD, BASE_TAU, BASE_V, F32, IMPLEMENTATIONS, make_inputs, op_with_vjp_jit,
    random_cotangents,
)
from _oracle import assert_values_close, reference64, to_float64, value_bound


# --------------------------------------------------------------- bad calls, targets


def _bad_call_cases():
    x = jnp.zeros((3, 7), F32)
    t = jnp.zeros((3,), jnp.int32)
    m = jnp.zeros((3, 7), bool)
    return [
        ("logits-list", dict(logits=[[0.0] * 7] * 3), TypeError, "logits"),
        ("logits-int", dict(logits=jnp.zeros((3, 7), jnp.int32)), TypeError, "logits"),
        ("logits-0d", dict(logits=jnp.float32(1.0), targets=jnp.zeros((), jnp.int32)),
         ValueError, "logits"),
        ("logits-V0", dict(logits=jnp.zeros((3, 0), F32)), ValueError, "logits"),
        ("logits-f64-pallas", dict(logits=x.astype(jnp.float64), implementation="pallas"),
         TypeError, "logits"),
        ("logits-f64-xla", dict(logits=x.astype(jnp.float64), implementation="xla"),
         TypeError, "logits"),
        ("logits-f64-default", dict(logits=x.astype(jnp.float64), implementation=None),
         TypeError, "logits"),
        ("targets-list", dict(targets=[0, 0, 0]), TypeError, "targets"),
        ("targets-float", dict(targets=t.astype(F32)), TypeError, "targets"),
        ("targets-bool", dict(targets=t.astype(bool)), TypeError, "targets"),
        ("targets-short", dict(targets=jnp.zeros((4,), jnp.int32)), ValueError, "targets"),
        ("targets-rank", dict(targets=jnp.zeros((3, 1), jnp.int32)), ValueError, "targets"),
        ("mask-shape", dict(keep_mask=m[:, :6]), ValueError, "keep_mask"),
        ("mask-rank", dict(keep_mask=m[None]), ValueError, "keep_mask"),
        ("mask-int", dict(keep_mask=m.astype(jnp.int32)), TypeError, "keep_mask"),
        ("mask-float", dict(keep_mask=m.astype(F32)), TypeError, "keep_mask"),
        ("mask-list", dict(keep_mask=[[True] * 7] * 3), TypeError, "keep_mask"),
        ("temperature-0", dict(temperature=0.0), ValueError, "temperature"),
        ("temperature-negative", dict(temperature=-1.0), ValueError, "temperature"),
        ("temperature-nan", dict(temperature=float("nan")), ValueError, "temperature"),
        ("temperature-inf", dict(temperature=float("inf")), ValueError, "temperature"),
        ("temperature-bool", dict(temperature=True), TypeError, "temperature"),
        ("temperature-str", dict(temperature="1.0"), TypeError, "temperature"),
        ("temperature-vector", dict(temperature=jnp.ones((2,))), TypeError, "temperature"),
        ("implementation", dict(implementation="cuda"), ValueError, "implementation"),
        ("with_entropy-int", dict(with_entropy=1), TypeError, "with_entropy"),
        ("with_entropy-None", dict(with_entropy=None), TypeError, "with_entropy"),
        ("entropy_grad-str", dict(entropy_grad="yes"), TypeError, "entropy_grad"),
        ("reference-axis_name", dict(implementation="reference", axis_name="vocab"),
         ValueError, "axis_name"),
    ], dict(logits=x, targets=t)


_BAD_CALLS, _GOOD_CALL = _bad_call_cases()


@pytest.mark.parametrize("kwargs,error,argument", [c[1:] for c in _BAD_CALLS],
                         ids=[c[0] for c in _BAD_CALLS])
def test_bad_calls_raise_naming_the_argument(kwargs, error, argument):
    call = {"implementation": "xla", **_GOOD_CALL, **kwargs}
    with pytest.raises(error, match=argument):
        jaxops.logprob_entropy(call.pop("logits"), call.pop("targets"), **call)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_traced_temperature_is_rejected(implementation):
    logits, targets, _ = make_inputs(9, (3,), 7)
    op = jax.jit(lambda x, tau: jaxops.logprob_entropy(
        x, targets, temperature=tau, implementation=implementation))
    with pytest.raises(TypeError, match="temperature"):
        op(logits, 0.7)


def test_concrete_temperature_forms_are_accepted():
    logits, targets, _ = make_inputs(9, (3,), 7)
    results = [jaxops.logprob_entropy(logits, targets, temperature=tau, implementation="xla")
               for tau in (0.7, np.float32(0.7), np.float64(0.7), jnp.asarray(0.7), 7 / 10)]
    for log_prob, entropy in results[1:]:
        np.testing.assert_allclose(log_prob, results[0][0], rtol=1e-6)
        np.testing.assert_allclose(entropy, results[0][1], rtol=1e-6)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("lead,bad_row,bad_value", [((6,), (4,), 300), ((2, 3), (1, 2), -1)],
                         ids=["1d-too-large", "2d-negative"])
def test_out_of_range_targets_raise_eagerly(implementation, lead, bad_row, bad_value):
    logits, targets, keep_mask = make_inputs(10, lead, 300, mask="random")
    targets = targets.at[bad_row].set(bad_value)
    row = str(bad_row[0]) if len(bad_row) == 1 else str(bad_row)
    with pytest.raises(ValueError, match=rf"targets.*{re.escape(row)}: {bad_value}"):
        jaxops.logprob_entropy(logits, targets, keep_mask=keep_mask,
                               implementation=implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("mask", [None, "random"], ids=["nomask", "mask"])
def test_out_of_range_targets_give_nan_under_jit(implementation, mask):
    """Only the bad rows' log-prob is NaN; everything else stays finite and right."""
    logits, good_targets, keep_mask = make_inputs(11, BASE_LEAD, BASE_V, mask=mask)
    bad = np.zeros(BASE_LEAD, bool)
    bad[[1, 4]] = True
    targets = good_targets.at[1].set(BASE_V).at[4].set(-1)
    g_lp, g_h = random_cotangents(11, BASE_LEAD)
    log_prob, entropy, grad = op_with_vjp_jit(  # targets are traced inside
        logits, targets, keep_mask, g_lp, g_h, temperature=BASE_TAU, with_entropy=True,
        entropy_grad=True, implementation=implementation)
    assert np.all(np.isnan(np.asarray(log_prob)[bad])), "out-of-range rows must be NaN"
    assert np.all(np.isfinite(np.asarray(log_prob)[~bad])), "NaN leaked into valid rows"
    assert np.all(np.isfinite(np.asarray(grad)[~bad])), "NaN leaked into valid rows' gradient"
    lp64, h64, _ = reference64(to_float64(logits), good_targets, keep_mask, g_lp, g_h,
                               temperature=BASE_TAU)
    bound = value_bound(logits, BASE_TAU)
    assert_values_close("log_prob (valid rows)", np.asarray(log_prob)[~bad],
                        np.asarray(lp64)[~bad], bound[~bad])
    # The entropy does not depend on the target: every row keeps its value.
    assert_values_close("entropy", entropy, h64, bound)
