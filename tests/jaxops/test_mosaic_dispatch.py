"""Which kernels "pallas" and "pallas_mosaic" mean (`jaxops.backends.registry`): the
implementation names, the backend chosen per call from V_loc, dtype, mask and GPU
(never from T), the in-place gradient where JAX lowers input stores, and GPUs before
Hopper refused with the implementation to use instead."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxops
from jaxops.backends import registry, xla
from jaxops.backends.mosaic.config import MosaicConfig
from jaxops.backends.triton.config import PallasConfig
from jaxops.contract import BackwardCoefs

from _mosaic_cases import mosaic_kernels  # skips this module without Mosaic GPU

# Mosaic GPU's own modules: imported once the line above has not skipped
from jaxops.backends.mosaic import backward as mosaic_backward


def test_implementation_names():
    assert "pallas_mosaic" in jaxops.IMPLEMENTATIONS and "pallas_triton" in jaxops.IMPLEMENTATIONS
    name, config = registry.resolve("pallas_mosaic", platform="cpu")
    assert name == "pallas_mosaic" and config == MosaicConfig(interpret=True)
    name, config = registry.resolve("pallas_mosaic", platform="gpu",
                                           pallas_config=PallasConfig())
    assert config == MosaicConfig()
    assert registry.kernels("pallas_mosaic").module is mosaic_kernels
    assert registry.kernels("pallas").module.__name__ == "jaxops.backends.triton.kernels"
    assert registry.kernels("pallas_triton").module.__name__ == "jaxops.backends.triton.kernels"
    _, config = registry.resolve("pallas", platform="cpu")
    assert isinstance(config, PallasConfig) and config.interpret


@pytest.mark.parametrize("num_vocab, itemsize, mask_dtype, capability, usable, want", [
    (151936, 2, None, (9, 0), True, "pallas_mosaic"),
    (151936, 4, np.uint8, (9, 0), True, "pallas_mosaic"),
    (151936, 2, np.int8, (10, 0), True, "pallas_mosaic"),
    (75968, 2, None, (9, 0), True, "pallas_mosaic"),
    (65536 - 16, 2, None, (9, 0), True, "pallas_mosaic"),
    (18992, 2, None, (9, 0), True, "pallas_mosaic"),  # V_loc of TP = 8
    (1024, 4, np.bool_, (9, 0), True, "pallas_mosaic"),
    (151936, 2, np.bool_, (9, 0), True, "pallas_mosaic"),  # bool: read in place (test_mask_view)
    (151936, 2, None, (8, 0), True, "pallas_triton"),  # Ampere: no Mosaic GPU
    (151936, 2, None, None, True, "pallas_triton"),  # no GPU found
    (151936, 2, None, (9, 0), False, "pallas_triton"),  # a JAX without the pieces
    (151936 + 8, 2, None, (9, 0), True, "pallas_triton"),  # bf16 V_loc % 16: no TMA tile
    (151936 + 8, 4, None, (9, 0), True, "pallas_mosaic"),
    (151936 + 8, 4, np.uint8, (9, 0), True, "pallas_triton"),  # mask row stride % 16
])
def test_which_backend_pallas_means(num_vocab, itemsize, mask_dtype, capability, usable, want):
    assert registry.pallas_backend(num_vocab, itemsize, mask_dtype, capability,
                                          usable) == want


def test_the_fused_heads_narrow_chunks_keep_triton():
    minimum = registry.FUSED_CHUNK_MOSAIC_MIN_VOCAB
    assert registry.pallas_backend(minimum - 8, 4, None, (9, 0), True,
                                          min_mosaic_vocab=minimum) == "pallas_triton"
    assert registry.pallas_backend(minimum, 4, None, (9, 0), True,
                                          min_mosaic_vocab=minimum) == "pallas_mosaic"


def test_the_in_place_gradient_is_offered_where_jax_lowers_input_stores():
    """`backward_logits(into=)` stores into an input, which jax 0.12 refuses to lower:
    `can_write_into` says no there, so callers (the bridge) take JAX's gradient."""
    version = tuple(int(p) for p in jax.__version__.split(".")[:2])
    assert mosaic_kernels.STORES_INTO_INPUTS == (version < (0, 12))
    logits = jax.ShapeDtypeStruct((8, 1024), jnp.bfloat16)
    for enabled in (False, True):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(mosaic_backward, "IN_PLACE_GRADIENT", enabled)
            assert mosaic_kernels.can_write_into(logits, None, MosaicConfig()) == (
                enabled and version < (0, 12))
            assert not mosaic_kernels.can_write_into(logits, None,
                                                    MosaicConfig(interpret=True))


def test_which_backend_pallas_means_is_not_a_function_of_t():
    """The default's pick cannot depend on the batch (batch invariance): the policy
    takes no T."""
    import inspect

    for fn in (registry.pallas_backend, registry.for_call):
        assert not {"num_tokens", "T"} & set(inspect.signature(fn).parameters)


