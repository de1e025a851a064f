"""The compiled Mosaic GPU kernels on a GPU (`gpu` marker; skipped elsewhere): against the
XLA implementation at the sizes users run, the in-place gradient bit for bit against the
allocated one, and batch invariance bit for bit."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops.backends import registry, xla
from jaxops.backends.mosaic.config import MosaicConfig
from jaxops.contract import BackwardCoefs

from _mosaic_cases import (  # skips this module without Mosaic GPU
    BF16, F32, inputs, lse, mean_shift, mosaic_kernels,
)
from _oracle import assert_grad_close, assert_values_close, value_bound

# Mosaic GPU's own modules: imported once the line above has not skipped
from jaxops.backends.mosaic import backward as mosaic_backward


# --- on the GPU ------------------------------------------------------------------------

GPU_SIZES = [(t, v) for t in (1, 7, 1000, 1001, 8192) for v in (1000, 18992, 151936)]


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_tokens, num_vocab", GPU_SIZES)
def test_gpu_matches_xla(num_tokens, num_vocab, dtype, masked):
    """Compiled kernels, as the registry hands them out (V_loc = 1000 bf16 / masked falls
    back to XLA with a warning), against the XLA implementation, statistics and
    gradient."""
    mosaic = registry.kernels(registry.MOSAIC)
    logits, targets, mask = inputs(num_tokens, num_tokens, num_vocab, dtype,
                                    "mixed" if masked else None)
    targets = targets.at[0].set(num_vocab + 5).astype(jnp.int32)  # row 0: target elsewhere
    inv_tau = 1 / 0.8
    config = MosaicConfig()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = jax.jit(lambda x, t, m: mosaic.forward_stats(
            x, t, m, inv_tau=inv_tau, with_entropy=True, config=config))(logits, targets, mask)
    want = jax.jit(lambda x, t, m: xla.forward_stats(
        x, t, m, inv_tau=inv_tau, with_entropy=True))(logits, targets, mask)
    bound = value_bound(logits, 1 / inv_tau)
    finite = np.isfinite(np.asarray(want.max_logit))
    np.testing.assert_array_equal(got.max_logit, want.max_logit)
    np.testing.assert_array_equal(got.target_logit, want.target_logit)
    assert_values_close("lse", lse(got.max_logit, got.sum_exp)[finite],
                        lse(want.max_logit, want.sum_exp)[finite], bound[finite])
    assert_values_close("E[x - m]", mean_shift(got)[finite], mean_shift(want)[finite],
                        bound[finite])
    if masked:
        kept = np.isfinite(np.asarray(want.masked_max))
        assert_values_close("masked lse", lse(got.masked_max, got.masked_sum_exp)[kept],
                            lse(want.masked_max, want.masked_sum_exp)[kept], bound[kept])

    keys = jax.random.split(jax.random.key(3), 4)
    coefs = BackwardCoefs(*[jax.random.normal(k, (num_tokens,), jnp.float32) for k in keys])
    if not masked:
        coefs = coefs._replace(coef_masked=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        grad = jax.jit(lambda *a: mosaic.backward_logits(
            *a, inv_tau=inv_tau, config=config))(logits, targets, mask, want.max_logit,
                                                 want.masked_max, coefs)
    grad_xla = jax.jit(lambda *a: xla.backward_logits(*a, inv_tau=inv_tau))(
        logits, targets, mask, want.max_logit, want.masked_max, coefs)
    assert_grad_close(grad, grad_xla, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not mosaic_kernels.STORES_INTO_INPUTS, reason=(
    f"jax {jax.__version__} lowers no store into an input (mosaic.common."
    "STORES_INTO_INPUTS): backward_logits(into=) is off"))
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_tokens", [1, 7, 1001, 8192])
def test_gpu_write_through_matches_the_allocated_gradient(num_tokens, dtype, masked,
                                                          monkeypatch):
    """`backward_logits(into=buffer)` stores into the caller's buffer exactly the bits the
    allocating call returns (every element: the buffer starts as NaNs), and returns a [T]
    token."""
    logits, targets, mask = inputs(5, num_tokens, 151936, dtype, "mixed" if masked else None)
    targets = targets.astype(jnp.int32)
    keys = jax.random.split(jax.random.key(4), 4)
    coefs = BackwardCoefs(*[jax.random.normal(k, (num_tokens,), jnp.float32) for k in keys])
    if not masked:
        coefs = coefs._replace(coef_masked=None)
    stats = jax.jit(lambda x, t, m: mosaic_kernels.forward_stats(
        x, t, m, inv_tau=1.25, with_entropy=True))(logits, targets, mask)
    args = (logits, targets, mask, stats.max_logit, stats.masked_max, coefs)
    want = jax.jit(lambda *a: mosaic_kernels.backward_logits(*a, inv_tau=1.25))(*args)
    buffer = jnp.full(logits.shape, jnp.nan, dtype)
    monkeypatch.setattr(mosaic_backward, "IN_PLACE_GRADIENT", True)
    assert mosaic_kernels.can_write_into(logits, mask, MosaicConfig())
    token = jax.jit(lambda *a, into: mosaic_kernels.backward_logits(
        *a, inv_tau=1.25, into=into))(*args, into=buffer)
    assert token.shape == (num_tokens,) and token.dtype == jnp.float32
    token.block_until_ready()
    np.testing.assert_array_equal(np.asarray(buffer).view(np.uint8),
                                  np.asarray(want).view(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_vocab", [18992, 151936])
def test_gpu_batch_invariance(num_vocab, dtype, masked):
    """A row's statistics and gradient, bit for bit: in a batch of 8192, alone, and in
    a batch of 7 at another position."""
    logits, targets, mask = inputs(1, 8192, num_vocab, dtype, "mixed" if masked else None)
    targets = targets.astype(jnp.int32)
    coefs = BackwardCoefs(*[jnp.linspace(-1, 1, 8192, dtype=jnp.float32) * (i + 1)
                            for i in range(4)])
    if not masked:
        coefs = coefs._replace(coef_masked=None)
    inv_tau = 1 / 0.8

    @jax.jit
    def run(x, t, m, c):
        stats = mosaic_kernels.forward_stats(x, t, m, inv_tau=inv_tau, with_entropy=True)
        return stats, mosaic_kernels.backward_logits(x, t, m, stats.max_logit,
                                                    stats.masked_max, c, inv_tau=inv_tau)

    def rows(idx):
        idx = np.asarray(idx)
        pick = lambda a: None if a is None else a[idx]  # noqa: E731
        return run(logits[idx], targets[idx], pick(mask),
                   BackwardCoefs(*[pick(c) for c in coefs]))

    batch_stats, batch_grad = run(logits, targets, mask, coefs)
    for row in (0, 63, 64, 4097, 8191):
        for idx, pos in (([row], 0), ([5, 6, 7, row, 9, 10, 11], 3)):
            stats, grad = rows(idx)
            for name, a, b in zip(stats._fields, stats, batch_stats):
                if a is not None:
                    np.testing.assert_array_equal(a[pos], b[row], err_msg=f"{name} row {row}")
            np.testing.assert_array_equal(grad[pos], batch_grad[row], err_msg=f"grad {row}")
