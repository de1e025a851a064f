"""Bad calls of `bridge.linear_logprob_entropy`: a clear TypeError / ValueError before any
kernel runs; out-of-range targets give NaN rows by default."""

from __future__ import annotations

import math

import pytest
import torch

import bridge
from bridge import _linear_jaxfns

from _bridge_linear_cases import make


@pytest.fixture
def no_kernels(monkeypatch):
    def refuse(**_):
        raise AssertionError("a kernel was launched before the error")

    for name in ("local_forward", "local_backward", "zero_accumulator"):
        monkeypatch.setattr(_linear_jaxfns, name, refuse)


def _bad_calls():
    hidden, weight, y, mask, *_ = make(4, 6, 12, masked=True)
    big = torch.randn(5, 12)  # 48-byte rows: big[1:] is not 64-byte aligned
    cases = [
        ("hidden not a tensor", TypeError, "hidden must be a torch.Tensor",
         dict(hidden=hidden.numpy())),
        ("weight not a tensor", TypeError, "weight must be a torch.Tensor",
         dict(weight=[[1.0]])),
        ("hidden 3-D", ValueError, r"\[T, H\]", dict(hidden=hidden[None])),
        ("weight 1-D", ValueError, r"\[V_loc, H\]", dict(weight=weight[0])),
        ("H disagrees", ValueError, "H must agree", dict(weight=torch.randn(12, 5))),
        ("hidden integer", TypeError, "float32, bfloat16 or float16",
         dict(hidden=hidden.long(), weight=weight.long())),
        ("hidden float64", TypeError, "float32, bfloat16 or float16",
         dict(hidden=hidden.double(), weight=weight.double())),
        ("dtypes differ", TypeError, "same dtype", dict(weight=weight.bfloat16())),
        ("targets float", TypeError, "integer token ids", dict(targets=y.float())),
        ("targets wrong length", ValueError, r"shape \[T\] = \[4\]", dict(targets=y[:3])),
        ("targets on another device", ValueError, "targets is on",
         dict(targets=y.to("meta"))),
        ("weight on another device", ValueError, "weight is on",
         dict(weight=weight.to("meta"))),
        ("mask not bool", TypeError, "keep_mask must be a bool", dict(keep_mask=mask.int())),
        ("mask wrong shape", ValueError, r"\[T, V_loc\] = \[4, 12\]",
         dict(keep_mask=mask[:, :5])),
        ("temperature 0", ValueError, "temperature", dict(temperature=0.0)),
        ("temperature nan", ValueError, "temperature", dict(temperature=math.nan)),
        ("temperature tensor", TypeError, "temperature", dict(temperature=torch.tensor(1.0))),
        ("with_entropy not bool", TypeError, "with_entropy", dict(with_entropy=1)),
        ("entropy_grad not bool", TypeError, "entropy_grad", dict(entropy_grad=None)),
        ("reduce_hidden_grad not bool", TypeError, "reduce_hidden_grad",
         dict(reduce_hidden_grad="yes")),
        ("chunk_size 0", ValueError, "chunk_size", dict(chunk_size=0)),
        ("chunk_size float", ValueError, "chunk_size", dict(chunk_size=2.0)),
        ("chunk_size bool", ValueError, "chunk_size", dict(chunk_size=True)),
        ("bad implementation", ValueError, "implementation", dict(implementation="cuda")),
        ("bad process_group", TypeError, "process_group", dict(process_group="tp")),
        ("hidden transposed", ValueError, "hidden must be contiguous",
         dict(hidden=torch.randn(6, 4).t())),
        ("weight transposed", ValueError, "weight must be contiguous",
         dict(weight=torch.randn(6, 12).t())),
        ("weight misaligned", ValueError, "aligned.*does not copy",
         dict(weight=big[1:], hidden=torch.randn(4, 12), keep_mask=None)),
        ("out-of-range target", ValueError, r"\[0, 12\)",
         dict(targets=torch.tensor([0, 1, 12, 3]), check_targets=True)),
    ]
    return [pytest.param(expected, pattern,
                         dict(dict(hidden=hidden, weight=weight, targets=y), **kw), id=name)
            for name, expected, pattern, kw in cases]


@pytest.mark.parametrize("expected, pattern, kwargs", _bad_calls())
def test_bad_calls(expected, pattern, kwargs, no_kernels):
    hidden, weight, targets = (kwargs.pop(k) for k in ("hidden", "weight", "targets"))
    with pytest.raises(expected, match=pattern):
        bridge.linear_logprob_entropy(hidden, weight, targets, **kwargs)


def test_out_of_range_target_is_nan_by_default():
    hidden, weight, y, *_ = make(5, 8, 11, seed=10)
    good, _ = bridge.linear_logprob_entropy(hidden, weight, y)
    y[3] = 11
    lp, ent = bridge.linear_logprob_entropy(hidden, weight, y)
    assert torch.isnan(lp[3]) and torch.equal(lp[[0, 1, 2, 4]], good[[0, 1, 2, 4]])
    assert torch.isfinite(ent).all()
