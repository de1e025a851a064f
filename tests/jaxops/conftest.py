"""Fixtures of the tests of the JAX op (tests/jaxops/): `fused_calls`, for the linear head's
fused Mosaic GPU kernels (test_linear_head*.py)."""

from __future__ import annotations

import pytest

from _linear_cases import count_fused_calls
from _linear_head_cases import linear_vjp_jit


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the traced calls of the fused kernels: {"forward": [...], "backward": [...]}
    (`mosaic_linear.forward_stats`, `mosaic_linear.backward_logits`)."""
    calls = {"forward": count_fused_calls(monkeypatch),
             "backward": count_fused_calls(monkeypatch, "backward_logits")}
    linear_vjp_jit.clear_cache()
    yield calls
    linear_vjp_jit.clear_cache()
