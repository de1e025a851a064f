"""The direct route's kernels (`jaxops/backends/mosaic/direct.py`) off-GPU: Mosaic GPU's interpret
mode against the float64 reference (forward outputs and the gradient for every flag),
and their CUDA lowering at production sizes, in the one-kernel form that
`plgpu.as_torch_kernel` accepts. On the GPU they run through the bridge
(tests/bridge/test_bridge_direct.py)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxops.backends.mosaic.config import MosaicConfig

from _logprob_cases import assert_gradient_within_roundings, target_alone_inputs
from _mosaic_cases import BF16, F32
from _mosaic_cases import inputs as mosaic_inputs  # logits, targets, a keep mask
from _oracle import assert_op_close, reference64

md = pytest.importorskip("jaxops.backends.mosaic.direct")
from jaxops.backends.mosaic import direct_rows  # noqa: E402
from jaxops.backends.mosaic import common as mosaic_common  # noqa: E402

# The direct kernels store into buffers their caller owns, which jax 0.12 refuses to
# lower (`mosaic_common.STORES_INTO_INPUTS`): there the route is off (the test below).
needs_input_stores = pytest.mark.skipif(
    not mosaic_common.STORES_INTO_INPUTS,
    reason=f"jax {jax.__version__} lowers no store into an input: the direct route is off")


def test_the_direct_route_is_on_exactly_where_jax_lowers_input_stores():
    version = tuple(int(p) for p in jax.__version__.split(".")[:2])
    assert mosaic_common.STORES_INTO_INPUTS == (version < (0, 12))
    assert md.supported(151936, 2, True) == mosaic_common.STORES_INTO_INPUTS

INTERPRET = MosaicConfig(interpret=True, chunk_v=512)  # several chunks at these V

CASES = [  # (T, V_loc, dtype, mask, entropy, tau, which cotangents, target gathered)
    (70, 1360, F32, "mixed", True, 0.7, "both", False),
    (70, 1360, F32, "mixed", True, 0.7, "both", True),
    (7, 1024, BF16, None, False, 0.8, "lp", False),
    (65, 1008, BF16, "mixed", True, 1.3, "both", True),
    (64, 640, F32, None, True, 1.0, "entropy", False),
    (3, 1024, F32, "random", True, 1.0, "lp", True),
    # one chunk (V_loc <= chunk_v): the single-kernel forward
    (70, 512, F32, "mixed", True, 0.7, "both", False),
    (5, 384, BF16, None, True, 1.3, "both", False),
]


@needs_input_stores
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-V{c[1]}-"
                         f"{jnp.dtype(c[2]).name}-{c[3]}-ent{int(c[4])}-{c[6]}"
                         f"{'-gathered' if c[7] else ''}")
def test_direct_kernels_match_float64(case):
    num_tokens, num_vocab, dtype, mask_kind, with_entropy, tau, cots, gathered = case
    logits, targets, mask = mosaic_inputs(num_tokens * 7 + num_vocab, num_tokens, num_vocab,
                                          dtype, mask_kind)
    targets = targets.astype(jnp.int32)
    log_prob, entropy, saved = direct_rows.logprob_entropy_rows(
        logits, targets, mask, inv_tau=1 / tau, with_entropy=with_entropy,
        gathered_target=gathered, config=INTERPRET)
    keys = jax.random.split(jax.random.key(3), 2)
    g_lp = jax.random.normal(keys[0], (num_tokens,)) if cots != "entropy" else None
    g_h = (jax.random.normal(keys[1], (num_tokens,))
           if with_entropy and cots != "lp" else None)
    grad = direct_rows.logits_grad_rows(logits, targets, mask, saved, g_lp, g_h, inv_tau=1 / tau,
                               with_entropy=with_entropy, config=INTERPRET)
    zeros = jnp.zeros((num_tokens,))
    lp64, ent64, grad64 = reference64(logits, targets, mask,
                                      zeros if g_lp is None else g_lp,
                                      zeros if g_h is None else g_h, temperature=tau)
    assert_op_close(logits, tau, (log_prob, entropy, grad), (lp64, ent64, grad64),
                    with_entropy)


@needs_input_stores
def test_target_alone_has_zero_log_prob_gradient():
    """Rows whose mask keeps nothing, so that the kept set is the target alone
    (`combine.combine`'s point mass): log_prob 0 and its gradient 0 to a few roundings of
    |g_lp| / tau, as the route through JAX gives (test_logprob_masks.py). The finish
    kernel saves `valid` 0 where the kept sum is exactly 1; before, ~|x| 2^-24 of the
    coefficient was left."""
    logits, targets, keep_mask = target_alone_inputs(24, 1040)
    targets = targets.astype(jnp.int32)
    kw = dict(inv_tau=1 / 0.3, with_entropy=False, config=INTERPRET)
    log_prob, _, saved = direct_rows.logprob_entropy_rows(logits, targets, keep_mask, **kw)
    assert np.abs(np.asarray(log_prob)).max() <= 1e-5 * 160
    g_lp = jax.random.normal(jax.random.key(5), targets.shape)
    grad = direct_rows.logits_grad_rows(logits, targets, keep_mask, saved, g_lp, None, **kw)
    assert_gradient_within_roundings(grad, g_lp)


@needs_input_stores
@pytest.mark.parametrize("dtype, mask_kind, with_entropy", [
    (F32, "mixed", True), (BF16, None, True), (F32, None, False), (BF16, "random", False)])
def test_single_kernel_forward_equals_two_kernels_bitwise(dtype, mask_kind, with_entropy):
    """`forward_kernel` runs `finish`'s arithmetic inside the partials kernel: the same
    outputs and saved multipliers, bit for bit (interpret mode)."""
    logits, targets, mask = mosaic_inputs(11, 70, 512, dtype, mask_kind)
    targets = targets.astype(jnp.int32).at[3].set(-1).at[4].set(512)  # invalid rows too
    assert md.one_pass(512, dtype, mask is not None, INTERPRET)
    kw = dict(inv_tau=1 / 0.7, with_entropy=with_entropy, config=INTERPRET)
    one = direct_rows.logprob_entropy_rows(logits, targets, mask, single_kernel=True, **kw)
    two = direct_rows.logprob_entropy_rows(logits, targets, mask, single_kernel=False, **kw)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(two)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="chunk_v"):
        md.forward_kernel(70, 1024, dtype, masked=False, with_entropy=True, inv_tau=1.0,
                          config=INTERPRET)


@needs_input_stores
def test_entropy_grad_off_ignores_d_entropy():
    logits, targets, _ = mosaic_inputs(1, 40, 512, F32, None)
    targets = targets.astype(jnp.int32)
    _, _, saved = direct_rows.logprob_entropy_rows(logits, targets, None, config=INTERPRET)
    g = jnp.ones((40,))
    kw = dict(config=INTERPRET)
    off = direct_rows.logits_grad_rows(logits, targets, None, saved, g, g, entropy_grad=False, **kw)
    lp_only = direct_rows.logits_grad_rows(logits, targets, None, saved, g, None, **kw)
    np.testing.assert_array_equal(np.asarray(off), np.asarray(lp_only))


@needs_input_stores
@pytest.mark.parametrize("form", ["single", "two", "gathered"])
@pytest.mark.parametrize("mask_kind", [None, "mixed"])
def test_wide_targets_equal_int32_ids_bitwise(form, mask_kind):
    """int64 ids read as their int32 word pairs (`wide_targets`, the bridge's int64
    targets without a conversion op) give the outputs, saved multipliers and gradient of
    the ids clamped to [-1, V] as int32, bit for bit; ids whose high word is not 0 are
    out of range even where their low word is a valid id (2**32 + 3 is not 3)."""
    num_tokens, num_vocab = 70, 512
    logits, targets, mask = mosaic_inputs(5, num_tokens, num_vocab, F32, mask_kind)
    ids = np.asarray(targets).astype(np.int64)
    ids[:9] = [num_vocab, -1, -100, 2**32 + 3, 2**31 + 5, -(2**40), 2**40 + 7, -(2**32) + 9,
               num_vocab - 1]
    narrow = jnp.asarray(np.clip(ids, -1, num_vocab).astype(np.int32))
    words = jnp.asarray(ids.view(np.int32))  # little-endian: (low, high) per id
    kw = dict(inv_tau=1 / 0.7, with_entropy=True, config=INTERPRET,
              single_kernel=form == "single", gathered_target=form == "gathered")
    a = direct_rows.logprob_entropy_rows(logits, narrow, mask, **kw)
    b = direct_rows.logprob_entropy_rows(logits, words, mask, wide_targets=True, **kw)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert np.isnan(np.asarray(b[0])[:8]).all() and np.isfinite(np.asarray(b[0])[8:]).all()
    g = jax.random.normal(jax.random.key(1), (2, num_tokens))
    grads = [direct_rows.logits_grad_rows(logits, t, mask, saved, g[0], g[1], inv_tau=1 / 0.7,
                                 wide_targets=wide, config=INTERPRET)
             for t, saved, wide in ((narrow, a[2], False), (words, b[2], True))]
    np.testing.assert_array_equal(np.asarray(grads[0]), np.asarray(grads[1]))


@needs_input_stores
def test_out_of_range_targets_give_nan():
    logits, _, _ = mosaic_inputs(2, 4, 512, F32, None)
    targets = jnp.array([0, -1, 512, 511], jnp.int32)
    log_prob, entropy, _ = direct_rows.logprob_entropy_rows(logits, targets, config=INTERPRET)
    np.testing.assert_array_equal(np.isnan(np.asarray(log_prob)), [False, True, True, False])
    assert np.all(np.isfinite(np.asarray(entropy)))


@needs_input_stores
@pytest.mark.parametrize("num_tokens, num_vocab, dtype, masked, with_entropy, gathered", [
    (16, 1024, F32, False, True, False),
    (8192, 18992, BF16, False, True, False),
    (8192, 151936, BF16, True, True, True),
    (1, 18992, BF16, True, False, False),
    (32768, 151936, F32, True, True, True),
    (16, 1024, F32, True, True, False),  # one chunk: the single-kernel forward
    (4096, 4096, BF16, False, False, False),
    (1001, 18992, BF16, True, True, False),  # T % 8 != 0: untiled tiles
])
@pytest.mark.parametrize("wide", [False, True], ids=["int32_ids", "int64_ids"])
def test_direct_kernels_lower_for_cuda_as_one_kernel(num_tokens, num_vocab, dtype, masked,
                                                     with_entropy, gathered, wide):
    """Each function is a single `mosaic_gpu` custom call and nothing else -- what the
    torch launcher requires -- and the backward returns only its placeholder. `wide`:
    the targets are int64 ids as int32 word pairs."""
    S = jax.ShapeDtypeStruct

    def lowered(fn, *structs):
        traced = jax.jit(fn).trace(*structs)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
        ops = re.findall(r"= (stablehlo\.[a-z_]+)", text)
        assert set(ops) == {"stablehlo.custom_call"}, ops
        return traced.out_info

    common = dict(masked=masked, with_entropy=with_entropy, inv_tau=1 / 0.7,
                  wide_targets=wide)
    ids = S((num_tokens * (1 + wide),), jnp.int32)
    inputs = ([S((num_tokens, num_vocab), dtype)]
              + ([S((num_tokens, num_vocab), jnp.uint8)] if masked else []) + [ids])
    row = S((num_tokens,), jnp.float32)
    parts = lowered(md.partials_kernel(num_tokens, num_vocab, dtype, gathered_target=gathered,
                                       **common), *(inputs[:-1] if gathered else inputs))
    outs = lowered(md.finish_kernel(num_tokens, num_vocab, dtype, gathered_target=gathered,
                                    **common),
                   *parts, ids, *[row] * (gathered * (1 + masked)))
    num_saved = len(md.saved_names(with_entropy, masked))
    assert len(outs) == 1 + with_entropy + num_saved
    backward = md.backward_kernel(num_tokens, num_vocab, dtype, entropy_grad=True,
                                  has_d_log_prob=True, has_d_entropy=True, **common)
    placeholder = lowered(backward, *inputs, *outs[-num_saved:],
                          *[S((num_tokens,), jnp.float32)] * (1 + with_entropy),
                          S((num_tokens, num_vocab), dtype))
    assert placeholder.shape == (1,)
    if not gathered and md.one_pass(num_vocab, dtype, masked):
        single = lowered(md.forward_kernel(num_tokens, num_vocab, dtype, **common), *inputs)
        assert [o.shape for o in single] == [o.shape for o in outs]


@needs_input_stores
@settings(max_examples=10, deadline=None)
@given(window_log2=st.integers(0, 15), vocab_units=st.integers(1, 16384),
       dtype=st.sampled_from([F32, BF16]), masked=st.booleans(), with_entropy=st.booleans(),
       gathered=st.booleans(), wide=st.booleans())
def test_direct_kernels_lower_for_cuda_at_random_shapes(window_log2, vocab_units, dtype,
                                                        masked, with_entropy, gathered, wide):
    """The bridge's row windows (powers of two up to 2**15) at random V_loc (multiples
    of 16): every direct-route kernel lowers for CUDA as one kernel."""
    test_direct_kernels_lower_for_cuda_as_one_kernel(
        2 ** window_log2, 16 * vocab_units, dtype, masked, with_entropy, gathered, wide)
