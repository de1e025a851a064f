"""The Mosaic GPU kernels (`jaxops/backends/mosaic/`, implementation "pallas_mosaic").

Off-GPU: the kernels run in Mosaic GPU's interpret mode on small shapes (T not a
multiple of the 64-row block, V_loc not a multiple of the tile, a vocabulary split
whose last chunk overlaps its neighbour, masks, temperature, -inf logits, targets off
the shard) against the float64 reference, and they are lowered for CUDA at production
sizes from ShapeDtypeStructs (Mosaic GPU's layouts and TMA descriptors are checked
there; only the compile to PTX/SASS needs the GPU).

On a GPU (`gpu` marker): compiled kernels against the XLA implementation at the sizes
users run, and batch invariance bit for bit.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxops
from jaxops.backends import registry
from jaxops.backends import xla
from jaxops.backends.mosaic.config import MosaicConfig
from jaxops.backends.triton.config import PallasConfig
from jaxops.contract import BackwardCoefs

from _oracle import (
    assert_grad_close,
    assert_op_close,
    assert_values_close,
    largest_abs_x,
    reference64,
    value_bound,
)

mosaic_kernels = pytest.importorskip("jaxops.backends.mosaic.kernels")
from jaxops.backends.mosaic import backward as mosaic_backward  # noqa: E402
from jaxops.backends.mosaic import common as mosaic_common  # noqa: E402

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
# Small chunks, so that the interpret-mode shapes split the vocabulary over CTAs too.
INTERPRET = MosaicConfig(interpret=True, chunk_v=512)


def _inputs(seed, num_tokens, num_vocab, dtype, mask_kind, scale=4.0):
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
    logits, targets, mask = _inputs(num_tokens + num_vocab, num_tokens, num_vocab, dtype,
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


def _lse(m, s):  # -inf (and a warning-free NaN) for rows callers filter out
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(m, np.float64) + np.log(np.asarray(s, np.float64))


def _mean_shift(stats):
    """E_p[x] - m, from the entropy sum."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(stats.sum_exp_shifted, np.float64) / np.asarray(stats.sum_exp)


def _stats_inputs():
    """Edge rows: -inf entries, an all -inf row, targets below and above the shard, a
    row whose mask keeps nothing and whose target is elsewhere, very large logits."""
    num_tokens, num_vocab = 9, 1040
    logits, targets, mask = _inputs(3, num_tokens, num_vocab, F32, "random")
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
    assert_values_close("lse", _lse(got.max_logit, got.sum_exp)[finite],
                        _lse(want.max_logit, want.sum_exp)[finite], bound[finite])
    assert_values_close("E[x - m]", _mean_shift(got)[finite], _mean_shift(want)[finite],
                        bound[finite])
    assert got.max_logit[1] == -np.inf and got.sum_exp[1] == 0 and got.sum_exp_shifted[1] == 0
    if masked:
        # masked_max is the kept maximum here, as in backends/xla.py: comparable field by field.
        np.testing.assert_array_equal(got.masked_max, want.masked_max)
        kept = np.isfinite(np.asarray(want.masked_max))
        assert_values_close("masked lse", _lse(got.masked_max, got.masked_sum_exp)[kept],
                            _lse(want.masked_max, want.masked_sum_exp)[kept], bound[kept])
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
    logits, targets, mask = _inputs(5, 70, 1360, F32, "mixed")
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
    logits, targets, mask = _inputs(8, 70, 1360, F32, "random")
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
    logits, targets, mask = _inputs(2, 3, 1001, F32, "random")
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


