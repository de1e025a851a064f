"""The programs `jaxops.linear_logprob_entropy` lowers to, read without running them: no
`[T, V_loc]` float array in the StableHLO or the compiled HLO, every bf16 GEMM returning
fp32, and the fused Mosaic GPU kernels lowered for CUDA at the sizes users run."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxops

from _linear_head_cases import BF16, F16, F32


@pytest.mark.parametrize("kernel", ["forward_stats", "backward_logits"])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_fused_kernels_lower_for_cuda(kernel, dtype):
    """The fused kernels' GPU path (wgmma on a transposed weight tile, which the
    interpreter cannot run) lowers for CUDA at T = H = 4096 (the backward on a 4096-row
    chunk of the weight, the forward on V = 151,936 and, at T = 8192, in row groups):
    Mosaic GPU checks layouts, transforms, TMA descriptors and shared memory there."""
    import functools

    from jaxops.backends.mosaic import linear as mosaic_linear
    from jaxops.contract import BackwardCoefs

    S = jax.ShapeDtypeStruct
    vec = S((4096,), F32)
    if kernel == "forward_stats":
        f = functools.partial(mosaic_linear.forward_stats, inv_tau=1 / 0.7, with_entropy=True)
        shapes = [(S((t, 4096), dtype), S((151936, 4096), dtype), S((t,), jnp.int32))
                  for t in (4096, 8192)]
        # with a keep mask (bytes, or bool converted), also at small, part-filled shapes
        shapes += [(S((t, h), dtype), S((v, h), dtype), S((t,), jnp.int32),
                    S((t, v), mask_dtype))
                   for t, h, v, mask_dtype in ((4096, 4096, 151936, jnp.uint8),
                                               (8192, 4096, 151936, jnp.bool_),
                                               (72, 128, 592, jnp.uint8))]
    else:
        f = functools.partial(mosaic_linear.backward_logits, inv_tau=1 / 0.7)
        shapes = [(S((4096, 4096), dtype), S((4096, 4096), dtype), S((4096,), jnp.int32),
                   vec, BackwardCoefs(vec, vec, vec, None))]
        # with a keep mask (its chunk's slice), bytes or bool
        shapes += [(S((4096, 4096), dtype), S((4096, 4096), dtype), S((4096,), jnp.int32),
                    vec, BackwardCoefs(vec, vec, vec, vec), S((4096, 4096), mask_dtype), vec)
                   for mask_dtype in (jnp.uint8, jnp.bool_)]
    for args in shapes:
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text

# ------------------------------------------------------------------ no [T, V_loc] array

_TENSOR = re.compile(r"tensor<((?:\d+x)+)(\w+)>")
_HLO_ARRAY = re.compile(r"\b(pred|bf16|[suf]\d+)\[([0-9,]*)\]")


@pytest.mark.parametrize("mask", [False, True])
def test_no_full_logits_in_lowered_forward_and_backward(mask):
    """Lower value-and-grad at T = 4096, V_loc = 8192, chunks of 256 columns from
    abstract inputs: no float array in the StableHLO has more than T * chunk elements
    (the only T * V_loc array is the bool mask, an input)."""
    num_tokens, num_vocab, hidden_size, chunk = 4096, 8192, 64, 256

    def loss(hidden, weight, targets, keep_mask, g_lp, g_h):
        lp, h = jaxops.linear_logprob_entropy(hidden, weight, targets, keep_mask=keep_mask,
                                              temperature=0.7, chunk_size=chunk,
                                              implementation="xla")
        return jnp.sum(lp * g_lp) + jnp.sum(h * g_h)

    struct = jax.ShapeDtypeStruct
    args = (struct((num_tokens, hidden_size), BF16), struct((num_vocab, hidden_size), BF16),
            struct((num_tokens,), jnp.int32),
            struct((num_tokens, num_vocab), jnp.bool_) if mask else None,
            struct((num_tokens,), F32), struct((num_tokens,), F32))
    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args)
    text = lowered.as_text()
    sizes = [(int(np.prod([int(d) for d in dims.rstrip("x").split("x")])), kind)
             for dims, kind in _TENSOR.findall(text)]
    assert sizes, text[:2000]
    largest_float = max(n for n, kind in sizes if kind != "i1")
    assert largest_float == num_tokens * chunk, largest_float  # one chunk, no more
    full = {kind for n, kind in sizes if n >= num_tokens * num_vocab}
    assert full == ({"i1"} if mask else set()), full

    # The same in the compiled HLO (after XLA's fusion and loop passes), and its
    # temporaries stay far below one fp32 [T, V_loc] array (134 MB here).
    compiled = lowered.compile()
    sizes = [(int(np.prod([int(d) for d in dims.split(",") if d])), kind)
             for kind, dims in _HLO_ARRAY.findall(compiled.as_text())]
    assert max(n for n, kind in sizes if kind != "pred") <= num_tokens * chunk
    assert {kind for n, kind in sizes if n > num_tokens * chunk} <= {"pred"}
    stats = compiled.memory_analysis()
    if stats is not None:
        assert stats.temp_size_in_bytes < num_tokens * num_vocab * 4 // 2, stats


def test_bf16_dots_return_fp32():
    """Every GEMM of bf16 operands (forward and backward) returns fp32, rounded once
    afterwards where a bf16 result is wanted: a dot with a bf16 result may be summed in
    bf16 (XLA did so on the H200 at T = 7, H = 1)."""
    struct = jax.ShapeDtypeStruct

    def loss(hidden, weight, targets):
        lp, h = jaxops.linear_logprob_entropy(hidden, weight, targets, chunk_size=96,
                                              implementation="xla")
        return jnp.sum(lp) + jnp.sum(h)

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(
        struct((64, 32), BF16), struct((200, 32), BF16), struct((64,), jnp.int32)).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    # per chunk: the forward's logits; the backward's recompute, d hidden, d weight
    # (once in the scan's body, once for the tail chunk)
    assert len(dots) == 8, dots
    for line in dots:
        assert re.search(r"-> tensor<[0-9x]*f32>", line), line
