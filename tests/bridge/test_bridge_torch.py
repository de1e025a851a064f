"""The PyTorch bridge (bridge/) inside torch, on CPU: zero copy both ways, only small
tensors saved for the backward, the custom op's route equal to the eager one, no double
backward, no_grad, torch.compile (fullgraph, and the slime drop-in), opcheck, and the
memory policy applied before JAX starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import bridge
from bridge import _dlpack, op

from _bridge_scenarios import small_inputs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU = torch.device("cpu")


# ---------------------------------------------------------------------------
# zero copy, saved tensors, routes
# ---------------------------------------------------------------------------

def test_zero_copy_both_ways(monkeypatch):
    """The logits JAX reads and the gradient torch returns are the same memory."""
    x, y, mask = small_inputs(T=8, V=16, masked=True)
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
    x, y, mask = small_inputs(T=8, V=16, masked=True)
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
    x, y, mask = small_inputs(masked=True)

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
    x, y, _ = small_inputs()
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
    x, y, _ = small_inputs()
    with torch.no_grad():
        lp, h = bridge.logprob_entropy(x, y)
    assert not lp.requires_grad and not h.requires_grad
    lp2, _ = bridge.logprob_entropy(x.detach(), y)
    assert torch.equal(lp, lp2)


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    x, y, mask = small_inputs(T=6, V=10, masked=True)
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
    x, y, mask = small_inputs(T=6, V=10, masked=True)
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
    x, y, mask = small_inputs(T=5, V=9, dtype=dtype, masked=masked)
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