def test_implementation_names():
    assert "pallas_mosaic" in jaxops.IMPLEMENTATIONS and "pallas_triton" in jaxops.IMPLEMENTATIONS
    name, config = registry.resolve("pallas_mosaic", platform="cpu")
    assert name == "pallas_mosaic" and config == MosaicConfig(interpret=True)
    name, config = registry.resolve("pallas_mosaic", platform="gpu",
                                           pallas_config=PallasConfig())
    assert config == MosaicConfig()
    assert registry.kernels("pallas_mosaic").module is mosaic_kernels
    assert registry.kernels("pallas").module.__name__ == "jaxops.backends.triton.kernels"
    assert registry.kernels("pallas_triton").module.__name__ == "jaxops.backends.triton.kernels"
    _, config = registry.resolve("pallas", platform="cpu")
    assert isinstance(config, PallasConfig) and config.interpret


@pytest.mark.parametrize("num_vocab, itemsize, mask_dtype, capability, usable, want", [
    (151936, 2, None, (9, 0), True, "pallas_mosaic"),
    (151936, 4, np.uint8, (9, 0), True, "pallas_mosaic"),
    (151936, 2, np.int8, (10, 0), True, "pallas_mosaic"),
    (75968, 2, None, (9, 0), True, "pallas_mosaic"),
    (65536 - 16, 2, None, (9, 0), True, "pallas_mosaic"),
    (18992, 2, None, (9, 0), True, "pallas_mosaic"),  # V_loc of TP = 8
    (1024, 4, np.bool_, (9, 0), True, "pallas_mosaic"),
    (151936, 2, np.bool_, (9, 0), True, "pallas_mosaic"),  # bool: read in place (test_mask_view)
    (151936, 2, None, (8, 0), True, "pallas_triton"),  # Ampere: no Mosaic GPU
    (151936, 2, None, None, True, "pallas_triton"),  # no GPU found
    (151936, 2, None, (9, 0), False, "pallas_triton"),  # a JAX without the pieces
    (151936 + 8, 2, None, (9, 0), True, "pallas_triton"),  # bf16 V_loc % 16: no TMA tile
    (151936 + 8, 4, None, (9, 0), True, "pallas_mosaic"),
    (151936 + 8, 4, np.uint8, (9, 0), True, "pallas_triton"),  # mask row stride % 16
])
def test_which_backend_pallas_means(num_vocab, itemsize, mask_dtype, capability, usable, want):
    assert registry.pallas_backend(num_vocab, itemsize, mask_dtype, capability,
                                          usable) == want


def test_the_fused_heads_narrow_chunks_keep_triton():
    minimum = registry.FUSED_CHUNK_MOSAIC_MIN_VOCAB
    assert registry.pallas_backend(minimum - 8, 4, None, (9, 0), True,
                                          min_mosaic_vocab=minimum) == "pallas_triton"
    assert registry.pallas_backend(minimum, 4, None, (9, 0), True,
                                          min_mosaic_vocab=minimum) == "pallas_mosaic"


def test_the_in_place_gradient_is_offered_where_jax_lowers_input_stores():
    """`backward_logits(into=)` stores into an input, which jax 0.12 refuses to lower:
    `can_write_into` says no there, so callers (the bridge) take JAX's gradient."""
    version = tuple(int(p) for p in jax.__version__.split(".")[:2])
    assert mosaic_kernels.STORES_INTO_INPUTS == (version < (0, 12))
    logits = jax.ShapeDtypeStruct((8, 1024), jnp.bfloat16)
    for enabled in (False, True):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(mosaic_backward, "IN_PLACE_GRADIENT", enabled)
            assert mosaic_kernels.can_write_into(logits, None, MosaicConfig()) == (
                enabled and version < (0, 12))
            assert not mosaic_kernels.can_write_into(logits, None,
                                                    MosaicConfig(interpret=True))


def test_which_backend_pallas_means_is_not_a_function_of_t():
    """The default's pick cannot depend on the batch (batch invariance): the policy
    takes no T."""
    import inspect

    for fn in (registry.pallas_backend, registry.for_call):
        assert not {"num_tokens", "T"} & set(inspect.signature(fn).parameters)


