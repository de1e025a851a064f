"""One suite for every backend the registry lists (`registry.STATISTICS_BACKENDS`): the
statistics fields each forward returns (`contract.present_fields`) and their values, and
the gradient, against float64 NumPy, on the same random cases. Off-GPU the Pallas
backends run in interpret mode; a new backend joins the suite by joining the registry."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops import contract
from jaxops.backends import registry

CASES = [  # (T, V_loc): a partial row tile, and a whole one with a ragged vocabulary tail
    (9, 256),
    (64, 1040),
]
FLAGS = list(itertools.product((False, True), (False, True)))  # (with_entropy, masked)
TAU = 0.7


def _inputs(num_tokens, num_vocab, masked, seed):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((num_tokens, num_vocab)) * 3).astype(np.float32)
    # every third target is off this shard (a vocab-parallel row): index num_vocab
    targets = rng.integers(0, num_vocab, num_tokens).astype(np.int32)
    targets[::3] = num_vocab
    mask = rng.random((num_tokens, num_vocab)) < 0.4 if masked else None
    return logits, targets, mask


def _expected(logits, targets, mask):
    """float64 fields by their definitions (contract.LocalStats); the masked ones as the
    masked log-normaliser r + log(masked_sum_exp), which every choice of r leaves alone."""
    x = logits.astype(np.float64) / TAU
    m = x.max(-1)
    e = np.exp(x - m[:, None])
    rows = np.arange(len(x))
    on_shard = targets < x.shape[1]
    target = np.where(on_shard, x[rows, np.minimum(targets, x.shape[1] - 1)], 0.0)
    out = dict(max_logit=m, sum_exp=e.sum(-1), sum_exp_shifted=(e * (x - m[:, None])).sum(-1),
               target_logit=target)
    if mask is not None:
        kept = mask.copy()
        kept[rows[on_shard], targets[on_shard]] = True
        out["masked_lse"] = np.log(np.where(kept, np.exp(x), 0.0).sum(-1))
        out["kept"] = kept
    return out


def _config(name):
    return registry.resolve(name, platform="cpu")[1] if jax.default_backend() == "cpu" \
        else registry.resolve(name)[1]


@pytest.mark.parametrize("name", registry.STATISTICS_BACKENDS)
@pytest.mark.parametrize("with_entropy,masked", FLAGS)
@pytest.mark.parametrize("num_tokens,num_vocab", CASES)
def test_forward_fields_and_values(name, with_entropy, masked, num_tokens, num_vocab):
    logits, targets, mask = _inputs(num_tokens, num_vocab, masked, seed=num_tokens)
    stats = registry.kernels(name).forward_stats(
        jnp.asarray(logits), jnp.asarray(targets), None if mask is None else jnp.asarray(mask),
        inv_tau=1 / TAU, with_entropy=with_entropy, config=_config(name))
    present = contract.present_fields(with_entropy, masked)
    assert tuple(f for f in contract.LocalStats._fields
                 if getattr(stats, f) is not None) == present
    want = _expected(logits, targets, mask)
    got = {f: np.asarray(getattr(stats, f), np.float64) for f in present}
    np.testing.assert_allclose(got["max_logit"], want["max_logit"], rtol=1e-6)
    np.testing.assert_allclose(got["sum_exp"], want["sum_exp"], rtol=1e-5)
    np.testing.assert_allclose(got["target_logit"], want["target_logit"], rtol=1e-6, atol=1e-6)
    if with_entropy:
        np.testing.assert_allclose(got["sum_exp_shifted"], want["sum_exp_shifted"],
                                   rtol=1e-5, atol=1e-5)
    if masked:
        lse = got["masked_max"] + np.log(got["masked_sum_exp"])
        np.testing.assert_allclose(lse, want["masked_lse"], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("name", registry.STATISTICS_BACKENDS)
@pytest.mark.parametrize("with_entropy,masked", FLAGS)
def test_backward_matches_the_contract_formula(name, with_entropy, masked):
    num_tokens, num_vocab = CASES[1]
    logits, targets, mask = _inputs(num_tokens, num_vocab, masked, seed=7)
    want = _expected(logits, targets, mask)
    rng = np.random.default_rng(8)
    coef = lambda: rng.standard_normal(num_tokens).astype(np.float32)  # noqa: E731
    coefs = contract.BackwardCoefs(coef_sum=coef(),
                                   coef_shifted=coef() if with_entropy else None,
                                   coef_target=coef(),
                                   coef_masked=coef() if masked else None)
    masked_max = (want["masked_lse"] - 0.0).astype(np.float32) if masked else None
    grad = registry.kernels(name).backward_logits(
        jnp.asarray(logits), jnp.asarray(targets), None if mask is None else jnp.asarray(mask),
        jnp.asarray(want["max_logit"], jnp.float32),
        None if masked_max is None else jnp.asarray(masked_max),
        jax.tree.map(jnp.asarray, coefs), inv_tau=1 / TAU, config=_config(name))
    # contract.py: dx_j = e_j (coef_sum + coef_shifted (x_j - m)) + [kept_j] exp(x_j - r)
    # coef_masked + [j == target] coef_target; d logits = dx / tau
    x = logits.astype(np.float64) / TAU
    m = x.max(-1, keepdims=True)
    d = x - m
    dx = np.exp(d) * (coefs.coef_sum[:, None]
                      + (coefs.coef_shifted[:, None] * d if with_entropy else 0.0))
    if masked:
        r = masked_max.astype(np.float64)[:, None]
        dx += np.where(want["kept"], np.exp(x - r), 0.0) * coefs.coef_masked[:, None]
    rows = np.arange(num_tokens)
    on = targets < num_vocab
    dx[rows[on], targets[on]] += coefs.coef_target[on]
    np.testing.assert_allclose(np.asarray(grad, np.float64), dx / TAU, rtol=2e-5, atol=2e-5)
