"""`bridge.linear_logprob_entropy` with the fused Mosaic GPU kernels ("pallas_mosaic",
`jaxops/backends/mosaic/linear.py`, in Mosaic GPU's interpreter on CPU): the forward and
the backward's d logits where their shapes allow, with a keep mask, over two row
windows; against float64, every kernel trace counted."""

from __future__ import annotations

import pytest
import torch

from bridge import _linear_jaxfns

from _bridge_linear_cases import check, make
from _linear_cases import record_fused_traces


@pytest.fixture
def fused_traces(monkeypatch):
    """The fused kernels' traces, (kernel, hidden shape, weight shape) each
    (`_linear_cases.record_fused_traces`), with the bridge's caches of traced functions
    cleared before and after, so that they trace afresh with the recording kernels."""
    _linear_jaxfns.local_forward.cache_clear()
    _linear_jaxfns.local_backward.cache_clear()
    yield record_fused_traces(monkeypatch.setattr)
    _linear_jaxfns.local_forward.cache_clear()
    _linear_jaxfns.local_backward.cache_clear()


def test_fused_forward_in_interpret_mode(fused_traces):
    """"pallas_mosaic" runs each window's forward as the fused kernel and its backward's
    d logits with the recomputing one (`mosaic/linear.py`, Mosaic GPU's interpreter here)
    where their shapes allow, as the JAX op does: values and gradients against float64,
    and the kernels traced once per window size (and chunk)."""
    check(*make(16, 64, 200, torch.bfloat16, seed=3), temperature=0.8, chunk_size=64,
          implementation="pallas_mosaic")
    # one window of 16 rows; the backward: the 64-column chunks' scan body and the tail,
    # traced for each of `check`'s two cotangents (log-prob alone: no entropy term)
    assert sorted(fused_traces) == [("backward_logits", (16, 64), (8, 64))] * 2 + [
        ("backward_logits", (16, 64), (64, 64))] * 2 + [
        ("forward_stats", (16, 64), (200, 64))], fused_traces
    fused_traces.clear()  # a mask with V_loc % 16 != 0 keeps the chunked forward and backward
    check(*make(16, 64, 200, torch.bfloat16, masked=True, seed=4), chunk_size=64,
          implementation="pallas_mosaic")
    assert fused_traces == []
    # chunks that are not a multiple of 8 columns keep the chunked backward
    check(*make(16, 64, 80, torch.bfloat16, seed=5), chunk_size=20,
          implementation="pallas_mosaic")
    assert fused_traces == [("forward_stats", (16, 64), (80, 64))]


def test_fused_kernels_with_mask(fused_traces):
    """A bool torch mask goes to both fused kernels (`mosaic.linear.MASKED`, on by
    default)."""
    check(*make(16, 64, 80, torch.bfloat16, masked=True, seed=10), temperature=0.9,
          chunk_size=32, implementation="pallas_mosaic")
    # the backward's 32-column scan body and 16-column tail, for `check`'s two cotangents
    assert sorted(fused_traces) == sorted(
        [("forward_stats", (16, 64), (80, 64))]
        + [("backward_logits", (16, 64), (cols, 64)) for cols in (32, 16)] * 2)


@pytest.mark.parametrize("dtype,with_entropy,entropy_grad", [
    (torch.bfloat16, True, True), (torch.float16, True, False), (torch.float16, False, False)])
def test_fused_kernels_over_two_windows(dtype, with_entropy, entropy_grad, fused_traces):
    """T = 24: windows of 16 and 8 rows, each through both fused kernels, d weight summed
    over the windows (the accumulating path of `chunked_backward` with the fused d
    logits), for each entropy mode and fp16; against float64, every trace counted."""
    check(*make(24, 64, 80, dtype, seed=9), temperature=1.2, chunk_size=32,
          with_entropy=with_entropy, entropy_grad=entropy_grad,
          implementation="pallas_mosaic")
    # per window: the forward; the backward's 32-column scan body and 16-column tail,
    # for each of `check`'s cotangents (two with the entropy's gradient)
    backwards = 2 if with_entropy and entropy_grad else 1
    want = sorted([("forward_stats", (rows, 64), (80, 64)) for rows in (16, 8)]
                  + [("backward_logits", (rows, 64), (cols, 64))
                     for rows in (16, 8) for cols in (32, 16)] * backwards)
    assert sorted(fused_traces) == want, fused_traces
