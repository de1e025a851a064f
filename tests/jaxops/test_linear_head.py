"""`jaxops.linear_logprob_entropy` (the output layer fused into the op, chunked over the vocabulary)
against the float64 reference: `implementation="reference"` on the same hidden and weight
values upcast to float64 (tests/_linear_cases.py), with tests/_oracle.py's tolerances.

Values and both gradients (hidden, weight) through `jax.vjp` with random cotangents for
both outputs; every flag; fp32, bf16, fp16; T = 0 and 1; leading dims; chunk sizes that do
and do not divide V; H and V that are no multiple of any tile; bad calls; second order.
Pallas runs in interpret mode on CPU, so its shapes are tiny. Vocab-parallel checks run
in a subprocess with fake CPU devices (tests/jaxops/_linear_head_worker.py). The fused
Mosaic GPU kernels: test_linear_head_fused.py; the lowered programs (no `[T, V_loc]`
array, fp32 GEMM results, the fused kernels for CUDA): test_linear_head_lowering.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import jaxops
from jaxops.linear import default_chunk_size

from _linear_cases import make_linear_inputs
from _linear_head_cases import BF16, F16, F32, run_case

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_linear_head_worker.py")


# (lead, H, V, dtype, mask, temperature, with_entropy, entropy_grad, chunk_size)
CASES = [
    ((2, 5), 19, 45, F32, True, 0.7, True, True, 4),  # leading dims; 4 does not divide 10
    ((10,), 19, 45, BF16, True, 1.3, True, True, 5),  # 5 divides 10
    ((10,), 19, 45, F32, False, 1.0, True, False, 3),  # entropy without gradient
    ((10,), 19, 45, BF16, False, 0.8, False, True, None),  # no entropy; default chunk
    ((10,), 19, 45, F16, True, 2.5, False, False, 7),
    ((1,), 7, 3, F32, True, 1.0, True, True, 1),  # T = 1
    ((7,), 33, 130, F32, True, 0.6, True, True, 16),  # chunk > T
    ((3, 4), 5, 1, F32, False, 1.0, True, True, 5),  # V = 1
]


@pytest.mark.parametrize(
    "lead,hidden_size,num_vocab,dtype,mask,temperature,with_entropy,entropy_grad,chunk", CASES,
    ids=[f"{'x'.join(map(str, c[0]))}-H{c[1]}-V{c[2]}-{jnp.dtype(c[3]).name}-mask{int(c[4])}"
         f"-tau{c[5]}-H{int(c[6])}{int(c[7])}-chunk{c[8]}" for c in CASES])
def test_xla_against_float64(lead, hidden_size, num_vocab, dtype, mask, temperature,
                             with_entropy, entropy_grad, chunk):
    run_case(lead, hidden_size, num_vocab, dtype, mask=mask, temperature=temperature,
             with_entropy=with_entropy, entropy_grad=entropy_grad, chunk_size=chunk)


@settings(max_examples=6, deadline=None)
# Found on the H200 by a d weight taken from a dot with a bf16 result, which XLA summed
# in bf16 at this tiny shape (0.41% off, tolerance 0.4%); the dots now return fp32.
@example(tokens=7, hidden_size=1, num_vocab=40, chunk=1, mask=False, bf16=True,
         temperature=1.0, flags=(True, True), seed=0)
@given(tokens=st.integers(1, 12), hidden_size=st.integers(1, 40), num_vocab=st.integers(1, 90),
       chunk=st.integers(1, 13), mask=st.booleans(), bf16=st.booleans(),
       temperature=st.sampled_from([0.5, 1.0, 1.7]), flags=st.sampled_from(
           [(True, True), (True, False), (False, True)]), seed=st.integers(0, 2**16))
def test_random_shapes(tokens, hidden_size, num_vocab, chunk, mask, bf16, temperature, flags,
                       seed):
    run_case((tokens,), hidden_size, num_vocab, BF16 if bf16 else F32, mask=mask,
             temperature=temperature, with_entropy=flags[0], entropy_grad=flags[1],
             chunk_size=chunk, seed=seed)


def test_out_of_range_target_under_jit_is_nan():
    data = make_linear_inputs(2, (5,), 8, 20, F32)
    targets = jnp.asarray(data["targets"]).at[3].set(20)
    log_prob, _ = jax.jit(lambda h, w, y: jaxops.linear_logprob_entropy(h, w, y, chunk_size=2))(
        jnp.asarray(data["hidden"]), jnp.asarray(data["weight"]), targets)
    log_prob = np.asarray(log_prob)
    assert np.isnan(log_prob[3]) and np.isfinite(np.delete(log_prob, 3)).all(), log_prob


@pytest.mark.parametrize("implementation,lead,hidden_size,num_vocab,dtype,mask,flags,chunk", [
    ("pallas", (6,), 16, 40, F32, True, (True, True), 4),
    ("pallas", (6,), 16, 40, BF16, False, (True, True), 3),
    # leading dims, H and V multiples of nothing, fp16 without the entropy; T = 1; the
    # entropy without its gradient
    ("pallas", (2, 3), 19, 45, F16, True, (False, False), 7),
    ("pallas", (1,), 16, 40, BF16, True, (True, True), 16),
    ("pallas", (6,), 16, 40, F32, False, (True, False), 8),
    # Mosaic chunks must be multiples of 16 columns (8 for fp32 without a mask): 80 =
    # 2 chunks of 32 + a tail of 16, all taken by the kernels (no XLA fallback).
    ("pallas_mosaic", (6,), 16, 80, F32, True, (True, True), 32),
    ("pallas_mosaic", (6,), 16, 80, BF16, False, (True, True), 32)])
def test_pallas_interpret_against_float64(implementation, lead, hidden_size, num_vocab, dtype,
                                          mask, flags, chunk):
    with warnings.catch_warnings():
        # A fallback to XLA (a RuntimeWarning) would not test the kernels. Only that
        # category: on a GPU, jax 0.11's Triton lowering warns that it is deprecated.
        warnings.simplefilter("error", RuntimeWarning)
        run_case(lead, hidden_size, num_vocab, dtype, mask=mask, temperature=0.7,
                 with_entropy=flags[0], entropy_grad=flags[1], chunk_size=chunk,
                 implementation=implementation, seed=3)

def test_eager_call():
    """Un-jitted: validation and the eager range check run, dispatch op by op."""
    run_case((2, 3), 9, 21, F32, mask=True, temperature=0.9, chunk_size=4, jit=False, seed=5)


@pytest.mark.parametrize("lead", [(0,), (2, 0)])
def test_empty(lead):
    hidden, weight = jnp.ones((*lead, 6), BF16), jnp.ones((11, 6), BF16)
    targets = jnp.zeros(lead, jnp.int32)
    out, pullback = jax.vjp(
        lambda h, w: jaxops.linear_logprob_entropy(h, w, targets, chunk_size=4), hidden, weight)
    assert out[0].shape == out[1].shape == lead and out[0].dtype == jnp.float32
    d_hidden, d_weight = pullback((jnp.zeros(lead, F32), jnp.zeros(lead, F32)))
    assert d_hidden.shape == hidden.shape and d_hidden.dtype == BF16
    assert d_weight.dtype == BF16 and not np.asarray(d_weight, np.float32).any()


def test_matches_unfused_op_in_float32():
    """Equal (to fp32 rounding) to `logprob_entropy(hidden @ weight.T)`."""
    data = make_linear_inputs(7, (9,), 24, 50, F32, mask=True)
    h, w = jnp.asarray(data["hidden"]), jnp.asarray(data["weight"])
    y, m = jnp.asarray(data["targets"]), jnp.asarray(data["mask"])
    fused = jaxops.linear_logprob_entropy(h, w, y, keep_mask=m, temperature=0.8, chunk_size=4)
    plain = jaxops.logprob_entropy(
        jnp.dot(h, w.T, precision="highest"), y, keep_mask=m, temperature=0.8)
    for a, b in zip(fused, plain):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_default_chunk_size():
    assert default_chunk_size(5, 151_936) == 151_936  # capped at V_loc
    cols = default_chunk_size(16_384, 151_936)  # 1/24 of the bf16 logits' bytes
    budget = 16_384 * 151_936 * 2 // 24
    assert cols % 128 == 0 and 16_384 * cols * 4 <= budget < 16_384 * (cols + 128) * 4
    assert default_chunk_size(1000, 151_936) * 1000 * 4 <= 48 * 2**20  # the floor budget
    assert default_chunk_size(4096, 151_936) == 3072
    assert default_chunk_size(10**7, 1000) == 128  # at least 128 columns


# ------------------------------------------------------------------ errors

def _bad(**overrides):
    args = dict(hidden=jnp.ones((4, 6), F32), weight=jnp.ones((10, 6), F32),
                targets=jnp.zeros((4,), jnp.int32))
    args.update(overrides)
    hidden, weight, targets = args.pop("hidden"), args.pop("weight"), args.pop("targets")
    return lambda: jaxops.linear_logprob_entropy(hidden, weight, targets, **args)


@pytest.mark.parametrize("call,error,fragment", [
    (_bad(weight=jnp.ones((10, 5), F32)), ValueError, "H must agree"),
    (_bad(weight=jnp.ones((10,), F32)), ValueError, "weight must have shape"),
    (_bad(hidden=jnp.ones((4, 0), F32), weight=jnp.ones((10, 0), F32)), ValueError,
     "hidden must have"),
    (_bad(weight=jnp.ones((10, 6), BF16)), TypeError, "same dtype"),
    (_bad(hidden=jnp.ones((4, 6), jnp.int32), weight=jnp.ones((10, 6), jnp.int32)),
     TypeError, "hidden and weight must be one of"),
    (_bad(targets=jnp.zeros((3,), jnp.int32)), ValueError, "targets must have shape"),
    (_bad(keep_mask=jnp.ones((4, 9), bool)), ValueError, "keep_mask must have"),
    (_bad(keep_mask=jnp.ones((4, 10), jnp.int32)), TypeError, "keep_mask must be bool"),
    (_bad(temperature=0.0), ValueError, "temperature"),
    (_bad(temperature=-1.0), ValueError, "temperature"),
    (_bad(chunk_size=0), ValueError, "chunk_size"),
    (_bad(targets=jnp.asarray([0, 1, 10, 2], jnp.int32)), ValueError, "targets must lie in"),
    (_bad(axis_name="tp", implementation="reference"), ValueError, "reference"),
    (_bad(implementation="triton"), ValueError, "implementation"),
], ids=["H", "weight_rank", "H0", "dtype_mix", "int_dtype", "targets_shape", "mask_shape",
        "mask_dtype", "tau0", "tau_neg", "chunk0", "target_range", "reference_axis", "impl"])
def test_bad_calls(call, error, fragment):
    with pytest.raises(error, match=fragment):
        call()


# ------------------------------------------------------------------ vocab-parallel

def test_vocab_parallel_in_subprocess():
    """tests/jaxops/_linear_head_worker.py on 4 fake CPU devices: 2 and 4 shards, check_vma True
    and False, values and d hidden / d weight vs float64; the backward's collectives; the
    fused Mosaic GPU kernels (interpret mode) on 2 shards."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=4"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    done = subprocess.run([sys.executable, str(WORKER)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-6000:]
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, done.stdout[-2000:]
    print(json.dumps(json.loads(results[-1][len("RESULT "):]), indent=1))


def test_chunk_merge_equals_one_pass_and_ignores_empty_sides():
    """`linear._merge` (the online log-sum-exp step over vocabulary chunks) against the
    statistics of the concatenated columns, including sides with no finite logit (max
    -inf) and no kept column (masked max -inf): their -inf must not produce NaN."""
    from jaxops.backends import xla
    from jaxops.linear import _empty_stats, _merge

    rng = np.random.default_rng(7)
    x = rng.normal(0, 3, (5, 24)).astype(np.float32)
    x[1, :12] = -np.inf  # row 1: the first chunk has no finite logit
    x[2, :] = -np.inf  # row 2: none at all
    keep = rng.random((5, 24)) < 0.3
    keep[3, :12] = False  # row 3: nothing kept in the first chunk
    targets = np.array([0, 20, 3, 13, 23], np.int32)

    def stats(cols, shift):
        return xla.forward_stats(jnp.asarray(x[:, cols]), jnp.asarray(targets - shift),
                                 jnp.asarray(keep[:, cols]), inv_tau=1.0, with_entropy=True,
                                 config=None)

    whole = stats(slice(0, 24), 0)
    merged = _merge(_merge(_empty_stats(5, True, True, ()), stats(slice(0, 12), 0)),
                    stats(slice(12, 24), 12))
    lse = lambda s: np.asarray(s.max_logit) + np.log(np.asarray(s.sum_exp))  # noqa: E731
    masked = lambda s: np.asarray(s.masked_max) + np.log(np.asarray(s.masked_sum_exp))  # noqa: E731
    entropy = lambda s: np.asarray(s.sum_exp_shifted) / np.asarray(s.sum_exp)  # noqa: E731
    finite = np.isfinite(np.asarray(whole.max_logit))
    assert finite.tolist() == [True, True, False, True, True]
    np.testing.assert_allclose(lse(merged)[finite], lse(whole)[finite], rtol=1e-6)
    np.testing.assert_allclose(masked(merged)[finite], masked(whole)[finite], rtol=1e-6)
    np.testing.assert_allclose(entropy(merged)[finite], entropy(whole)[finite], atol=1e-5)
    np.testing.assert_array_equal(merged.target_logit, whole.target_logit)
    assert np.asarray(merged.max_logit)[2] == -np.inf and np.asarray(merged.sum_exp)[2] == 0
    for field in merged:
        assert not np.isnan(np.asarray(field)).any(), merged


def test_pallas_picks_its_backend_for_the_chunks(backend_choices):
    """The kernels read one chunk's fp32 logits [T, chunk] at a time: "pallas" chooses
    its backend (`registry.for_call`) for that width and 4-byte elements, not
    for V_loc and the inputs' dtype (on Hopper, V_loc >= 65,536 in bf16 would otherwise
    send ~4096-column fp32 chunks to the Mosaic kernels, a width never timed; Triton was
    faster at the narrowest width measured, 18,992)."""
    keys = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(keys[0], (40, 16), jnp.bfloat16)
    weight = jax.random.normal(keys[1], (1000, 16), jnp.bfloat16)
    targets = jax.random.randint(keys[2], (40,), 0, 1000)
    for chunk_size, width in ((256, 256), (None, 1000), (4096, 1000)):
        jaxops.linear_logprob_entropy(hidden, weight, targets, chunk_size=chunk_size,
                                      implementation="xla")
        assert (backend_choices[-1]["num_vocab"], backend_choices[-1]["itemsize"]) == (
            width, 4)


# ------------------------------------------------------------------ second order

@pytest.mark.parametrize("implementation,dtype,tol,masked", [
    ("xla", F32, 1e-5, True), ("pallas", F32, 1e-5, False),
    # the fused kernels (interpret mode): bf16 d logits in the backward's GEMMs (4e-3 seen)
    ("pallas_mosaic", BF16, 2e-2, False), ("pallas_mosaic", BF16, 2e-2, True)])
def test_gradient_of_the_gradient(implementation, dtype, tol, masked, fused_calls):
    """A Hessian-vector product (the gradient of <d loss / d hidden, v>, to hidden and
    weight) through every implementation against float64 `reference` on the same
    rounded inputs: the Pallas kernels' backward carries XLA's derivative
    (`stats.with_xla_derivative`), which JAX cannot take of a Pallas call."""
    T, H, V = 16, 64, 80
    k = jax.random.split(jax.random.key(12), 4)
    hidden = (jax.random.normal(k[0], (T, H), F32) * 0.5).astype(dtype)
    weight = (jax.random.normal(k[1], (V, H), F32) * 0.3).astype(dtype)
    targets = jax.random.randint(k[2], (T,), 0, V)
    v = jax.random.normal(k[3], (T, H), F32)
    weights_lp, weights_h = jnp.linspace(-1.0, 2.0, T), jnp.cos(jnp.arange(T))
    keep = (jax.random.uniform(jax.random.key(4), (T, V)) < 0.4) if masked else None

    def hvp(implementation, hidden, weight):
        def loss(hidden, weight):
            lp, ent = jaxops.linear_logprob_entropy(
                hidden, weight, targets, keep_mask=keep, temperature=0.7, chunk_size=32,
                implementation=implementation)
            return (lp * weights_lp).sum() + 0.3 * (ent * weights_h).sum()

        def directional(hidden, weight):
            d_hidden = jax.grad(loss)(hidden, weight)
            return (d_hidden.astype(v.dtype) * v.astype(d_hidden.dtype)).sum()

        return jax.jit(jax.grad(directional, argnums=(0, 1)))(hidden, weight)

    got = hvp(implementation, hidden, weight)
    want = hvp("reference", hidden.astype(jnp.float64), weight.astype(jnp.float64))
    for name, a, b in zip(("hidden", "weight"), got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b)
        err = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert err <= tol, f"second order to {name}: relative error {err:.3g}"
    if implementation == "pallas_mosaic":
        assert fused_calls["forward"] and fused_calls["backward"]
