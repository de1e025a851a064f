"""Shared pieces of the tests of `bridge.linear_logprob_entropy`
(tests/bridge/test_bridge_linear*.py): inputs, and one call checked against the float64
torch reference of tests/bridge/_bridge_linear_worker.py."""

from __future__ import annotations

import math

import torch

import bridge

import _bridge_linear_worker as W
import _bridge_scenarios as S
from _oracle import VALUE_RTOL, grad_rtol

CPU = torch.device("cpu")


def make(T, H, V, dtype=torch.float32, *, masked=False, seed=0, device=CPU, scale=1.0):
    """hidden [T, H], weight [V, H], targets, a bool keep mask (with `masked`: row 1 keeps
    nothing, row 2 all but its target) or None, and the cotangents g_lp, g_h, on `device`."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) * scale / math.sqrt(H) * 3).to(dtype)
    y = torch.randint(0, V, (T,), generator=gen)
    mask = (torch.rand(T, V, generator=gen) < 0.4) if masked else None
    if masked and T > 2:
        mask[1] = False  # only the target counts: log_prob = 0
        mask[2, y[2]] = False  # the target counts with its bit off
    g_lp, g_h = torch.randn(T, generator=gen), torch.randn(T, generator=gen)
    mv = lambda t: None if t is None else t.to(device)  # noqa: E731
    return tuple(mv(t) for t in (hidden, weight, y, mask, g_lp, g_h))


def check(hidden, weight, y, mask, g_lp, g_h, *, temperature=1.0, with_entropy=True,
          entropy_grad=True, chunk_size=None, implementation=None, grad_slack=1.0, **kw):
    """One call against the float64 reference: values, dtypes, d hidden and d weight
    (for the combined cotangent and, with an entropy gradient, the log-prob alone)."""
    dtype = hidden.dtype
    h_in = hidden.clone().requires_grad_()
    w_in = weight.clone().requires_grad_()
    lp, ent = bridge.linear_logprob_entropy(
        h_in, w_in, y, keep_mask=mask, temperature=temperature, with_entropy=with_entropy,
        entropy_grad=entropy_grad, chunk_size=chunk_size, implementation=implementation, **kw)
    hr = hidden.double().requires_grad_()
    wr = weight.double().requires_grad_()
    lp_r, ent_r = W.reference(hr, wr, y, mask, temperature)
    x_max = float((hidden.double() @ weight.double().T).abs().max()) / temperature
    atol = VALUE_RTOL * max(1.0, x_max)
    T = hidden.shape[0]
    assert lp.dtype == torch.float32 and lp.shape == (T,)
    assert float((lp.double() - lp_r).abs().max()) <= atol
    if with_entropy:
        assert ent.dtype == torch.float32 and ent.shape == (T,)
        assert float((ent.double() - ent_r).abs().max()) <= atol
        assert ent.requires_grad == entropy_grad
    else:
        assert ent is None
    tol = grad_rtol(dtype, x_max) * grad_slack
    cases = [([lp], [g_lp], [lp_r])]
    if with_entropy and entropy_grad:
        cases.append(([lp, ent], [g_lp, g_h], [lp_r, ent_r]))
    for outs, cots, refs in cases:
        dh, dw = torch.autograd.grad(outs, [h_in, w_in], cots, retain_graph=True)
        dh_r, dw_r = torch.autograd.grad(refs, [hr, wr], [c.double() for c in cots],
                                         retain_graph=True)
        assert dh.dtype == dtype and dw.dtype == dtype
        assert S.rel_err(dh, dh_r) <= tol, f"d hidden: {S.rel_err(dh, dh_r):.3g} > {tol:.3g}"
        assert S.rel_err(dw, dw_r) <= tol, f"d weight: {S.rel_err(dw, dw_r):.3g} > {tol:.3g}"
    if with_entropy and not entropy_grad:
        # using the forward-only entropy in a loss changes no gradient
        a = torch.autograd.grad((lp * g_lp).sum() + (ent * g_h).sum(), [h_in, w_in],
                                retain_graph=True)
        b = torch.autograd.grad((lp * g_lp).sum(), [h_in, w_in])
        assert all(torch.equal(u, v) for u, v in zip(a, b))
    return lp, ent
