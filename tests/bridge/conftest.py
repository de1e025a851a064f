"""Fixtures of the PyTorch bridge's tests (tests/bridge/)."""

from __future__ import annotations

import pytest

from _bridge_spawn import one_rank_group


@pytest.fixture(scope="module")
def pg():
    """A gloo process group of one rank (Megatron needs a group even for TP = 1)."""
    with one_rank_group("gloo", timeout_s=60) as group:
        yield group
