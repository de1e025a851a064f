"""The Mosaic GPU kernels (`jaxops/backends/mosaic/`, implementation "pallas_mosaic") in
Mosaic GPU's interpret mode, off-GPU: small shapes (T not a multiple of the 64-row block,
V_loc not a multiple of the tile, a vocabulary split whose last chunk overlaps its
neighbour, masks, temperature, -inf logits, targets off the shard) against the float64
reference and the XLA statistics; rows treated alike; the registry's fallback to XLA.

The other files of the kernels: test_mosaic_dispatch.py (which backend "pallas" means),
test_mosaic_lowering.py (lowered for CUDA at production sizes from ShapeDtypeStructs:
Mosaic GPU's layouts and TMA descriptors are checked there; only the compile to
PTX/SASS needs the GPU) and test_mosaic_gpu.py (`gpu` marker: compiled kernels against
the XLA implementation at the sizes users run, and batch invariance bit for bit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxops
from jaxops.backends import registry
from jaxops.backends import xla
from jaxops.contract import BackwardCoefs

from _mosaic_cases import (  # skips this module without Mosaic GPU
    BF16, F16, F32, INTERPRET, inputs, lse, mean_shift, mosaic_kernels,
)
from _oracle import (
    assert_grad_close,
    assert_op_close,
    assert_values_close,
    largest_abs_x,
    reference64,
    value_bound,
)

# Mosaic GPU's own modules: imported once the line above has not skipped
from jaxops.backends.mosaic import common as mosaic_common


def _op(implementation, config, logits, targets, mask, temperature, with_entropy):
    def f(x):
        return jaxops.logprob_entropy(x, targets, keep_mask=mask, temperature=temperature,
                                      with_entropy=with_entropy,
                                      implementation=implementation, pallas_config=config)
    return jax.vjp(f, logits)


OP_CASES = [
    # (T, V_loc, dtype, mask, entropy, tau): T = 70 spans two row blocks, the second
    # partial; V = 1360 is 11 tiles of 128 (the last partial), split into 3 chunks of
    # 4 tiles, the last one shifted back over its neighbour; 1008 % 32 != 0 takes the
    # unswizzled mask tile.
    (70, 1360, F32, "mixed", True, 0.7),
    (1, 1008, F32, "random", True, 1.0),
    (65, 1008, BF16, "mixed", True, 1.3),
    (7, 1024, BF16, None, False, 0.8),
    (64, 640, F32, None, True, 1.0),
    (33, 1360, F16, "mixed", True, 0.9),  # float16 takes the bf16 tiles
]


@pytest.mark.parametrize("case", OP_CASES, ids=lambda c: f"T{c[0]}-V{c[1]}-"
                         f"{jnp.dtype(c[2]).name}-{c[3]}-ent{int(c[4])}-tau{c[5]}")
def test_op_matches_float64(case):
    num_tokens, num_vocab, dtype, mask_kind, with_entropy, tau = case
    logits, targets, mask = inputs(num_tokens + num_vocab, num_tokens, num_vocab, dtype,
                                    mask_kind)
    (log_prob, entropy), vjp = _op("pallas_mosaic", INTERPRET, logits, targets, mask, tau,
                                   with_entropy)
    keys = jax.random.split(jax.random.key(7), 2)
    g_lp = jax.random.normal(keys[0], (num_tokens,), jnp.float32)
    g_h = jax.random.normal(keys[1], (num_tokens,), jnp.float32) if with_entropy else None
    (grad,) = vjp((g_lp, g_h))
    lp64, ent64, grad64 = reference64(
        logits, targets, mask, g_lp, g_h if with_entropy else jnp.zeros_like(g_lp),
        temperature=tau)
    assert_op_close(logits, tau, (log_prob, entropy, grad), (lp64, ent64, grad64),
                    with_entropy)

def _stats_inputs():
    """Edge rows: -inf entries, an all -inf row, targets below and above the shard, a
    row whose mask keeps nothing and whose target is elsewhere, very large logits."""
    num_tokens, num_vocab = 9, 1040
    logits, targets, mask = inputs(3, num_tokens, num_vocab, F32, "random")
    logits = logits.at[0, :7].set(-jnp.inf).at[1].set(-jnp.inf)
    logits = logits.at[2].multiply(2500.0)  # |x| up to ~1e4
    targets = targets.at[3].set(-5).at[4].set(num_vocab + 2).at[5].set(-1)
    mask = mask.at[5].set(False).at[6].set(True)
    return logits, targets.astype(jnp.int32), mask


@pytest.mark.parametrize("masked", [False, True])
def test_stats_edge_cases_match_xla(masked):
    logits, targets, mask = _stats_inputs()
    mask = mask if masked else None
    inv_tau = 1 / 0.9
    got = mosaic_kernels.forward_stats(logits, targets, mask, inv_tau=inv_tau,
                                      with_entropy=True, config=INTERPRET)
    want = xla.forward_stats(logits, targets, mask, inv_tau=inv_tau, with_entropy=True)
    np.testing.assert_array_equal(got.max_logit, want.max_logit)  # the same max, exactly
    np.testing.assert_array_equal(got.target_logit, want.target_logit)
    # Sums are compared through what is computed from them, to design §8's bound: at
    # |x| ~ 1e4 the kernels' d = raw * (log2 e / tau) - m log2 e (one FMA, as in
    # backends/triton/kernels.py) is off by ~eps * |x| from x - m.
    bound = value_bound(logits, 1 / inv_tau)
    finite = np.isfinite(np.asarray(want.max_logit))
    assert_values_close("lse", lse(got.max_logit, got.sum_exp)[finite],
                        lse(want.max_logit, want.sum_exp)[finite], bound[finite])
    assert_values_close("E[x - m]", mean_shift(got)[finite], mean_shift(want)[finite],
                        bound[finite])
    assert got.max_logit[1] == -np.inf and got.sum_exp[1] == 0 and got.sum_exp_shifted[1] == 0
    if masked:
        # masked_max is the kept maximum here, as in backends/xla.py: comparable field by field.
        np.testing.assert_array_equal(got.masked_max, want.masked_max)
        kept = np.isfinite(np.asarray(want.masked_max))
        assert_values_close("masked lse", lse(got.masked_max, got.masked_sum_exp)[kept],
                            lse(want.masked_max, want.masked_sum_exp)[kept], bound[kept])
        assert got.masked_max[5] == -np.inf and got.masked_sum_exp[5] == 0

    keys = jax.random.split(jax.random.key(11), 4)
    coefs = [jax.random.normal(k, targets.shape, jnp.float32) for k in keys]
    coefs = BackwardCoefs(coefs[0], coefs[1], coefs[2], coefs[3] if masked else None)
    args = (logits, targets, mask, want.max_logit, want.masked_max, coefs)
    grad = mosaic_kernels.backward_logits(*args, inv_tau=inv_tau, config=INTERPRET)
    grad_xla = xla.backward_logits(*args, inv_tau=inv_tau)
    assert grad.dtype == logits.dtype and grad.shape == logits.shape
    assert_grad_close(grad, grad_xla, F32, max_abs_x=largest_abs_x(logits, 1 / inv_tau))


def test_rows_are_batch_invariant_in_interpret_mode():
    """The wrapper and the chunk combine treat every row alike (the kernels' own
    arithmetic order is checked bit for bit on the GPU, test_gpu_batch_invariance)."""
    logits, targets, mask = inputs(5, 70, 1360, F32, "mixed")
    inv_tau = 1 / 0.7
    coefs = BackwardCoefs(*[jnp.linspace(-1, 1, 70, dtype=jnp.float32) + i for i in range(4)])

    def run(rows):
        stats = mosaic_kernels.forward_stats(logits[rows], targets[rows], mask[rows],
                                            inv_tau=inv_tau, with_entropy=True,
                                            config=INTERPRET)
        row_coefs = BackwardCoefs(*[c[rows] for c in coefs])
        grad = mosaic_kernels.backward_logits(
            logits[rows], targets[rows], mask[rows], stats.max_logit, stats.masked_max,
            row_coefs, inv_tau=inv_tau, config=INTERPRET)
        return stats, grad

    batch_stats, batch_grad = run(np.arange(70))
    for row in (0, 66):
        alone_stats, alone_grad = run(np.array([row]))
        for name, a, b in zip(batch_stats._fields, alone_stats, batch_stats):
            np.testing.assert_array_equal(a[0], b[row], err_msg=name)
        np.testing.assert_array_equal(alone_grad[0], batch_grad[row])


def test_far_kept_maximum_does_not_change_its_neighbours():
    """A row whose kept maximum is far below its row maximum takes a second
    exponential (`_SHARED_EXP_GAP`); the other rows of its 64-row block must not: their
    statistics are bitwise those they have alone. Their gradient takes the same
    expression in the kernel's other body; how that compiles is the compiler's (XLA's
    CPU fusion here differs by an ulp), so here it is compared to float32 rounding and
    bit for bit on the GPU (test_batch_invariance.py)."""
    logits, targets, mask = inputs(8, 70, 1360, F32, "random")
    mask = mask.at[:, 0].set(False)
    # Row 1: an unkept logit 200 above everything kept: 200 * log2(e) >> 64.
    logits = logits.at[1, 0].set(200.0)
    inv_tau = 1.0
    coefs = BackwardCoefs(*[jnp.linspace(-1, 1, 70, dtype=jnp.float32) + i for i in range(4)])

    def run(rows):
        stats = mosaic_kernels.forward_stats(logits[rows], targets[rows], mask[rows],
                                            inv_tau=inv_tau, with_entropy=True,
                                            config=INTERPRET)
        grad = mosaic_kernels.backward_logits(
            logits[rows], targets[rows], mask[rows], stats.max_logit, stats.masked_max,
            BackwardCoefs(*[c[rows] for c in coefs]), inv_tau=inv_tau, config=INTERPRET)
        return stats, grad

    with_far, grad_with_far = run(np.arange(70))
    for row in (0, 2, 63):
        alone, grad_alone = run(np.array([row]))
        for name, a, b in zip(with_far._fields, alone, with_far):
            if a is not None:
                np.testing.assert_array_equal(a[0], b[row], err_msg=f"{name}, row {row}")
        np.testing.assert_allclose(grad_alone[0], grad_with_far[row], rtol=1e-5, atol=1e-9,
                                   err_msg=f"row {row}")


def test_unaligned_vocabulary_falls_back_to_xla():
    """The registry, not the kernels, sends a V_loc the TMA tiles cannot take to XLA."""
    logits, targets, mask = inputs(2, 3, 1001, F32, "random")
    assert registry.fallback_reason("pallas_mosaic", logits, mask, INTERPRET)
    assert registry.fallback_reason("pallas_mosaic", logits[:, :992], mask, INTERPRET) is None
    with pytest.warns(RuntimeWarning, match="XLA implementation"):
        got = registry.kernels("pallas_mosaic").forward_stats(
            logits, targets, mask, inv_tau=1.0, with_entropy=False, config=INTERPRET)
    want = xla.forward_stats(logits, targets, mask, inv_tau=1.0, with_entropy=False)
    for a, b in zip(got, want):
        if a is not None:
            np.testing.assert_array_equal(a, b)


def test_empty_batch():
    logits = jnp.zeros((0, 1024), F32)
    stats = registry.kernels("pallas_mosaic").forward_stats(
        logits, jnp.zeros((0,), jnp.int32), None, inv_tau=1.0, with_entropy=True,
        config=INTERPRET)
    assert stats.max_logit.shape == (0,)


def test_chunking_depends_on_vocabulary_only():
    tiles, chunks, per_chunk = mosaic_common.vocab_chunks(151936, 128, 4096)
    assert (tiles, chunks, per_chunk) == (1187, 36, 33)  # one tile of overlap in all
    for num_vocab in (640, 1000, 18992, 151936, 262144):
        tiles, chunks, per_chunk = mosaic_common.vocab_chunks(num_vocab, 128, 4096)
        assert per_chunk <= tiles and 0 <= chunks * per_chunk - tiles < per_chunk
