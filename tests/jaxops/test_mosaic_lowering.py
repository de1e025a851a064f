"""The Mosaic GPU kernels lowered for CUDA without a GPU, from ShapeDtypeStructs: at the
sizes users run and at random shapes (Mosaic GPU checks its layouts, transforms and TMA
descriptors there), and their gradient inside `shard_map(check_vma=True)`."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxops.backends.mosaic.config import MosaicConfig
from jaxops.contract import BackwardCoefs

from _mosaic_cases import BF16, F16, F32, mosaic_kernels  # skips this module without Mosaic GPU


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