def test_pallas_is_made_concrete_per_call(monkeypatch):
    """`for_call` on a (faked) Hopper GPU: "pallas" becomes the backend for the call's
    shapes; a config picks its own backend; interpret mode (off-GPU) stays Triton; the
    other names pass through."""
    class Hopper:
        device_kind, compute_capability = "NVIDIA H200", "9.0"

    cached = registry._first_gpu_capability
    gpu_triton = PallasConfig()
    shape = dict(num_vocab=151936, itemsize=2, platform="gpu")
    try:
        cached.cache_clear()
        monkeypatch.setattr(jax, "devices", lambda *a: [Hopper()])
        for_call = registry.for_call
        assert for_call("pallas", gpu_triton, None, mask_dtype=None, **shape) == (
            "pallas_mosaic", MosaicConfig())
        assert for_call("pallas", gpu_triton, None, mask_dtype=jnp.bool_, **shape) == (
            "pallas_mosaic", MosaicConfig())
        assert for_call("pallas", gpu_triton, None, mask_dtype=jnp.float32, **shape) == (
            "pallas_triton", gpu_triton)
        assert for_call("pallas", gpu_triton, None, mask_dtype=None, **{
            **shape, "num_vocab": 18992}) == ("pallas_mosaic", MosaicConfig())
        assert for_call("pallas", gpu_triton, None, mask_dtype=None, **{
            **shape, "num_vocab": 18992 + 8}) == ("pallas_triton", gpu_triton)
        tuned = PallasConfig(block_v=1024)
        assert for_call("pallas", tuned, tuned, mask_dtype=None, **shape) == (
            "pallas_triton", tuned)
        mosaic = MosaicConfig(chunk_v=1024)
        assert for_call("pallas", gpu_triton, mosaic, mask_dtype=jnp.bool_, **shape) == (
            "pallas_mosaic", mosaic)
        interpreted = PallasConfig(interpret=True)
        assert for_call("pallas", interpreted, None, mask_dtype=None, **shape)[0] == (
            "pallas_triton")
        for name in ("xla", "pallas_triton", "pallas_mosaic"):
            assert for_call(name, None, None, mask_dtype=None, **shape) == (name, None)
    finally:
        cached.cache_clear()

def test_mosaic_refuses_gpus_before_hopper(monkeypatch):
    """On an Ampere GPU the Mosaic compiler would fail deep in lowering: the resolver
    says which implementation to use instead."""
    class Ampere:
        device_kind, compute_capability = "NVIDIA A100-SXM4-80GB", "8.0"

    class Hopper:
        device_kind, compute_capability = "NVIDIA H200", "9.0"

    cached = registry._first_gpu_capability  # the devices are looked up once
    try:
        cached.cache_clear()
        monkeypatch.setattr(jax, "devices", lambda *a: [Ampere()])
        with pytest.raises(ValueError, match="capability >= 9.0.*has 8.0.*pallas_triton"):
            registry.resolve("pallas_mosaic", "gpu")
        assert registry.resolve("pallas_triton", "gpu")[0] == "pallas_triton"
        cached.cache_clear()
        monkeypatch.setattr(jax, "devices", lambda *a: [Hopper()])
        assert registry.resolve("pallas_mosaic", "gpu")[0] == "pallas_mosaic"
    finally:
        cached.cache_clear()


@pytest.mark.parametrize("num_vocab, dtype, masked", [
    (1000, jnp.bfloat16, True), (1000, jnp.bfloat16, False), (1004, jnp.float32, False)])
def test_compiled_kernels_name_the_vocabularies_they_do_not_take(num_vocab, dtype, masked):
    """Called directly (not through the registry, which sends such calls to XLA), the
    compiled kernels refuse a V_loc TMA cannot tile with a ValueError that says so,
    before any lowering; interpret mode takes it."""
    logits = jnp.zeros((8, num_vocab), dtype)
    targets = jnp.zeros((8,), jnp.int32)
    mask = jnp.ones((8, num_vocab), jnp.uint8) if masked else None
    with pytest.raises(ValueError, match=f"V_loc = {num_vocab}.*registry"):
        mosaic_kernels.forward_stats(logits, targets, mask, inv_tau=1.0, with_entropy=True)
    stats = xla.forward_stats(logits, targets, None if mask is None else mask > 0,
                              inv_tau=1.0, with_entropy=True)
    ones = jnp.ones((8,), jnp.float32)
    with pytest.raises(ValueError, match=f"V_loc = {num_vocab}.*registry"):
        mosaic_kernels.backward_logits(
            logits, targets, mask, stats.max_logit, stats.masked_max,
            BackwardCoefs(ones, ones, ones, ones if masked else None), inv_tau=1.0)
    interpret = MosaicConfig(interpret=True)
    got = mosaic_kernels.forward_stats(logits, targets, mask, inv_tau=1.0,
                                       with_entropy=True, config=interpret)
    np.testing.assert_allclose(got.sum_exp, stats.sum_exp, rtol=1e-6)