def test_pallas_is_made_concrete_per_call(monkeypatch):
    """`for_call` on a (faked) Hopper GPU: "pallas" becomes the backend for the call's
    shapes; a config picks its own backend; interpret mode (off-GPU) stays Triton; the
    other names pass through."""
    class Hopper:
        device_kind, compute_capability = "NVIDIA H200", "9.0"

    cached = registry._first_gpu_capability
    gpu_triton = PallasConfig()
    shape = dict(num_vocab=151936, itemsize=2, platform="gpu")
    try:
        cached.cache_clear()
        monkeypatch.setattr(jax, "devices", lambda *a: [Hopper()])
        for_call = registry.for_call
        assert for_call("pallas", gpu_triton, None, mask_dtype=None, **shape) == (
            "pallas_mosaic", MosaicConfig())
        assert for_call("pallas", gpu_triton, None, mask_dtype=jnp.bool_, **shape) == (
            "pallas_mosaic", MosaicConfig())
        assert for_call("pallas", gpu_triton, None, mask_dtype=jnp.float32, **shape) == (
            "pallas_triton", gpu_triton)
        assert for_call("pallas", gpu_triton, None, mask_dtype=None, **{
            **shape, "num_vocab": 18992}) == ("pallas_mosaic", MosaicConfig())
        assert for_call("pallas", gpu_triton, None, mask_dtype=None, **{
            **shape, "num_vocab": 18992 + 8}) == ("pallas_triton", gpu_triton)
        tuned = PallasConfig(block_v=1024)
        assert for_call("pallas", tuned, tuned, mask_dtype=None, **shape) == (
            "pallas_triton", tuned)
        mosaic = MosaicConfig(chunk_v=1024)
        assert for_call("pallas", gpu_triton, mosaic, mask_dtype=jnp.bool_, **shape) == (
            "pallas_mosaic", mosaic)
        interpreted = PallasConfig(interpret=True)
        assert for_call("pallas", interpreted, None, mask_dtype=None, **shape)[0] == (
            "pallas_triton")
        for name in ("xla", "pallas_triton", "pallas_mosaic"):
            assert for_call(name, None, None, mask_dtype=None, **shape) == (name, None)
    finally:
        cached.cache_clear()


def _lower_for_cuda(num_tokens, num_vocab, dtype, masked, with_entropy):
    S = jax.ShapeDtypeStruct
    logits = S((num_tokens, num_vocab), dtype)
    targets = S((num_tokens,), jnp.int32)
    mask = S((num_tokens, num_vocab), jnp.bool_) if masked else None
    row = S((num_tokens,), jnp.float32)

    def fwd(x, t, m):
        return mosaic_kernels.forward_stats(x, t, m, inv_tau=1 / 0.7,
                                           with_entropy=with_entropy)

    def bwd(x, t, m, mx, mm, c):
        return mosaic_kernels.backward_logits(x, t, m, mx, mm, c, inv_tau=1 / 0.7)

    def bwd_into(x, t, m, mx, mm, c, into):
        return mosaic_kernels.backward_logits(x, t, m, mx, mm, c, inv_tau=1 / 0.7, into=into)

    coefs = BackwardCoefs(row, row if with_entropy else None, row, row if masked else None)
    texts = [
        jax.jit(fwd).trace(logits, targets, mask).lower(lowering_platforms=("cuda",)).as_text(),
        jax.jit(bwd).trace(logits, targets, mask, row, row if masked else None, coefs)
        .lower(lowering_platforms=("cuda",)).as_text(),
    ]
    if mosaic_kernels.STORES_INTO_INPUTS:  # else `into` is refused (test below)
        texts.append(jax.jit(bwd_into).trace(
            logits, targets, mask, row, row if masked else None, coefs, logits,
        ).lower(lowering_platforms=("cuda",)).as_text())
    for text in texts:
        assert "mosaic_gpu" in text  # the kernel, not the XLA fallback


