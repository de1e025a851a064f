"""Shared pieces of the Mosaic GPU kernel tests (tests/jaxops/test_mosaic*.py,
test_mask_view.py, test_mosaic_direct.py): inputs and the statistics' derived values.

Importing this module skips the importing test module where this JAX has no Mosaic GPU
kernels (`pytest.importorskip`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops.backends.mosaic.config import MosaicConfig

mosaic_kernels = pytest.importorskip("jaxops.backends.mosaic.kernels")

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
# Small chunks, so that the interpret-mode shapes split the vocabulary over CTAs too.
INTERPRET = MosaicConfig(interpret=True, chunk_v=512)


def inputs(seed, num_tokens, num_vocab, dtype, mask_kind, scale=4.0):
    """Logits `[T, V]` (rounded once to `dtype`), in-range targets, and a keep mask: None,
    "random" (15% kept) or "mixed" (also rows keeping nothing but the target, rows keeping
    everything, and -inf logits the mask removes)."""
    keys = jax.random.split(jax.random.key(seed), 4)
    logits = (jax.random.normal(keys[0], (num_tokens, num_vocab), jnp.float32) * scale
              ).astype(dtype)
    targets = jax.random.randint(keys[1], (num_tokens,), 0, num_vocab)
    if mask_kind is None:
        return logits, targets, None
    mask = jax.random.bernoulli(keys[2], 0.15, (num_tokens, num_vocab))
    if mask_kind == "mixed":  # rows keeping nothing but the target, and everything
        rows = jnp.arange(num_tokens)[:, None]
        mask = jnp.where(rows % 3 == 1, False, jnp.where(rows % 3 == 2, True, mask))
        # -inf logits where the mask removes them (design §2)
        logits = jnp.where(~mask & (jax.random.uniform(keys[3], mask.shape) < 0.1)
                           & (jnp.arange(num_vocab)[None, :] != targets[:, None]),
                           -jnp.inf, logits.astype(jnp.float32)).astype(dtype)
    return logits, targets, mask


def lse(m, s):  # -inf (and a warning-free NaN) for rows callers filter out
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(m, np.float64) + np.log(np.asarray(s, np.float64))


def mean_shift(stats):
    """E_p[x] - m, from the entropy sum."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(stats.sum_exp_shifted, np.float64) / np.asarray(stats.sum_exp)

