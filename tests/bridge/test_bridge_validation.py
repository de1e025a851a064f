"""The PyTorch bridge's checks of its inputs (bridge/), on CPU: target dtypes and strides,
int64 ids decoded inside jit, out-of-range ids (NaN rows by default, an error naming the
row when asked, the check cached), and bad calls: a clear TypeError / ValueError before
any kernel runs."""

from __future__ import annotations

import math

import pytest
import torch

import bridge
from bridge import _jaxfns

from _bridge_scenarios import small_inputs


@pytest.fixture
def no_kernels(monkeypatch):
    """Fail the test if any JAX function of the bridge is reached."""
    def refuse(**_):
        raise AssertionError("a kernel was launched before the error")

    for name in ("local_forward", "combine", "local_backward"):
        monkeypatch.setattr(_jaxfns, name, refuse)


# ---------------------------------------------------------------------------
# targets: dtypes, the int64 decoding, out-of-range ids
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_target_dtypes(dtype):
    x, y, _ = small_inputs()
    want = bridge.logprob_entropy(x, y)
    got = bridge.logprob_entropy(x, y.to(dtype))
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_strided_targets(dtype):
    """A strided view of the ids (e.g. every other position) works without the caller
    copying it (int64 ids were viewed as int32 words, which needs unit stride)."""
    x, y, _ = small_inputs()
    both = torch.stack([y, torch.zeros_like(y)], dim=1).reshape(-1).to(dtype)
    want = bridge.logprob_entropy(x, y)
    got = bridge.logprob_entropy(x, both[::2])
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_int64_targets_outside_int32_give_nan_not_wrapped_ids():
    """Unchecked int64 ids are decoded inside jit: 2**32 + 3 must not read as 3."""
    x, y, _ = small_inputs(T=6)
    y[1], y[2], y[3] = 2**32 + 3, -1, -(2**32) + 2
    lp, h = bridge.logprob_entropy(x, y, check_targets=False)
    assert torch.isnan(lp[1:4]).all(), lp
    assert torch.isfinite(lp[[0, 4, 5]]).all() and torch.isfinite(h).all()


def test_out_of_range_targets_give_nan_rows_by_default():
    """The default makes no host sync: bad ids are NaN in their rows, the rest exact."""
    x, y, _ = small_inputs(T=5, V=11)
    good_lp, good_h = bridge.logprob_entropy(x, y)
    y[1], y[3] = 11, -2
    lp, h = bridge.logprob_entropy(x, y)
    assert torch.isnan(lp[[1, 3]]).all(), lp
    assert torch.equal(lp[[0, 2, 4]], good_lp[[0, 2, 4]]) and torch.equal(h, good_h)
    lp2, _ = bridge.calculate_log_probs_and_entropy(x, y, None)
    assert torch.isnan(lp2[[1, 3], 0]).all()


def test_out_of_range_targets_raise_naming_the_row_when_asked(no_kernels):
    x, y, _ = small_inputs(T=5, V=11)
    y[3] = 11
    with pytest.raises(ValueError, match=r"\[0, 11\).*3: 11"):
        bridge.logprob_entropy(x, y, check_targets=True)
    with pytest.raises(ValueError, match=r"\[0, 11\).*3: 11"):
        bridge.check_targets(y, 11)
    y[3] = -2
    with pytest.raises(ValueError, match=r"3: -2"):
        bridge.calculate_log_probs_and_entropy(x, y, None, check_targets=True)


def test_target_check_is_cached_but_sees_in_place_changes(monkeypatch):
    x, y, _ = small_inputs(T=5, V=11)
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
    x, y, mask = small_inputs(T=4, V=12, masked=True)
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
    x, y, _ = small_inputs()
    with pytest.raises(TypeError, match="integer token ids"):
        bridge.calculate_log_probs_and_entropy(x, y.float(), None)
    with pytest.raises(ValueError, match="keep_mask must have"):
        bridge.calculate_log_probs_and_entropy(x, y, None, log_prob_keep_mask=torch.ones(
            2, 2, dtype=torch.bool))