@pytest.mark.parametrize("num_tokens, num_vocab, dtype, masked, with_entropy", [
    (8192, 151936, F32, False, True),
    (8192, 151936, BF16, False, True),
    (8192, 151936, F32, True, True),
    (8192, 151936, BF16, True, False),
    (1024, 151936, BF16, True, True),
    (32768, 151936, BF16, False, True),  # T * V_loc beyond 2**31 elements
    (16384, 151936, F32, True, True),
    (8192, 18992, F32, True, True),  # 8-way shard: narrower swizzle, unswizzled mask
    (8192, 18992, BF16, False, True),
    (1, 18992, BF16, True, True),
    # T > 8 and not a multiple of 8: the operands' TMA descriptors cannot be tiled by 8
    # rows, the tiles move untiled (_transforms).
    (100, 151936, F32, True, True),
    (8191, 151936, BF16, False, True),
    (1001, 18992, F32, True, True),
    (9, 1024, BF16, True, False),
])
def test_lowers_for_cuda(num_tokens, num_vocab, dtype, masked, with_entropy):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no XLA fallback at these sizes
        _lower_for_cuda(num_tokens, num_vocab, dtype, masked, with_entropy)


@settings(max_examples=25, deadline=None)
@given(num_tokens=st.one_of(st.integers(1, 70), st.integers(71, 40000)),
       vocab_units=st.integers(1, 16384), dtype=st.sampled_from([F32, BF16, F16]),
       masked=st.booleans(), with_entropy=st.booleans())
