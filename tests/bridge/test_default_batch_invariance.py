"""The default's promise: one set of bits per row, whatever the batch and the entry point.

With the default implementation, on one GPU and one software version, a row's log-prob,
entropy and gradient are bitwise the same whether it is alone or in a batch of any size,
at any position, through every entry point: `jaxops.logprob_entropy` (jitted, eager,
under `vmap`, inside `shard_map`), `bridge.logprob_entropy` on either route (eager,
and the custom op that `torch.compile` runs) and the slime drop-in. Each batch below is
compared with one reference: the row in a jitted call over all rows.

`JAXOPS_PROMISE_T` (comma-separated) narrows the batch sizes for a quicker GPU run.
On CPU the same checks run in interpret mode at small sizes (the default is "xla"
there, so "pallas" is named): they pin the wrappers' row handling, not the kernels'
arithmetic order, which is the GPU's.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxops

torch = pytest.importorskip("torch")
import bridge  # noqa: E402
from bridge import op as bridge_op  # noqa: E402
from bridge.slime import calculate_log_probs_and_entropy  # noqa: E402

# 1.0: the slime drop-in takes logits already divided by the temperature, so it is
# compared at 1.0 (tests/jaxops/test_batch_invariance.py covers a temperature per backend).
TAU = 1.0
BATCHES = tuple(int(t) for t in os.environ.get(
    "JAXOPS_PROMISE_T", "1,7,100,1000,8191,8192,8193").split(","))


def _inputs(num_tokens, num_vocab, dtype, masked, seed=0):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((num_tokens, num_vocab), np.float32) * 3)
    targets = rng.integers(0, num_vocab, num_tokens).astype(np.int32)
    mask = rng.random((num_tokens, num_vocab)) < 0.05 if masked else None
    g_lp = rng.standard_normal(num_tokens, np.float32)
    g_h = rng.standard_normal(num_tokens, np.float32)
    return jnp.asarray(logits, dtype), targets, mask, g_lp, g_h


def _jax_entry(kind, implementation, with_entropy):
    """fn(logits, targets, mask, g_lp, g_h, positions) -> (log_prob, entropy or None,
    grad) as numpy, for the rows at `positions` only, picked on the device (no whole
    [T, V] gradient goes to the host)."""

    def value_and_grad(x, t, m, g_lp, g_h, axis_name=None):
        def f(z):
            return jaxops.logprob_entropy(z, t, keep_mask=m, temperature=TAU,
                                          with_entropy=with_entropy,
                                          implementation=implementation,
                                          axis_name=axis_name)
        (lp, h), vjp = jax.vjp(f, x)
        (grad,) = vjp((g_lp, g_h) if with_entropy else (g_lp, None))
        return lp, h, grad

    if kind == "jit":
        fn = jax.jit(value_and_grad)
    elif kind == "eager":
        fn = value_and_grad
    elif kind == "vmap":
        def fn(*args):
            batched = [None if a is None else a[None] for a in args]
            out = jax.vmap(value_and_grad)(*batched)
            return [None if o is None else o[0] for o in out]
    elif kind == "shard_map":
        from jax.sharding import PartitionSpec as P

        mesh = jax.make_mesh((1,), ("v",), axis_types=(jax.sharding.AxisType.Auto,))

        def fn(x, t, m, g_lp, g_h):
            inner = jax.shard_map(
                lambda *a: value_and_grad(*a, axis_name="v"), mesh=mesh,
                in_specs=(P(None, "v"), P(), None if m is None else P(None, "v"), P(), P()),
                out_specs=(P(), None if not with_entropy else P(), P(None, "v")))
            return jax.jit(inner)(x, t, m, g_lp, g_h)
    else:
        raise ValueError(kind)

    def run(x, t, m, g_lp, g_h, positions):
        out = fn(x, jnp.asarray(t), None if m is None else jnp.asarray(m),
                 jnp.asarray(g_lp), jnp.asarray(g_h))
        picked = jnp.asarray(positions)
        return [None if o is None else np.asarray(jnp.asarray(o[picked], jnp.float32))
                for o in out]

    return run


def _torch_entry(kind, implementation, with_entropy, device):
    """As `_jax_entry`; the logits reach torch through DLPack, on their device."""
    def run(x, t, m, g_lp, g_h, positions):
        xs = torch.from_dlpack(x)
        assert xs.device == device
        xs.requires_grad_()
        ts = torch.from_numpy(np.asarray(t, np.int64)).to(device)
        ms = None if m is None else torch.from_numpy(np.asarray(m)).to(device).clone()
        if kind == "slime":
            lp, h = calculate_log_probs_and_entropy(
                xs, ts, None, with_entropy=with_entropy, log_prob_keep_mask=ms)
            lp = lp.reshape(-1)
        else:
            lp, h = bridge.logprob_entropy(xs, ts, keep_mask=ms, temperature=TAU,
                                           with_entropy=with_entropy,
                                           implementation=implementation)
        outs = [lp] + ([h] if with_entropy else [])
        cots = [torch.from_numpy(g_lp).to(device)]
        cots += [torch.from_numpy(g_h).to(device)] if with_entropy else []
        (grad,) = torch.autograd.grad(outs, xs, cots)
        picked = torch.from_numpy(np.asarray(positions)).to(device)
        to_np = lambda a: (None if a is None  # noqa: E731
                           else a.detach()[picked].float().cpu().numpy())
        return to_np(lp), to_np(h), to_np(grad)

    return run


def check_promise(entries, num_tokens, num_vocab, dtype, masked, with_entropy, batches,
                  rows):
    inputs = _inputs(num_tokens, num_vocab, dtype, masked)
    rows = np.asarray(rows)
    reference = entries["jit"](*inputs, rows)  # the rows under test, in their order
    rng = np.random.default_rng(1)

    def take(idx):
        return [None if a is None else a[idx] for a in inputs]

    for size in batches:
        size = min(size, num_tokens)
        # The rows under test that fit, at random positions among other rows.
        chosen = list(rows[:size])
        others = np.setdiff1d(np.arange(num_tokens), chosen)
        idx = np.concatenate([chosen, rng.choice(others, size - len(chosen), replace=False)])
        idx = rng.permutation(idx)
        positions = np.array([int(np.nonzero(idx == row)[0][0]) for row in chosen])
        for name, entry in entries.items():
            got = entry(*take(idx), positions)
            for what, a, b in zip(("log_prob", "entropy", "grad"), got, reference):
                if b is None:
                    assert a is None
                    continue
                for k, row in enumerate(chosen):
                    np.testing.assert_array_equal(
                        a[k], b[k],
                        err_msg=f"{what}: row {row} through {name} in a batch of {size}")


# --- on the GPU ------------------------------------------------------------------------

def _rows(num_tokens):
    """The rows under test: the first, one past the first 4096 (a second row block of
    the largest tiles) where the batch has it, and the last."""
    return tuple(sorted({0, min(4097, num_tokens // 2), num_tokens - 1}))


def _gpu_entries(with_entropy, dtype):
    cuda = torch.device("cuda", 0)
    entries = {kind: _jax_entry(kind, None, with_entropy)
               for kind in ("jit", "eager", "vmap", "shard_map")}
    entries["bridge"] = _torch_entry("bridge", None, with_entropy, cuda)
    entries["slime"] = _torch_entry("slime", None, with_entropy, cuda)

    def custom_op(*args):
        old = bridge_op.USE_CUSTOM_OP_IN_EAGER
        bridge_op.USE_CUSTOM_OP_IN_EAGER = True  # the route torch.compile runs
        try:
            return _torch_entry("bridge", None, with_entropy, cuda)(*args)
        finally:
            bridge_op.USE_CUSTOM_OP_IN_EAGER = old

    entries["bridge_custom_op"] = custom_op
    return entries


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_vocab", [18992, 151936])
def test_gpu_default_is_batch_invariant_everywhere(num_vocab, dtype, masked):
    if not torch.cuda.is_available():
        pytest.skip("the bridge's entry points need a CUDA torch")
    check_promise(_gpu_entries(True, dtype), max(BATCHES), num_vocab, dtype, masked,
                  True, BATCHES, rows=_rows(max(BATCHES)))


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_gpu_default_is_batch_invariant_without_entropy(masked):
    if not torch.cuda.is_available():
        pytest.skip("the bridge's entry points need a CUDA torch")
    check_promise(_gpu_entries(False, jnp.bfloat16), max(BATCHES), 151936, jnp.bfloat16,
                  masked, False, BATCHES, rows=_rows(max(BATCHES)))


@pytest.mark.gpu
def test_gpu_torch_compile_runs_the_same_bits():
    """One real `torch.compile` call against the custom op run eagerly (the test above)."""
    if not (torch.cuda.is_available() and jax.default_backend() == "gpu"):
        pytest.skip("needs a CUDA GPU")
    cuda = torch.device("cuda", 0)
    logits, targets, _, g_lp, g_h = _inputs(1001, 151936, jnp.bfloat16, False)
    want = _torch_entry("bridge", None, True, cuda)(logits, targets, None, g_lp, g_h,
                                                    np.arange(1001))

    compiled = torch.compile(lambda x, t: bridge.logprob_entropy(x, t, temperature=TAU),
                             fullgraph=True)
    xs = torch.from_numpy(np.asarray(jnp.asarray(logits, jnp.float32))).to(cuda)
    xs = xs.to(torch.bfloat16).requires_grad_()
    lp, h = compiled(xs, torch.from_numpy(targets.astype(np.int64)).to(cuda))
    (grad,) = torch.autograd.grad([lp, h], xs, [torch.from_numpy(g_lp).to(cuda),
                                                torch.from_numpy(g_h).to(cuda)])
    for what, a, b in zip(("log_prob", "entropy", "grad"),
                          (lp, h, grad), want):
        np.testing.assert_array_equal(a.detach().float().cpu().numpy(), b, err_msg=what)


# --- interpret mode on CPU -------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_default_entry_points_agree_interpret(masked):
    """Every entry point's wrappers hand a row to the kernels the same way (interpret
    mode, "pallas" named: the CPU default is "xla"). Not eager or vmapped `jaxops`: the
    interpreter runs the kernel body as XLA operations (one by one outside jit, batched
    under vmap), whose roundings (fused multiply-adds) are XLA's choice -- on the GPU
    the kernels are compiled code either way, and the GPU test covers those entries."""
    cpu = torch.device("cpu")
    entries = {"jit": _jax_entry("jit", "pallas", True)}
    entries["bridge"] = _torch_entry("bridge", "pallas", True, cpu)

    def custom_op(*args):
        old = bridge_op.USE_CUSTOM_OP_IN_EAGER
        bridge_op.USE_CUSTOM_OP_IN_EAGER = True
        try:
            return _torch_entry("bridge", "pallas", True, cpu)(*args)
        finally:
            bridge_op.USE_CUSTOM_OP_IN_EAGER = old

    entries["bridge_custom_op"] = custom_op
    check_promise(entries, 40, 300, jnp.float32, masked, True, (1, 7, 40), rows=(0, 21, 39))
