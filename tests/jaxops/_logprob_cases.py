"""Shared pieces of the `jaxops.logprob_entropy` tests (tests/jaxops/test_logprob_*.py and
test_large_sizes.py): the common cases, input makers, and the op under `jax.vjp` checked
against the float64 reference of tests/_oracle.py (docs/design.md §2 and §8).

Off-GPU, Pallas runs in interpret mode (slow), so the tests' shapes are small; their
parameters marked `gpu` add production-size shapes that only run where the kernels are
compiled for real (`jax.default_backend() == "gpu"`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxops

from _oracle import (  # the one float64 oracle and tolerance table
    assert_grad_close,
    assert_values_close,
    largest_abs_x,
    reference64,
    to_float64,
    value_bound,
)

ON_GPU = jax.default_backend() == "gpu"
JAX_VERSION = tuple(int(part) for part in jax.__version__.split(".")[:2])
IMPLEMENTATIONS = ("pallas", "xla", "reference")
FAST = ("pallas", "xla")
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
DTYPES = (F32, BF16, F16)
# "mixed" gives every row one of the other four kinds, all four present when T >= 4.
MASK_KINDS = (None, "random", "none", "target_only", "all", "mixed")
# Most tests share one shape and temperature, so that their compiled functions are
# reused (compilation dominates the run time on CPU); the shape-specific tests vary them.
BASE_LEAD, BASE_V, BASE_TAU = (6,), 300, 0.8
FLAGS = [(True, True), (True, False), (False, True)]  # (with_entropy, entropy_grad)
FLAG_IDS = ["entropy", "entropy_nograd", "no_entropy"]


def dtype_id(dtype) -> str:
    return jnp.dtype(dtype).name


# ----------------------------------------------------------------------------- inputs


def make_mask(rng, kind, targets: np.ndarray, num_vocab: int, density: float = 0.3):
    """A `[..., V]` bool keep mask of the given kind (None -> no mask)."""
    if kind is None:
        return None
    shape = (*targets.shape, num_vocab)
    onehot = np.arange(num_vocab) == targets[..., None]
    by_kind = {
        "random": rng.random(shape) < density,
        "none": np.zeros(shape, bool),  # keeps nothing: only the target counts
        "target_only": onehot,  # keeps exactly the target
        "all": np.ones(shape, bool),
    }
    if kind == "mixed":
        names = ("random", "none", "target_only", "all")
        rows = rng.permutation(np.arange(targets.size) % len(names)).reshape(targets.shape)
        mask = np.zeros(shape, bool)
        for i, name in enumerate(names):
            mask = np.where((rows == i)[..., None], by_kind[name], mask)
    else:
        mask = by_kind[kind]
    return jnp.asarray(mask)


def make_inputs(seed, lead_shape, num_vocab, dtype=F32, *, mask=None, scale=3.0,
                targets_dtype=np.int32):
    """Random logits (rounded once to `dtype`), in-range targets and a keep mask."""
    rng = np.random.default_rng(seed)
    shape = (*lead_shape, num_vocab)
    logits = jnp.asarray((scale * rng.standard_normal(shape)).astype(np.float32), dtype)
    targets = rng.integers(0, num_vocab, lead_shape).astype(targets_dtype)
    return logits, jnp.asarray(targets), make_mask(rng, mask, targets, num_vocab)


def random_cotangents(seed, lead_shape):
    rng = np.random.default_rng(10_000 + seed)
    return (jnp.asarray(rng.standard_normal(lead_shape), F32),
            jnp.asarray(rng.standard_normal(lead_shape), F32))


def interpret_config(**kwargs):
    """PallasConfig that runs the kernels compiled on GPU and interpreted elsewhere."""
    return jaxops.PallasConfig(interpret=not ON_GPU, **kwargs)


# ------------------------------------------------------- the op against the reference


def op_with_vjp(logits, targets, keep_mask, g_log_prob, g_entropy, *, temperature,
                 with_entropy, entropy_grad, implementation, pallas_config=None):
    """(log_prob, entropy, d logits) of the op under test for cotangents (g_lp, g_H)."""
    def op(x):
        return jaxops.logprob_entropy(
            x, targets, keep_mask=keep_mask, temperature=temperature,
            with_entropy=with_entropy, entropy_grad=entropy_grad,
            implementation=implementation, pallas_config=pallas_config)

    (log_prob, entropy), vjp = jax.vjp(op, logits)
    (grad,) = vjp((g_log_prob, g_entropy if with_entropy else None))
    return log_prob, entropy, grad


# Module-level, so that equal (shapes, flags) across tests compile once. Inside it the
# targets are traced: the eager-only range check does not run (see the eager tests).
op_with_vjp_jit = jax.jit(op_with_vjp, static_argnames=(
    "temperature", "with_entropy", "entropy_grad", "implementation", "pallas_config"))


class Outputs(NamedTuple):
    log_prob: jax.Array
    entropy: jax.Array | None
    grad: jax.Array
    reference_grad: np.ndarray


def assert_matches_reference(logits, targets, keep_mask, temperature, log_prob, entropy,
                             grad, g_log_prob, g_entropy, *, with_entropy=True,
                             entropy_grad=True):
    """Outputs and the gradient for cotangents (g_lp, g_H) of a call, vs the reference.

    Returns the float64 reference gradient.
    """
    lead = tuple(targets.shape)
    assert log_prob.dtype == F32 and log_prob.shape == lead, (log_prob.dtype, log_prob.shape)
    if with_entropy:
        assert entropy is not None, "with_entropy=True must return an entropy"
        assert entropy.dtype == F32 and entropy.shape == lead, (entropy.dtype, entropy.shape)
    else:
        assert entropy is None, "with_entropy=False must return entropy None"
    # With entropy_grad=False the entropy is a constant: its cotangent reaches nothing.
    g_entropy_used = g_entropy if (with_entropy and entropy_grad) else jnp.zeros_like(g_log_prob)
    lp64, h64, grad64 = reference64(to_float64(logits), targets, keep_mask, g_log_prob,
                                    g_entropy_used, temperature=temperature)
    bound = value_bound(logits, temperature)
    assert_values_close("log_prob", log_prob, lp64, bound)
    if with_entropy:
        assert_values_close("entropy", entropy, h64, bound)
    cotangent_scale = float(np.linalg.norm(g_log_prob) + np.linalg.norm(g_entropy))
    cotangent_scale /= temperature
    assert_grad_close(grad, grad64, logits.dtype, floor=0.1 * cotangent_scale,
                      max_abs_x=largest_abs_x(logits, temperature))
    return grad64


def check_against_reference(logits, targets, *, keep_mask=None, temperature=BASE_TAU,
                            with_entropy=True, entropy_grad=True, implementation,
                            pallas_config=None, seed=0, jit=True) -> Outputs:
    """Run one call through `jax.vjp` with random cotangents (under `jax.jit`, or eagerly)
    and compare it with the float64 reference: values, gradient, dtypes, shapes and
    entropy None-ness."""
    g_lp, g_h = random_cotangents(seed, tuple(targets.shape))
    log_prob, entropy, grad = (op_with_vjp_jit if jit else op_with_vjp)(
        logits, targets, keep_mask, g_lp, g_h, temperature=temperature,
        with_entropy=with_entropy, entropy_grad=entropy_grad, implementation=implementation,
        pallas_config=pallas_config)
    grad64 = assert_matches_reference(
        logits, targets, keep_mask, temperature, log_prob, entropy, grad, g_lp, g_h,
        with_entropy=with_entropy, entropy_grad=entropy_grad)
    return Outputs(log_prob, entropy, grad, grad64)


# ------------------------------------------------- rows whose target alone is kept


def target_alone_inputs(num_tokens, num_vocab, target_bit=False):
    """Logits `[T, V]` whose target sits 6 to 48 below its row's maximum (20 to 160 units
    of x at temperature 0.3), and a mask that keeps nothing, or only the target's own
    bit with `target_bit`: either way the target alone is kept."""
    k = jax.random.split(jax.random.key(num_vocab), 2)
    logits = jax.random.normal(k[0], (num_tokens, num_vocab), F32) * 3
    targets = jax.random.randint(k[1], (num_tokens,), 0, num_vocab)
    below = jnp.linspace(6.0, 48.0, num_tokens, dtype=F32)
    logits = logits.at[jnp.arange(num_tokens), targets].set(logits.max(axis=1) - below)
    keep_mask = jnp.zeros((num_tokens, num_vocab), bool)
    if target_bit:
        keep_mask = keep_mask.at[jnp.arange(num_tokens), targets].set(True)
    return logits, targets, keep_mask


ROUNDINGS = 4 * 2.0 ** -24  # a few roundings: 4 ulps of fp32


def assert_gradient_within_roundings(grad, g_lp, temperature=0.3, limit=ROUNDINGS):
    """Every row of d log_prob / d logits `[T, V]` is 0 to `limit` (by default a few
    roundings) of its coefficient's size |g_lp| / tau."""
    ratio = np.abs(np.asarray(grad)).max(axis=1) / (np.abs(np.asarray(g_lp)) / temperature)
    assert np.all(ratio <= limit), ratio


def assert_log_prob_gradient_vanishes(logits, targets, keep_mask, implementation,
                                      limit=ROUNDINGS):
    """The log-prob's gradient alone (no entropy) at temperature 0.3 for random
    cotangents: 0 to `limit` (by default a few roundings) of |g_lp| / tau in every row."""
    g_lp, _ = random_cotangents(5, targets.shape)
    _, _, grad = op_with_vjp_jit(logits, targets, keep_mask, g_lp, None, temperature=0.3,
                                 with_entropy=False, entropy_grad=False,
                                 implementation=implementation)
    assert_gradient_within_roundings(grad, g_lp, limit=limit)
