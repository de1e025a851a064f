"""CPU tests of the PyTorch bridge (bridge/): values and gradients against a float64 torch
reference and Megatron-core's fused vocab-parallel cross entropy, for TP = 1 (in this
process) and TP = 2, 4 (spawned gloo groups); torch.compile, opcheck, zero-copy, errors.

The scenario matrix lives in tests/_bridge_scenarios.py (shared with the CUDA tests).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import jax
import pytest
import torch

import bridge
from bridge import _dlpack, _jaxfns, op

import _bridge_scenarios as S

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pg():
    """A gloo process group of one rank (Megatron needs a group even for TP = 1)."""
    with S.one_rank_group("gloo", timeout_s=60) as group:
        yield group


@pytest.fixture(scope="module")
def megatron():
    return S.load_megatron()


@pytest.fixture
def no_kernels(monkeypatch):
    """Fail the test if any JAX function of the bridge is reached."""
    def refuse(**_):
        raise AssertionError("a kernel was launched before the error")

    for name in ("local_forward", "combine", "local_backward"):
        monkeypatch.setattr(_jaxfns, name, refuse)


def _inputs(T=5, V=11, dtype=torch.float32, seed=0, masked=False):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, V, generator=gen) * 2).to(dtype).requires_grad_()
    y = torch.randint(0, V, (T,), generator=gen)
    mask = (torch.rand(T, V, generator=gen) < 0.4) if masked else None
    return x, y, mask


# ---------------------------------------------------------------------------
# the scenario matrix
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("sc", S.scenarios(full=True), ids=lambda sc: sc.name)
def test_tp1(sc, pg, megatron):
    S.run_scenario(sc, group=pg, meg_group=pg, rank=0, world=1, device=CPU,
                   megatron=megatron)


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_gloo(world, tmp_path):
    """The scenarios on each rank of a spawned gloo group (all of them for TP = 2, a
    covering subset for TP = 4), plus collective counts (2 in the first forward of a
    shape, then 1; 0 in the backward), unequal shards, T = 0 and (TP = 2) torch.compile."""
    failures = S.spawn(world, str(tmp_path), "gloo", full=world == 2)
    assert not failures, "\n".join(failures)


def test_process_group_none_equals_group_of_one(pg):
    x, y, mask = _inputs(masked=True)
    a = bridge.logprob_entropy(x, y, keep_mask=mask)
    b = bridge.logprob_entropy(x, y, keep_mask=mask, process_group=pg)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_chunk_size_changes_nothing(pg):
    x, y, mask = _inputs(T=9, masked=True)
    outs = [bridge.calculate_log_probs_and_entropy(x, y, pg, True, chunk, mask)
            for chunk in (-1, 1, 4, 100)]
    for lp, h in outs[1:]:
        assert torch.equal(lp, outs[0][0]) and torch.equal(h, outs[0][1])


@pytest.mark.parametrize("impl,num_vocab", [("pallas", 21), ("pallas_mosaic", 48)])
def test_pallas_interpret_matches_xla(impl, num_vocab):
    """The Pallas kernels (interpret mode on CPU) through the bridge. (The Mosaic GPU
    kernels take V_loc a multiple of 16 with a mask; 48 also splits into tiles.)"""
    x, y, mask = _inputs(T=3, V=num_vocab, masked=True)
    outs = {}
    for name in ("xla", impl):
        lp, h = bridge.logprob_entropy(x, y, keep_mask=mask, temperature=0.9,
                                       implementation=name)
        (g,) = torch.autograd.grad((lp * 0.3).sum() + h.sum(), x)
        outs[name] = (lp, h, g)
    for a, b in zip(outs["xla"], outs[impl]):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)


def test_bool_mask_reaches_the_mosaic_kernels_as_bytes():
    """The Mosaic kernels read the mask as bytes: a bool mask is handed over as its uint8
    view (same storage, no conversion pass); the other backends keep the bool tensor."""
    from bridge import _run

    x, y, mask = _inputs(T=3, V=48, masked=True)
    plan = _run.Plan(x, y, mask, "pallas_mosaic")
    assert plan.mask.dtype == torch.uint8 and plan.mask.data_ptr() == mask.data_ptr()
    assert torch.equal(plan.mask.bool(), mask)
    for name in ("pallas_triton", "xla"):
        assert _run.Plan(x, y, mask, name).mask.dtype == torch.bool


# ---------------------------------------------------------------------------
# any T: row windows, bounded compiles
# ---------------------------------------------------------------------------

def test_row_windows_cover_every_row_once():
    from bridge._windows import MAX_WINDOW, row_windows

    for T in [*range(1, 600), 2**15 - 1, 2**15, 2**15 + 1, 3 * 2**15 + 12345, 100_003]:
        for align in (1, 4):
            windows = row_windows(T, align)
            new_rows = torch.zeros(T, dtype=torch.int64)
            for w in windows:
                assert 0 <= w.start and w.start + w.size <= T and 0 <= w.skip < w.size
                new_rows[w.start + w.skip:w.start + w.size] += 1
                if T % align == 0:
                    assert w.size & (w.size - 1) == 0 and w.size <= MAX_WINDOW
                    assert w.start % align == 0, (T, align, windows)
            assert bool((new_rows == 1).all()), (T, align, windows)
            extra = sum(w.size for w in windows) - T
            assert extra <= T / 7, (T, windows)
    assert row_windows(7, 4) == ((0, 7, 0),)  # T not a multiple of the alignment: exact


@pytest.mark.parametrize("masked", [False, True])
def test_varying_t_matches_one_call_and_compiles_a_bounded_set(masked):
    """T changes every call (random in [1, 200]): each call equals the JAX op on the same
    rows in one call, and the bridge compiles at most one program per power-of-two
    window size for the forward and the backward."""
    import jax.numpy as jnp
    import numpy as np

    import jaxops

    V = 64  # rows of 64 fp32 (and 64 mask bytes) keep every window start aligned
    gen = torch.Generator().manual_seed(3)
    before = _jaxfns.compiled_programs()
    for T in torch.randint(1, 201, (25,), generator=gen).tolist():
        x = (torch.randn(T, V, generator=gen) * 3).requires_grad_()
        y = torch.randint(0, V, (T,), generator=gen)
        mask = torch.rand(T, V, generator=gen) < 0.3 if masked else None
        g1, g2 = torch.randn(T, generator=gen), torch.randn(T, generator=gen)
        lp, h = bridge.logprob_entropy(x, y, keep_mask=mask, temperature=0.7)
        (g,) = torch.autograd.grad([lp, h], x, [g1, g2])

        def jax_op(z):
            return jaxops.logprob_entropy(
                z, jnp.asarray(y.numpy()), temperature=0.7, implementation="xla",
                keep_mask=None if mask is None else jnp.asarray(mask.numpy()))

        (lp_j, h_j), vjp = jax.vjp(jax_op, jnp.asarray(x.detach().numpy()))
        (g_j,) = vjp((jnp.asarray(g1.numpy()), jnp.asarray(g2.numpy())))
        for got, want in ((lp, lp_j), (h, h_j), (g, g_j)):
            np.testing.assert_allclose(got.detach().numpy(), np.asarray(want),
                                       rtol=1e-6, atol=1e-6, err_msg=f"T = {T}")
    compiled = _jaxfns.compiled_programs() - before
    assert compiled <= 2 * 8, f"{compiled} programs for 25 calls with T in [1, 200]"


# ---------------------------------------------------------------------------
# targets: dtypes, the int64 decoding, out-of-range ids
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_target_dtypes(dtype):
    x, y, _ = _inputs()
    want = bridge.logprob_entropy(x, y)
    got = bridge.logprob_entropy(x, y.to(dtype))
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_strided_targets(dtype):
    """A strided view of the ids (e.g. every other position) works without the caller
    copying it (int64 ids were viewed as int32 words, which needs unit stride)."""
    x, y, _ = _inputs()
    both = torch.stack([y, torch.zeros_like(y)], dim=1).reshape(-1).to(dtype)
    want = bridge.logprob_entropy(x, y)
    got = bridge.logprob_entropy(x, both[::2])
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_int64_targets_outside_int32_give_nan_not_wrapped_ids():
    """Unchecked int64 ids are decoded inside jit: 2**32 + 3 must not read as 3."""
    x, y, _ = _inputs(T=6)
    y[1], y[2], y[3] = 2**32 + 3, -1, -(2**32) + 2
    lp, h = bridge.logprob_entropy(x, y, check_targets=False)
    assert torch.isnan(lp[1:4]).all(), lp
    assert torch.isfinite(lp[[0, 4, 5]]).all() and torch.isfinite(h).all()


def test_out_of_range_targets_give_nan_rows_by_default():
    """The default makes no host sync: bad ids are NaN in their rows, the rest exact."""
    x, y, _ = _inputs(T=5, V=11)
    good_lp, good_h = bridge.logprob_entropy(x, y)
    y[1], y[3] = 11, -2
    lp, h = bridge.logprob_entropy(x, y)
    assert torch.isnan(lp[[1, 3]]).all(), lp
    assert torch.equal(lp[[0, 2, 4]], good_lp[[0, 2, 4]]) and torch.equal(h, good_h)
    lp2, _ = bridge.calculate_log_probs_and_entropy(x, y, None)
    assert torch.isnan(lp2[[1, 3], 0]).all()


def test_out_of_range_targets_raise_naming_the_row_when_asked(no_kernels):
    x, y, _ = _inputs(T=5, V=11)
    y[3] = 11
    with pytest.raises(ValueError, match=r"\[0, 11\).*3: 11"):
        bridge.logprob_entropy(x, y, check_targets=True)
    with pytest.raises(ValueError, match=r"\[0, 11\).*3: 11"):
        bridge.check_targets(y, 11)
    y[3] = -2
    with pytest.raises(ValueError, match=r"3: -2"):
        bridge.calculate_log_probs_and_entropy(x, y, None, check_targets=True)


def test_target_check_is_cached_but_sees_in_place_changes(monkeypatch):
    x, y, _ = _inputs(T=5, V=11)
    calls = []
    aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t: calls.append(1) or aminmax(t))
    bridge.logprob_entropy(x, y)
    assert not calls, "the default call read the targets back to the host"
    bridge.logprob_entropy(x, y, check_targets=True)
    bridge.logprob_entropy(x, y, check_targets=True)
    assert len(calls) == 1, "an unchanged, already checked targets tensor was re-read"
    bridge.logprob_entropy(x, y.clone(), check_targets=True)
    assert len(calls) == 2
    y[2] = 11  # in place: bumps the version counter
    with pytest.raises(ValueError, match="2: 11"):
        bridge.logprob_entropy(x, y, check_targets=True)


# ---------------------------------------------------------------------------
# bad calls: a clear TypeError / ValueError before any kernel runs
# ---------------------------------------------------------------------------

def _bad_calls():
    x, y, mask = _inputs(T=4, V=12, masked=True)
    x = x.detach()
    big = torch.randn(5, 12)  # 48-byte rows: big[1:] is not 64-byte aligned
    cases = [
        ("logits not a tensor", TypeError, "logits must be a torch.Tensor",
         dict(logits=x.numpy())),
        ("logits 3-D", ValueError, r"\[T, V_loc\]", dict(logits=x[None])),
        ("logits integer", TypeError, "float32, bfloat16 or float16",
         dict(logits=x.long())),
        ("logits float64", TypeError, "float32, bfloat16 or float16",
         dict(logits=x.double())),
        ("targets not a tensor", TypeError, "targets must be a torch.Tensor",
         dict(targets=[1, 2, 3, 4])),
        ("targets float", TypeError, "integer token ids", dict(targets=y.float())),
        ("targets bool", TypeError, "integer token ids", dict(targets=y > 3)),
        ("targets wrong length", ValueError, r"shape \[T\] = \[4\]", dict(targets=y[:3])),
        ("targets 2-D", ValueError, r"shape \[T\]", dict(targets=y[:, None])),
        ("targets on another device", ValueError, "same device",
         dict(targets=y.to("meta"))),
        ("mask not bool", TypeError, "keep_mask must be a bool",
         dict(keep_mask=mask.float())),
        ("mask wrong shape", ValueError, "keep_mask must have the logits' shape",
         dict(keep_mask=mask[:, :5])),
        ("mask on another device", ValueError, "keep_mask is on",
         dict(keep_mask=mask.to("meta"))),
        ("temperature 0", ValueError, "temperature", dict(temperature=0.0)),
        ("temperature negative", ValueError, "temperature", dict(temperature=-1)),
        ("temperature nan", ValueError, "temperature", dict(temperature=math.nan)),
        ("temperature inf", ValueError, "temperature", dict(temperature=math.inf)),
        ("temperature string", TypeError, "temperature", dict(temperature="1")),
        ("temperature tensor", TypeError, "temperature",
         dict(temperature=torch.tensor(1.0))),
        ("with_entropy not bool", TypeError, "with_entropy", dict(with_entropy=1)),
        ("entropy_grad not bool", TypeError, "entropy_grad", dict(entropy_grad=None)),
        ("bad implementation", ValueError, "implementation", dict(implementation="cuda")),
        ("bad process_group", TypeError, "process_group", dict(process_group="tp")),
        ("logits transposed", ValueError, "contiguous.*does not copy",
         dict(logits=torch.randn(12, 4).t())),
        ("logits strided", ValueError, "contiguous.*does not copy",
         dict(logits=torch.randn(4, 24)[:, ::2])),
        ("mask strided", ValueError, "keep_mask must be contiguous",
         dict(keep_mask=torch.ones(4, 24, dtype=torch.bool)[:, ::2])),
        ("logits misaligned", ValueError, "aligned.*does not copy",
         dict(logits=big[1:])),
        ("out-of-range target", ValueError, r"\[0, 12\)",
         dict(targets=torch.tensor([0, 1, 12, 3]), check_targets=True)),
    ]
    return [pytest.param(expected, pattern, dict(dict(logits=x, targets=y), **kw), id=name)
            for name, expected, pattern, kw in cases]


@pytest.mark.parametrize("expected, pattern, kwargs", _bad_calls())
def test_bad_calls(expected, pattern, kwargs, no_kernels):
    logits, targets = kwargs.pop("logits"), kwargs.pop("targets")
    with pytest.raises(expected, match=pattern):
        out = bridge.logprob_entropy(logits, targets, **kwargs)
        torch.autograd.grad(out[0].sum(), logits)  # (never reached)


def test_bad_calls_through_slime(no_kernels):
    x, y, _ = _inputs()
    with pytest.raises(TypeError, match="integer token ids"):
        bridge.calculate_log_probs_and_entropy(x, y.float(), None)
    with pytest.raises(ValueError, match="keep_mask must have"):
        bridge.calculate_log_probs_and_entropy(x, y, None, log_prob_keep_mask=torch.ones(
            2, 2, dtype=torch.bool))


# ---------------------------------------------------------------------------
# zero copy, saved tensors, routes
# ---------------------------------------------------------------------------

def test_zero_copy_both_ways(monkeypatch):
    """The logits JAX reads and the gradient torch returns are the same memory."""
    x, y, mask = _inputs(T=8, V=16, masked=True)
    seen = []
    to_jax, to_torch = _dlpack.Transfer.to_jax, _dlpack.Transfer.to_torch

    def spy_to_jax(self, t):
        a = to_jax(self, t)
        seen.append(("in", t.data_ptr(), a.unsafe_buffer_pointer(), tuple(t.shape)))
        return a

    def spy_to_torch(self, a):
        t = to_torch(self, a)
        seen.append(("out", a.unsafe_buffer_pointer(), t.data_ptr(), tuple(t.shape)))
        return t

    monkeypatch.setattr(_dlpack.Transfer, "to_jax", spy_to_jax)
    monkeypatch.setattr(_dlpack.Transfer, "to_torch", spy_to_torch)
    lp, h = bridge.logprob_entropy(x, y, keep_mask=mask)
    (g,) = torch.autograd.grad(lp.sum() + h.sum(), x)
    assert _dlpack.device(CPU).fast, "the DLPack fast path should be available"
    for kind, src, dst, shape in seen:
        assert src == dst, f"{kind} {shape}: a copy was made"
    imported = {(p, s) for k, p, _, s in seen if k == "in"}
    assert (x.data_ptr(), (8, 16)) in imported and (mask.data_ptr(), (8, 16)) in imported
    exported = [p for k, _, p, s in seen if k == "out" and s == (8, 16)]
    assert exported == [g.data_ptr()], "the gradient is not the JAX buffer"


def test_only_small_tensors_are_saved():
    """Between forward and backward: the inputs (no copies) and O(R K T) statistics."""
    x, y, mask = _inputs(T=8, V=16, masked=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, h = bridge.logprob_entropy(x, y, keep_mask=mask)
    inputs = {x.data_ptr(), y.data_ptr(), mask.data_ptr()}
    for t in saved:
        assert t.data_ptr() in inputs or t.numel() <= 8 * 8, tuple(t.shape)


def test_custom_op_route_matches_eager_route(monkeypatch):
    x, y, mask = _inputs(masked=True)

    def run():
        lp, h = bridge.logprob_entropy(x, y, keep_mask=mask, temperature=1.1)
        (g,) = torch.autograd.grad((lp * 2).sum() + h.sum(), x)
        return lp, h, g

    eager = run()
    monkeypatch.setattr(op, "USE_CUSTOM_OP_IN_EAGER", True)
    via_op = run()
    for a, b in zip(eager, via_op):
        assert torch.equal(a, b)


@pytest.mark.parametrize("use_custom_op", [False, True], ids=["eager", "custom_op"])
def test_no_double_backward(use_custom_op, monkeypatch):
    """The gradient is exact but not itself differentiable: with create_graph=True a
    second backward through it raises instead of returning a silent zero."""
    monkeypatch.setattr(op, "USE_CUSTOM_OP_IN_EAGER", use_custom_op)
    x, y, _ = _inputs()
    lp, h = bridge.logprob_entropy(x, y)
    (g,) = torch.autograd.grad(lp.sum() + h.sum(), x)
    assert not g.requires_grad
    lp, h = bridge.logprob_entropy(x, y)
    (g2,) = torch.autograd.grad(lp.sum() + h.sum(), x, create_graph=True)
    assert torch.equal(g, g2)
    # Beside a differentiable term, a constant g2 would drop its part without a word.
    with pytest.raises(RuntimeError, match="no second derivative|no autograd formula"):
        torch.autograd.grad(g2.square().sum() + x.sum(), x)


def test_no_grad_and_detached_inputs():
    x, y, _ = _inputs()
    with torch.no_grad():
        lp, h = bridge.logprob_entropy(x, y)
    assert not lp.requires_grad and not h.requires_grad
    lp2, _ = bridge.logprob_entropy(x.detach(), y)
    assert torch.equal(lp, lp2)


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    x, y, mask = _inputs(T=6, V=10, masked=True)
    g = torch.randn(6)

    def loss(x, y, mask, g, with_entropy):
        lp, h = bridge.logprob_entropy(x, y, keep_mask=mask, temperature=0.9,
                                       with_entropy=with_entropy)
        out = (lp * g).sum()
        return (out + h.sum() if with_entropy else out), lp, h

    compiled = torch.compile(loss, fullgraph=True)
    for with_entropy in (True, False):
        c, c_lp, c_h = compiled(x, y, mask, g, with_entropy)
        (cg,) = torch.autograd.grad(c, x)
        e, e_lp, e_h = loss(x, y, mask, g, with_entropy)
        (eg,) = torch.autograd.grad(e, x)
        torch.testing.assert_close(c_lp, e_lp, rtol=0, atol=1e-6)
        assert (c_h is None) == (e_h is None) == (not with_entropy)
        if with_entropy:
            torch.testing.assert_close(c_h, e_h, rtol=0, atol=1e-6)
        torch.testing.assert_close(cg, eg, rtol=0, atol=1e-6)
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)  # inductor's own sum order


def test_slime_drop_in_under_torch_compile(pg):
    torch._dynamo.reset()
    x, y, mask = _inputs(T=6, V=10, masked=True)
    fn = torch.compile(bridge.calculate_log_probs_and_entropy, fullgraph=True)
    lp, h = fn(x, y, pg, True, -1, mask, False)
    lp_e, h_e = bridge.calculate_log_probs_and_entropy(x, y, pg, True, -1, mask, False)
    assert lp.shape == (6, 1) and not h.requires_grad
    torch.testing.assert_close(lp, lp_e, rtol=0, atol=1e-6)
    torch.testing.assert_close(h, h_e, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype, masked, with_entropy, entropy_grad", [
    (torch.float32, False, True, True),
    (torch.bfloat16, True, True, False),
    (torch.float16, True, False, False),
])
def test_opcheck(dtype, masked, with_entropy, entropy_grad):
    x, y, mask = _inputs(T=5, V=9, dtype=dtype, masked=masked)
    args = (x, y, mask, 1 / 0.8, with_entropy, entropy_grad, "", "", 0, 1)
    torch.library.opcheck(op.logprob_entropy_fwd, args)
    lp, h, stats = op.logprob_entropy_fwd(*args)
    bwd_args = (x.detach(), y, mask, stats, torch.randn(5),
                torch.randn(5) if with_entropy else None, 1 / 0.8, with_entropy,
                entropy_grad, "", 0)
    # The backward op has no autograd formula (no double backward), so the AOT test,
    # which differentiates every float input, does not apply to it.
    torch.library.opcheck(op.logprob_entropy_bwd, bwd_args,
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))


# ---------------------------------------------------------------------------
# memory policy (fresh interpreters: it is about what happens before JAX starts)
# ---------------------------------------------------------------------------

def test_memory_policy_in_a_fresh_interpreter():
    """Importing the bridge first turns JAX's GPU preallocation off."""
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
    code = ("import os, bridge, jax; jax.devices(); "
            "print(os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'), '|', "
            "bridge._dlpack.memory_policy_note())")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.strip().splitlines()[-1]
    assert out.startswith("false |") and "before JAX started" in out, out


@pytest.mark.parametrize("started, preset, env_after, note", [
    (False, None, "false", "set XLA_PYTHON_CLIENT_PREALLOCATE=false"),
    (False, "true", "true", "as the user set it"),
    (True, None, None, "already started"),
])
def test_memory_policy_branches(monkeypatch, started, preset, env_after, note):
    from jax._src import xla_bridge

    monkeypatch.setattr(_dlpack, "_policy_note", _dlpack._policy_note)  # restored after
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: started)
    if preset is None:
        monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    else:
        monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", preset)
    assert note in _dlpack.apply_memory_policy()
    assert os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") == env_after
