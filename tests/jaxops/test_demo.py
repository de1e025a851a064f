"""The demo's sizing (`jaxops.demo.plan`) and its float64 reference in row blocks.

`./run demo` once sized its float64 reference for a 141 GB H200: on an 80 GB H100 the
reference of the masked case at T = 8192, V = 151,936 (a 9.3 GiB float64 copy of the
logits, plus its gradient and workspace) failed to allocate. The plan now depends on the
free device memory; these tests check it for the cards a newcomer may have (as JAX sees
them: with its default preallocation, 75% of the card) and that the blocked reference
gives the errors of the unblocked one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops import demo

GIB = 2**30
V = demo.GPU_VOCAB
# bytes_limit - bytes_in_use right after start-up, with JAX's default 75% preallocation.
CARDS = {"16GB": int(15.77 * GIB * 0.75), "H100-80GB": int(79.1 * GIB * 0.75),
         "H200-141GB": int(139.8 * GIB * 0.75)}


def _fits(p, free):
    """The plan's own memory model: the timed steps and the reference blocks fit."""
    budget = demo.MEMORY_FRACTION * free
    timed = (demo.HELD_BYTES + demo.TIMED_BYTES) * p.tokens * V
    reference = demo.HELD_BYTES * p.tokens * V + demo.REFERENCE_BYTES * p.reference_rows * V
    return timed <= budget and reference <= budget


@pytest.mark.parametrize("card", CARDS)
def test_plan_fits_each_card(card):
    p = demo.plan(V, CARDS[card])
    assert _fits(p, CARDS[card]), p
    assert p.reference_rows & (p.reference_rows - 1) == 0, p  # a power of two
    assert p.tokens % p.reference_rows == 0, p  # equal blocks: one compilation per case


def test_plan_keeps_full_size_on_h100_and_h200_with_reference_in_blocks():
    h100, h200 = demo.plan(V, CARDS["H100-80GB"]), demo.plan(V, CARDS["H200-141GB"])
    assert h100.tokens == h200.tokens == demo.GPU_TOKENS
    # The H100's float64 logits of one block: far below the 9.3 GiB that failed.
    assert h100.reference_rows < demo.GPU_TOKENS and 8 * h100.reference_rows * V < 3 * GIB
    assert h200.reference_rows >= h100.reference_rows


def test_plan_shrinks_t_on_a_16gb_card():
    p = demo.plan(V, CARDS["16GB"])
    assert 512 <= p.tokens < demo.GPU_TOKENS, p
    assert 1 <= p.reference_rows <= p.tokens


def test_plan_on_cpu_and_without_statistics():
    assert demo.plan(demo.CPU_VOCAB, None, on_gpu=False) == demo.Plan(demo.CPU_TOKENS,
                                                                      demo.CPU_TOKENS)
    # A GPU that reports no memory statistics: full T, the reference in small blocks.
    assert demo.plan(V, None) == demo.Plan(demo.GPU_TOKENS, 1024)


def test_plan_keeps_given_tokens():
    assert demo.plan(V, CARDS["16GB"], tokens=8192).tokens == 8192
    assert demo.plan(V, CARDS["16GB"], tokens=8192).reference_rows == demo.MIN_REFERENCE_ROWS
    assert demo.plan(1024, None, tokens=16, on_gpu=False) == demo.Plan(16, 16)


def test_free_device_bytes_on_cpu_is_none_or_positive():
    free = demo.free_device_bytes(jax.devices("cpu")[0])
    assert free is None or free > 0


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
def test_reference_errors_in_blocks_match_one_block(masked):
    """Blocks of 5 rows (the last one ragged) give the errors of one block of all rows."""
    with jax.enable_x64(True):
        logits32, targets, keep_mask, cot_lp, cot_h = demo.make_inputs(16, 512)
        mask = keep_mask if masked else None
        results = []
        for impl in ("xla", "reference"):
            grad, (lp, h) = demo.forward_backward(
                logits32.astype(jnp.bfloat16), targets, mask, cot_lp, cot_h,
                implementation=impl, temperature=0.8)
            results.append((lp, h, grad))
        options = dict(dtype=jnp.bfloat16, temperature=0.8)
        whole, one = demo.errors_in_blocks(logits32, targets, mask, cot_lp, cot_h, results,
                                           block_rows=16, **options)
        blocked, four = demo.errors_in_blocks(logits32, targets, mask, cot_lp, cot_h, results,
                                              block_rows=5, **options)
    assert (one, four) == (1, 4)
    np.testing.assert_allclose(np.array(blocked), np.array(whole), rtol=1e-6, atol=0)
    # bf16 gradients carry one bf16 rounding, the XLA path's lp/H are close to float64.
    assert 1e-4 < whole[0][2] < 1e-2 and whole[0][0] < 1e-4, whole