def test_lowers_for_cuda_at_random_shapes(num_tokens, vocab_units, dtype, masked,
                                          with_entropy):
    """Any T and any V_loc the kernels take (`mosaic_supported`: multiples of 16
    here) lower for CUDA: Mosaic GPU checks its layouts and TMA descriptors there,
    the class of error the fixed list above once missed (T > 8 not a multiple of 8)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no XLA fallback
        _lower_for_cuda(num_tokens, 16 * vocab_units, dtype, masked, with_entropy)


# --- on the GPU ------------------------------------------------------------------------

GPU_SIZES = [(t, v) for t in (1, 7, 1000, 1001, 8192) for v in (1000, 18992, 151936)]


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_tokens, num_vocab", GPU_SIZES)
def test_gpu_matches_xla(num_tokens, num_vocab, dtype, masked):
    """Compiled kernels (V_loc = 1000 bf16 / masked falls back to XLA with a warning)
    against the XLA implementation, statistics and gradient."""
    logits, targets, mask = _inputs(num_tokens, num_tokens, num_vocab, dtype,
                                    "mixed" if masked else None)
    targets = targets.at[0].set(num_vocab + 5).astype(jnp.int32)  # row 0: target elsewhere
    inv_tau = 1 / 0.8
    config = MosaicConfig()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = jax.jit(lambda x, t, m: mosaic_kernels.forward_stats(
            x, t, m, inv_tau=inv_tau, with_entropy=True, config=config))(logits, targets, mask)
    want = jax.jit(lambda x, t, m: xla.forward_stats(
        x, t, m, inv_tau=inv_tau, with_entropy=True))(logits, targets, mask)
    bound = value_bound(logits, 1 / inv_tau)
    finite = np.isfinite(np.asarray(want.max_logit))
    np.testing.assert_array_equal(got.max_logit, want.max_logit)
    np.testing.assert_array_equal(got.target_logit, want.target_logit)
    assert_values_close("lse", _lse(got.max_logit, got.sum_exp)[finite],
                        _lse(want.max_logit, want.sum_exp)[finite], bound[finite])
    assert_values_close("E[x - m]", _mean_shift(got)[finite], _mean_shift(want)[finite],
                        bound[finite])
    if masked:
        kept = np.isfinite(np.asarray(want.masked_max))
        assert_values_close("masked lse", _lse(got.masked_max, got.masked_sum_exp)[kept],
                            _lse(want.masked_max, want.masked_sum_exp)[kept], bound[kept])

    keys = jax.random.split(jax.random.key(3), 4)
    coefs = BackwardCoefs(*[jax.random.normal(k, (num_tokens,), jnp.float32) for k in keys])
    if not masked:
        coefs = coefs._replace(coef_masked=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        grad = jax.jit(lambda *a: mosaic_kernels.backward_logits(
            *a, inv_tau=inv_tau, config=config))(logits, targets, mask, want.max_logit,
                                                 want.masked_max, coefs)
    grad_xla = jax.jit(lambda *a: xla.backward_logits(*a, inv_tau=inv_tau))(
        logits, targets, mask, want.max_logit, want.masked_max, coefs)
    assert_grad_close(grad, grad_xla, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_tokens", [1, 7, 1001, 8192])
def test_gpu_write_through_matches_the_allocated_gradient(num_tokens, dtype, masked,
                                                          monkeypatch):
    """`backward_logits(into=buffer)` stores into the caller's buffer exactly the bits the
    allocating call returns (every element: the buffer starts as NaNs), and returns a [T]
    token."""
    logits, targets, mask = _inputs(5, num_tokens, 151936, dtype, "mixed" if masked else None)
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
    logits, targets, mask = _inputs(1, 8192, num_vocab, dtype, "mixed" if masked else None)
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


def test_mosaic_refuses_gpus_before_hopper(monkeypatch):
    """On an Ampere GPU the Mosaic compiler would fail deep in lowering: the resolver
    says which implementation to use instead."""
    class Ampere:
        device_kind, compute_capability = "NVIDIA A100-SXM4-80GB", "8.0"

    class Hopper:
        device_kind, compute_capability = "NVIDIA H200", "9.0"

    cached = registry._first_gpu_capability  # the devices are looked up once
    try:
        cached.cache_clear()
        monkeypatch.setattr(jax, "devices", lambda *a: [Ampere()])
        with pytest.raises(ValueError, match="capability >= 9.0.*has 8.0.*pallas_triton"):
            registry.resolve("pallas_mosaic", "gpu")
        assert registry.resolve("pallas_triton", "gpu")[0] == "pallas_triton"
        cached.cache_clear()
        monkeypatch.setattr(jax, "devices", lambda *a: [Hopper()])
        assert registry.resolve("pallas_mosaic", "gpu")[0] == "pallas_mosaic"
    finally:
        cached.cache_clear()


@pytest.mark.parametrize("masked", [False, True])
def test_gradient_inside_shard_map_with_vma_types_lowers_for_cuda(masked):
    """`plgpu.kernel` traces with the vma check off, so the compiled kernels' outputs come
    back invariant; inside `shard_map(check_vma=True)` the custom VJP's backward then
    returned an invariant gradient for a varying input (a ValueError on the GPU). The
    kernels mark their outputs varying like their inputs (`contract.vary_like`). The
    interpreter refuses varying inputs, so this lowers the compiled kernels for CUDA."""
    from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: N817

    from jaxops import stats

    mesh = jax.make_mesh((1,), ("v",))
    split, whole = NamedSharding(mesh, P(None, "v")), NamedSharding(mesh, P())

    def loss(z, t, m):
        s = stats.local_stats(z, t, m, 1.0, True, True, "pallas_mosaic", MosaicConfig())
        extra = s.masked_sum_exp.sum() if m is not None else 0.0
        return s.sum_exp.sum() + s.max_logit.sum() + s.sum_exp_shifted.sum() + extra

    mask_spec = P(None, "v") if masked else None
    grad = jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(P(None, "v"), P(), mask_spec),
                         out_specs=P(None, "v"))
    x = jax.ShapeDtypeStruct((64, 1024), BF16, sharding=split)
    t = jax.ShapeDtypeStruct((64,), jnp.int32, sharding=whole)
    m = jax.ShapeDtypeStruct((64, 1024), jnp.uint8, sharding=split) if masked else None
    text = jax.jit(grad).trace(x, t, m).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
