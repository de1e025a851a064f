"""Shared pieces of the `jaxops.linear_logprob_entropy` tests (tests/jaxops/test_linear_head*.py):
the op under `jax.vjp` (jitted once for all of them) and one case against the float64
oracle of tests/_linear_cases.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxops

from _linear_cases import check_linear, make_linear_inputs

JAX_VERSION = tuple(int(part) for part in jax.__version__.split(".")[:2])
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


def linear_vjp(hidden, weight, targets, mask, g_lp, g_h, *, temperature, with_entropy,
                entropy_grad, implementation, chunk_size):
    (log_prob, entropy), pullback = jax.vjp(
        lambda h, w: jaxops.linear_logprob_entropy(
            h, w, targets, keep_mask=mask, temperature=temperature, with_entropy=with_entropy,
            entropy_grad=entropy_grad, implementation=implementation, chunk_size=chunk_size),
        hidden, weight)
    d_hidden, d_weight = pullback((g_lp, g_h if with_entropy else None))
    return log_prob, entropy, d_hidden, d_weight


linear_vjp_jit = jax.jit(linear_vjp, static_argnames=(
    "temperature", "with_entropy", "entropy_grad", "implementation", "chunk_size"))


def run_case(lead, hidden_size, num_vocab, dtype, *, mask, temperature=1.0, with_entropy=True,
             entropy_grad=True, implementation="xla", chunk_size=None, seed=0, jit=True):
    """One call (jitted, or eager) through `jax.vjp` with random cotangents, against the
    float64 oracle: values, d hidden and d weight, and the gradients' dtypes and shapes."""
    data = make_linear_inputs(seed, lead, hidden_size, num_vocab, dtype, mask=mask)
    args = (jnp.asarray(data["hidden"], dtype), jnp.asarray(data["weight"], dtype),
            jnp.asarray(data["targets"]),
            None if data["mask"] is None else jnp.asarray(data["mask"]),
            jnp.asarray(data["d_log_prob"]), jnp.asarray(data["d_entropy"]))
    got = (linear_vjp_jit if jit else linear_vjp)(
        *args, temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad,
        implementation=implementation, chunk_size=chunk_size)
    assert got[2].dtype == dtype and got[2].shape == args[0].shape
    assert got[3].dtype == dtype and got[3].shape == args[1].shape
    return check_linear(f"{implementation} {lead} H={hidden_size} V={num_vocab}", got, data,
                        dtype, temperature=temperature, with_entropy=with_entropy,
                        entropy_grad=entropy_grad)
