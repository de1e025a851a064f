"""The tests' one tolerance table and one float64 oracle (docs/design.md §8).

With x = logits / temperature and the float64 numbers computed by
`implementation="reference"` on the *same input values* upcast to float64:

    log-prob, entropy:  |err| <= VALUE_RTOL * max(1, max_j |x[t, j]|)      (per row)
    gradient:           ||g - g64|| / ||g64|| <= GRAD_RTOL[dtype of the logits]

design §8 states the gradient targets for |x| up to X_RANGE; beyond that an fp32
x = logits / tau is itself off by ~eps32 * |x|, which moves the probabilities by as
much (relative), so `grad_rtol(dtype, max_abs_x)` grows the fp32 part of the
allowance in proportion to max |x|, as the value bound does.

Used by the tests of the JAX op (tests/jaxops/: _logprob_cases.py, test_mosaic*.py,
test_large_sizes.py, the vocab-parallel _sharding_cases.py, ...), tests/_linear_cases.py
and the PyTorch bridge scenarios
(tests/bridge/_bridge_scenarios.py, which have their own float64 torch reference but take
their tolerances from here). JAX is imported on first use only: the bridge's spawned
processes import this module before the bridge has configured JAX.
"""

from __future__ import annotations

import functools

import numpy as np

VALUE_RTOL = 1e-5
GRAD_RTOL = {"float32": 1e-5, "bfloat16": 4e-3, "float16": 1e-3}
X_RANGE = 30.0


def dtype_name(dtype) -> str:
    """"float32" etc. for a NumPy/JAX dtype or scalar type, a torch dtype, or a name."""
    if isinstance(dtype, str):
        return dtype.removeprefix("torch.")
    if type(dtype).__module__.startswith("torch"):
        return str(dtype).removeprefix("torch.")
    return np.dtype(dtype).name


def grad_rtol(dtype, max_abs_x: float = 0.0) -> float:
    """The gradient tolerance for logits of `dtype` whose largest |x| is `max_abs_x`."""
    return GRAD_RTOL[dtype_name(dtype)] + GRAD_RTOL["float32"] * max(
        0.0, max_abs_x / X_RANGE - 1.0)


def value_bound(logits, temperature, rtol: float = VALUE_RTOL):
    """Per-row bound rtol * max(1, max_j |x|), over the finite x (docs/design.md §8: rtol = 1e-5)."""
    x = np.asarray(logits).astype(np.float64) / temperature
    finite = np.where(np.isfinite(x), np.abs(x), 0.0)
    return rtol * np.maximum(1.0, finite.max(axis=-1, initial=0.0))


def largest_abs_x(logits, temperature) -> float:
    x = np.asarray(logits).astype(np.float64) / temperature
    return float(np.abs(x[np.isfinite(x)]).max(initial=0.0))


def to_float64(logits):
    """The same values as float64 (host-side: no compile per input dtype)."""
    import jax.numpy as jnp

    return jnp.asarray(np.asarray(logits).astype(np.float64))


@functools.cache
def _reference64_jit():
    import jax

    import jaxops

    @functools.partial(jax.jit, static_argnames=("temperature",))
    def reference64(logits, targets, keep_mask, g_log_prob, g_entropy, *, temperature):
        def op(x):
            return jaxops.logprob_entropy(x, targets, keep_mask=keep_mask,
                                          temperature=temperature, implementation="reference")

        (log_prob, entropy), vjp = jax.vjp(op, logits)
        (grad,) = vjp((g_log_prob.astype(jax.numpy.float64),
                       g_entropy.astype(jax.numpy.float64)))
        return log_prob, entropy, grad

    return reference64


def reference64(logits, targets, keep_mask, g_log_prob, g_entropy, *, temperature):
    """(log_prob, entropy, d logits) of the float64 reference for cotangents (g_lp, g_H).

    `logits` are taken as float64 (their values upcast). Entropy is always on with its
    gradient here: the flags of the call under test are checked against the definition
    (which cotangent reaches the logits), not against the reference's own handling of
    them; pass g_H = 0 for a call whose entropy has no gradient. Works with or without
    `jax_enable_x64` set globally.
    """
    import jax

    with jax.enable_x64(True):
        return _reference64_jit()(
            np.asarray(logits).astype(np.float64), targets, keep_mask, g_log_prob, g_entropy,
            temperature=temperature)


def assert_values_close(name, got, want, bound):
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape}, expected {want.shape}"
    assert np.all(np.isfinite(want)), f"{name}: the reference itself is not finite"
    nonfinite = ~np.isfinite(got)
    assert not nonfinite.any(), (
        f"{name}: non-finite at rows {np.argwhere(nonfinite)[:5].tolist()}")
    err = np.abs(got - want)
    bad = ~(err <= bound)
    if bad.any():
        worst = np.unravel_index(np.argmax(err / bound), err.shape)
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {bad.size} rows exceed the bound; worst row "
            f"{tuple(int(i) for i in worst)}: got {got[worst]!r}, want {want[worst]!r}, "
            f"|err| {err[worst]:.3g} > bound {np.broadcast_to(bound, err.shape)[worst]:.3g}")


def assert_grad_close(grad, grad64, dtype, floor=0.0, max_abs_x=0.0, *, rtol=None,
                      name="gradient") -> float:
    """||g - g64|| <= rtol * max(||g64||, floor), rtol = grad_rtol(dtype, max|x|) unless
    given; the gradient must have the logits' dtype. Returns ||g - g64|| / ||g64||.

    `floor` (about the cotangents' size / temperature) only matters where the exact
    gradient is ~0, e.g. V = 1, where plain fp32 rounding of g_lp - g_lp is all there is.
    """
    assert dtype_name(grad.dtype) == dtype_name(dtype), (
        f"{name} dtype {grad.dtype}, logits are {dtype_name(dtype)}")
    assert grad.shape == grad64.shape, f"{name} shape {grad.shape}, expected {grad64.shape}"
    got = np.asarray(grad).astype(np.float64)
    want = np.asarray(grad64, np.float64)
    assert np.all(np.isfinite(want)), f"the reference {name} itself is not finite"
    nonfinite = ~np.isfinite(got)
    assert not nonfinite.any(), f"non-finite {name} at {np.argwhere(nonfinite)[:5].tolist()}"
    err, norm = np.linalg.norm(got - want), np.linalg.norm(want)
    rtol = grad_rtol(dtype, max_abs_x) if rtol is None else rtol
    assert err <= rtol * max(norm, floor), (
        f"{name} ||g - g64|| / ||g64|| = {err / max(norm, 1e-300):.3g} > {rtol:g} "
        f"(||g64|| = {norm:.3g}, max |g - g64| = {np.max(np.abs(got - want), initial=0):.3g})")
    return float(err / max(norm, 1e-30))


def assert_op_close(logits, temperature, got, want, with_entropy: bool) -> None:
    """The op's (log_prob, entropy, d logits) `got` against the float64 `want` of
    `reference64`: values within `value_bound`, entropy on rows whose logits are all
    finite (elsewhere the reference's is not defined the same way), None without it."""
    (log_prob, entropy, grad), (lp64, ent64, grad64) = got, want
    bound = value_bound(logits, temperature)
    assert_values_close("log_prob", log_prob, lp64, bound)
    if with_entropy:
        finite = np.all(np.isfinite(np.asarray(logits, np.float64)), axis=-1)
        assert_values_close("entropy", np.asarray(entropy)[finite],
                            np.asarray(ent64)[finite], bound[finite])
    else:
        assert entropy is None
    assert_grad_close(grad, grad64, logits.dtype,
                      max_abs_x=largest_abs_x(logits, temperature))
