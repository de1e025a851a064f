"""Inputs and the float64 oracle for `jaxops.linear_logprob_entropy`
(tests/jaxops/test_linear_head*.py and its multi-device worker
tests/jaxops/_linear_head_worker.py), also used by the bridge's tests of
`bridge.linear_logprob_entropy` (tests/bridge/test_bridge_linear*.py).

The oracle is the op itself with `implementation="reference"` on the same hidden and
weight values upcast to float64: logits = hidden @ weight.T in float64, then the
reference definition, differentiated by JAX. Tolerances are tests/_oracle.py's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxops
from _oracle import assert_grad_close, assert_values_close, largest_abs_x, value_bound


def make_linear_inputs(seed, lead, hidden_size, num_vocab, dtype, *, mask=False, scale=3.0,
                       total_vocab=None):
    """hidden [*lead, H], weight [V, H] (rounded once to `dtype`; logits ~ scale), int32
    targets in [0, total_vocab or V), a random bool mask [*lead, V] or None, and
    float32 cotangents for both outputs (numpy arrays)."""
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((*lead, hidden_size)).astype(np.float32)
    weight = (scale / np.sqrt(hidden_size)
              * rng.standard_normal((num_vocab, hidden_size))).astype(np.float32)
    targets = rng.integers(0, total_vocab or num_vocab, lead).astype(np.int32)
    keep = (rng.random((*lead, num_vocab)) < 0.3) if mask else None
    cts = rng.standard_normal((2, *lead)).astype(np.float32)
    as_dtype = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))  # noqa: E731
    return dict(hidden=as_dtype(hidden), weight=as_dtype(weight), targets=targets, mask=keep,
                d_log_prob=cts[0], d_entropy=cts[1])


@functools.cache
def _reference64_jit(temperature):
    def run(hidden, weight, targets, mask, g_lp, g_h):
        (log_prob, entropy), vjp = jax.vjp(
            lambda h, w: jaxops.linear_logprob_entropy(
                h, w, targets, keep_mask=mask, temperature=temperature,
                implementation="reference"), hidden, weight)
        return (log_prob, entropy) + vjp((g_lp.astype(jnp.float64), g_h.astype(jnp.float64)))

    return jax.jit(run)


def linear_reference64(data, temperature, entropy_cotangent=True):
    """(log_prob, entropy, d hidden, d weight) in float64 for the data's cotangents
    (the entropy's replaced by 0 when its gradient is off)."""
    g_h = data["d_entropy"] if entropy_cotangent else np.zeros_like(data["d_entropy"])
    with jax.enable_x64(True):
        out = _reference64_jit(float(temperature))(
            np.asarray(data["hidden"], np.float64), np.asarray(data["weight"], np.float64),
            data["targets"], data["mask"], data["d_log_prob"], g_h)
        return [np.asarray(x) for x in out]


def check_linear(label, got, data, dtype, *, temperature, with_entropy, entropy_grad):
    """got = (log_prob, entropy, d hidden, d weight) of the op under test for the data's
    cotangents, against the float64 reference: values per row, gradients by norm, dtypes.
    Returns the two gradients' relative errors."""
    log_prob, entropy, d_hidden, d_weight = got
    lead = data["targets"].shape
    assert log_prob.dtype == jnp.float32 and log_prob.shape == lead, (label, log_prob.dtype)
    if with_entropy:
        assert entropy is not None and entropy.dtype == jnp.float32 and entropy.shape == lead
    else:
        assert entropy is None, (label, "entropy should be None")
    lp64, h64, dh64, dw64 = linear_reference64(data, temperature, with_entropy and entropy_grad)
    g_used = data["d_entropy"] if (with_entropy and entropy_grad) else 0.0
    logits64 = (np.asarray(data["hidden"], np.float64).reshape(-1, data["hidden"].shape[-1])
                @ np.asarray(data["weight"], np.float64).T).reshape(lead + (-1,))
    bound = value_bound(logits64, temperature)
    assert_values_close(f"{label}: log_prob", log_prob, lp64, bound)
    if with_entropy:
        assert_values_close(f"{label}: entropy", entropy, h64, bound)
    max_x = largest_abs_x(logits64, temperature)
    # As tests/jaxops/_logprob_cases.py's floor on d logits (0.1 * the cotangents' size /
    # tau), times the matmul's other factor: it only matters where the exact gradient
    # is ~0 (V = 1), where fp32 rounding of g - g is all there is.
    scale = 0.1 * float(np.linalg.norm(data["d_log_prob"]) + np.linalg.norm(g_used)) / temperature
    return (assert_grad_close(d_hidden, dh64, dtype, max_abs_x=max_x, name=f"{label}: d hidden",
                              floor=scale * float(np.abs(data["weight"]).max())),
            assert_grad_close(d_weight, dw64, dtype, max_abs_x=max_x, name=f"{label}: d weight",
                              floor=scale * float(np.abs(data["hidden"]).max(initial=0.0))))


def _on_each_trace(set_attr, kernel: str, record):
    """Replace the fused kernel `mosaic_linear.<kernel>` (with `set_attr`: a test's
    `monkeypatch.setattr`, or plain `setattr` in a worker process) by one that calls
    `record(args)` on each trace, then the kernel."""
    from jaxops.backends.mosaic import linear as mosaic_linear

    real = getattr(mosaic_linear, kernel)

    def counted(*args, **kwargs):
        record(args)
        return real(*args, **kwargs)

    set_attr(mosaic_linear, kernel, counted)


def count_fused_calls(monkeypatch, kernel: str = "forward_stats") -> list:
    """Patch the fused kernel `mosaic_linear.<kernel>` ("forward_stats", the fused
    forward, or "backward_logits", the backward's recomputing d logits kernel) to record
    the hidden shape of each call it is traced with; returns that list. Callers clear
    the caches of the jitted functions under test, so that they trace afresh."""
    calls = []
    _on_each_trace(monkeypatch.setattr, kernel, lambda args: calls.append(args[0].shape))
    return calls


def record_fused_traces(set_attr=setattr) -> list:
    """Wrap both fused kernels (`mosaic_linear.forward_stats` and `backward_logits`) with
    `set_attr` (a test's `monkeypatch.setattr`, or plain `setattr` in a worker process)
    so that each trace appends (kernel name, hidden shape, weight shape) to the returned
    list. Callers clear the caches of the jitted functions under test first."""
    traced = []
    for name in ("forward_stats", "backward_logits"):
        _on_each_trace(set_attr, name, lambda args, name=name: traced.append(
            (name, tuple(args[0].shape), tuple(args[1].shape))))
    return traced
