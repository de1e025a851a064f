"""The direct route's plumbing on CPU (`bridge/_direct.py`): every launch hands over as
many buffers as its kernel declares, with the shapes and dtypes the kernel is traced
for, in every configuration (mask, entropy, flags, several row windows, the target
gathered by torch or found in the kernel). The launches themselves need a Hopper GPU
(tests/test_bridge_direct.py); here a fake launcher traces each kernel instead."""

from __future__ import annotations

import contextlib

import jax
import pytest
import torch

from bridge import _direct, _run

pytest.importorskip("jaxops.mosaic_direct")


@pytest.fixture
def launches(monkeypatch):
    seen = []

    def fake_launcher(kernel, structs, device):
        out_info = jax.jit(kernel).trace(*structs).out_info  # raises on a wrong operand
        num_outputs = len(out_info) if isinstance(out_info, (list, tuple)) else 1

        def launch(pointers):
            assert len(pointers) == len(structs) + num_outputs, (len(pointers), structs)
            assert all(isinstance(p, int) and p for p in pointers)
            seen.append(len(structs))
        return launch

    monkeypatch.setattr(_direct, "_launcher", fake_launcher)
    monkeypatch.setattr(_direct, "_OnDefaultStream", lambda index: contextlib.nullcontext())
    return seen


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("with_entropy, entropy_grad", [(True, True), (True, False),
                                                        (False, False)])
@pytest.mark.parametrize("num_tokens, gather_from", [(16, 2**62), (3001, 0), (3001, 2**21)])
def test_every_launch_matches_its_kernel(masked, with_entropy, entropy_grad, num_tokens,
                                         gather_from, launches, monkeypatch):
    monkeypatch.setattr(_direct, "GATHER_TARGET_FROM", gather_from)  # 2**21: mixed windows
    V = 1024
    x = torch.randn(num_tokens, V)
    y = torch.randint(0, V, (num_tokens,))
    mask = torch.rand(num_tokens, V) < 0.2 if masked else None
    plan = _run.Plan(x, y, mask, "pallas_mosaic")
    outputs, state = _direct.forward(plan, 1.0, with_entropy)
    assert len(launches) == 2 * len(plan.windows)
    assert tuple(outputs[0].shape) == (num_tokens,)
    for d_lp, d_h in [(torch.randn(num_tokens), torch.randn(num_tokens)),
                      (None, torch.randn(num_tokens)), (torch.randn(num_tokens), None)]:
        if d_h is not None and not (with_entropy and entropy_grad):
            d_h = None
        if d_lp is None and d_h is None:
            continue
        grad = _direct.backward(state, d_lp, d_h, entropy_grad)
        assert grad.shape == x.shape and grad.dtype == x.dtype
