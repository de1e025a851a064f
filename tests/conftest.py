"""Shared test setup.

- float64 is enabled for the whole session: the tests compare every implementation
  against `implementation="reference"` evaluated on the same input values upcast to
  float64 (docs/design.md §8).
- The bridge's persistent compilation cache is off (`JAXOPS_CACHE_DIR=off`) unless
  the environment sets it.
- `@pytest.mark.gpu` (or `pytest.param(..., marks=pytest.mark.gpu)`) marks a test that
  needs a CUDA GPU; it is skipped, with the reason shown, wherever JAX's default
  backend is not "gpu".
"""

from __future__ import annotations

import os

import jax
import pytest

# The bridge's persistent compilation cache stays off in test processes (each test
# compiles for itself, nothing is written to ~/.cache); tests/bridge/test_bridge_cache.py
# turns it on in the processes it starts.
os.environ.setdefault("JAXOPS_CACHE_DIR", "off")

jax.config.update("jax_enable_x64", True)

ON_GPU = jax.default_backend() == "gpu"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on CPU")


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip_gpu = pytest.mark.skip(
        reason=f"needs a CUDA GPU; jax.default_backend() is {jax.default_backend()!r}")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


@pytest.fixture
def backend_choices(monkeypatch):
    """The keyword arguments of every `jaxops.backends.registry.for_call` (the per-call
    backend choice) made during the test, in order."""
    from jaxops.backends import registry

    seen = []
    real = registry.for_call

    def spy(name, config, pallas_config=None, **kw):
        seen.append(kw)
        return real(name, config, pallas_config, **kw)

    monkeypatch.setattr(registry, "for_call", spy)
    return seen
