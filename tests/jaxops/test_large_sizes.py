"""Correct at the sizes users run: operands of 2**31 elements and more.

At T = 16,384, V = 151,936 a `[T, V]` operand has 2.49e9 elements. JAX's Pallas Triton
lowering indexed 1-byte operands of that size (the bool keep mask) with wrapping 32-bit
offsets, so rows from 14,134 on read another row's mask (`jaxops/backends/triton/offsets.py`).

- On CPU: the kernels are lowered for CUDA (no GPU needed) at that size and the Triton
  IR is read: every address computation into a `[T, V]` operand must be 64-bit.
- On GPU: the full-size calls, with and without a mask, both dtypes, forward and
  backward, compared row by row with the float64 reference at the first, middle and
  last rows and around the row where 32-bit offsets into the mask wrap.
"""

from __future__ import annotations

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxops.backends.triton import kernels as triton_kernels
from jaxops.contract import BackwardCoefs

from _logprob_cases import BF16, F32, op_with_vjp_jit
from _oracle import (  # one float64 oracle and tolerance table for all tests
    assert_grad_close, assert_values_close, reference64, to_float64, value_bound)

LARGE_T, LARGE_V = 16_384, 151_936  # T * V = 2.49e9 > 2**31
# First, middle, last, and around 2**31 / V = 14,134.4 where 32-bit mask offsets wrap.
ROWS = np.array([0, 1, 2, LARGE_T // 2, 14_133, 14_134, 14_135, LARGE_T - 2, LARGE_T - 1])


# ------------------------------------------------------------ CPU: the lowered Triton IR


def _triton_ir(fn, *args) -> str:
    """The Triton IR of every Pallas kernel in `fn`, lowered for CUDA (printed by
    PallasConfig(debug=True) during lowering)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        except Exception as err:  # e.g. a jaxlib that must compile Triton for a real GPU
            pytest.skip(f"cannot lower the Triton kernels for CUDA here: {err!r:.200}")
    return out.getvalue()


def _offset_widths(ir_text: str, big_args: set[int]) -> list[str]:
    """Offset type of each address computation into a [T, V] operand: every tile
    load/store (tensor-valued `tt.addptr`; only [T, V] operands are read in tiles) and
    every scalar access based directly on a [T, V] kernel argument."""
    widths = []
    for line in ir_text.splitlines():
        m = re.search(r"tt\.addptr (%[\w#]+), %[\w#]+ : (\S+), (\S+?i\d+>?)(\s|$)", line)
        if not m:
            continue
        base, ptr_type, offset_type, _ = m.groups()
        arg = re.fullmatch(r"%arg(\d+)", base)
        if ptr_type.startswith("tensor<") or (arg and int(arg.group(1)) in big_args):
            widths.append(re.sub(r"tensor<\d+x|>", "", offset_type))
    return widths


@pytest.mark.parametrize("dtype", [BF16, F32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("masked", [True, False], ids=["mask", "no_mask"])
def test_kernels_index_large_operands_in_64_bits(dtype, masked):
    """Forward and backward kernels at T * V > 2**31: all [T, V] offsets are i64."""
    check_offsets(LARGE_T, LARGE_V, dtype, masked)


@settings(max_examples=12, deadline=None)
@given(num_tokens=st.integers(1, 40_000), num_vocab=st.integers(1, 300_000),
       dtype=st.sampled_from([BF16, F32]), masked=st.booleans())
def test_kernels_lower_at_random_shapes(num_tokens, num_vocab, dtype, masked):
    """Any T and V lower for CUDA, and [T, V] offsets are 64-bit wherever T * V
    reaches 2**31 (any T and V, not only the sizes above)."""
    check_offsets(num_tokens, num_vocab, dtype, masked,
                  require_i64=num_tokens * num_vocab >= 2**31)


def check_offsets(T, V, dtype, masked, require_i64=True):
    config = triton_kernels.PallasConfig(debug=True)
    logits = jax.ShapeDtypeStruct((T, V), dtype)
    rows = jax.ShapeDtypeStruct((T,), jnp.float32)
    targets = jax.ShapeDtypeStruct((T,), jnp.int32)
    mask = jax.ShapeDtypeStruct((T, V), jnp.bool_) if masked else None

    def forward(logits, targets, mask):
        return triton_kernels.forward_stats(logits, targets, mask, inv_tau=1.25,
                                        with_entropy=True, config=config)

    def backward(logits, targets, mask, row):
        coefs = BackwardCoefs(row, row, row, row if masked else None)
        return triton_kernels.backward_logits(logits, targets, mask, row, row if masked else None,
                                          coefs, inv_tau=1.25, config=config)

    # Kernel arguments: forward (targets, logits, [mask], outputs...);
    # backward (5 or 7 rows..., logits, [mask], d logits).
    fwd_big = {1, 2} if masked else {1}
    num_rows = 7 if masked else 5
    bwd_big = set(range(num_rows, num_rows + (3 if masked else 2)))
    for name, ir_text, big in (
            ("forward", _triton_ir(forward, logits, targets, mask), fwd_big),
            ("backward", _triton_ir(backward, logits, targets, mask, rows), bwd_big)):
        widths = _offset_widths(ir_text, big)
        assert widths, f"{name}: no [T, V] address computation found in the Triton IR"
        if not require_i64:
            continue
        assert set(widths) == {"i64"}, (
            f"{name}: [T, V] operands indexed with {sorted(set(widths))} offsets "
            f"({widths.count('i32')} of {len(widths)} are 32-bit)")


# ---------------------------------------------------------------- GPU: full-size calls


def _large_inputs(dtype, masked, seed=0):
    k_logits, k_targets, k_mask, k_cot = jax.random.split(jax.random.key(seed), 4)
    shape = (LARGE_T, LARGE_V)
    logits = (3.0 * jax.random.normal(k_logits, shape, jnp.float32)).astype(dtype)
    targets = jax.random.randint(k_targets, (LARGE_T,), 0, LARGE_V, jnp.int32)
    mask = jax.random.bernoulli(k_mask, 0.3, shape) if masked else None
    g_lp, g_h = jax.random.normal(k_cot, (2, LARGE_T), jnp.float32)
    return logits, targets, mask, g_lp, g_h


def assert_rows_match_reference(rows, logits, targets, mask, g_lp, g_h, temperature,
                                log_prob, entropy, grad):
    """Each of `rows` of a large call against the float64 reference of that row alone
    (the op is row-wise: a row's results do not depend on the others)."""
    take = lambda a: None if a is None else np.asarray(a[rows])  # noqa: E731
    x, y, m = take(logits), take(targets), take(mask)
    gl, gh = take(g_lp), take(g_h)
    lp64, h64, grad64 = reference64(
        to_float64(x), jnp.asarray(y), None if m is None else jnp.asarray(m),
        jnp.asarray(gl), jnp.asarray(gh), temperature=temperature)
    bound = value_bound(x, temperature)
    assert_values_close("log_prob", take(log_prob), lp64, bound)
    assert_values_close("entropy", take(entropy), h64, bound)
    got = take(grad)
    for i, row in enumerate(rows):  # per row, so that one wrong row cannot hide
        cot = float(abs(gl[i]) + abs(gh[i])) / temperature
        try:
            assert_grad_close(jnp.asarray(got[i]), np.asarray(grad64[i]), logits.dtype,
                              floor=0.1 * cot)
        except AssertionError as err:
            raise AssertionError(f"row {int(row)}: {err}") from None


@pytest.mark.gpu
@pytest.mark.parametrize("implementation,dtype,masked", [
    ("pallas", BF16, True), ("pallas", F32, True), ("pallas", BF16, False),
    ("xla", BF16, True)], ids=lambda v: jnp.dtype(v).name if not isinstance(v, (str, bool))
    else str(v))
def test_large_call_matches_reference(implementation, dtype, masked):
    """T = 16,384, V = 151,936 (2.49e9 elements per [T, V] operand) on the GPU."""
    temperature = 0.9
    logits, targets, mask, g_lp, g_h = _large_inputs(dtype, masked)
    log_prob, entropy, grad = op_with_vjp_jit(
        logits, targets, mask, g_lp, g_h, temperature=temperature, with_entropy=True,
        entropy_grad=True, implementation=implementation)
    assert grad.shape == logits.shape and grad.dtype == logits.dtype
    assert_rows_match_reference(ROWS, logits, targets, mask, g_lp, g_h, temperature,
                                log_prob, entropy, grad)
