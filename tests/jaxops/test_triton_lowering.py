"""The Triton kernels lowered for CUDA on the CPU, and their IR put through MLIR's verifier.

Interpret mode runs a kernel's jaxpr, not its Triton IR, so it accepts kernels that the
GPU then refuses: once a `jnp.where(.., 0.0, 1.0)` in the forward lowered, with
jax_enable_x64 off, to an `arith.select` of i1 constants into an f32 (the GPU plugin:
"Failed to parse Triton module"), and `jnp.where(bit, 1, 0)` with x64 on tripped an
assertion of the lowering itself. Both show up here, without a GPU: the GPU plugin's
parse step is this verifier.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import pytest

from jaxops.backends.triton import kernels as triton_kernels
from jaxops.backends.triton.config import PallasConfig
from jaxops.contract import BackwardCoefs

lowering = pytest.importorskip("jax._src.pallas.triton.lowering")

S = jax.ShapeDtypeStruct
# The tuned defaults (which differ by dtype, mask and entropy) and explicit variants that
# take the kernels' other branches (`triton.config.PallasConfig`).
CONFIGS = {"tuned": PallasConfig(),
           "all_on": PallasConfig(prefetch=True, scalar_sums=True, skip_rescale=True),
           "all_off": PallasConfig(prefetch=False, scalar_sums=False, skip_rescale=False,
                                   approx_exp2=False)}


@pytest.fixture
def triton_modules(monkeypatch):
    """The Triton modules lowered while the test runs."""
    modules = []
    lower = lowering.lower_jaxpr_to_triton_module

    def spy(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module)
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", spy)
    _fake_hopper_gpu_info(monkeypatch)
    return modules


def _fake_hopper_gpu_info(monkeypatch):
    """jax 0.12's Triton lowering asks the default device for its GPU info (0.10 and
    0.11 do not) and refuses a CPU one: hand it an H100's compute capability."""
    try:
        from jax._src import gpu_info
        from jax._src.pallas.triton import pallas_call_registration as registration
    except ImportError:  # jax 0.10, 0.11: no such lookup
        return
    if getattr(registration, "gpu_info_lib", None) is not gpu_info:
        return
    hopper = gpu_info.GpuInfo(gpu_version=None, arch_name="9.0", compute_capability=90)
    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: hopper)


def _forward(config, masked, with_entropy):
    def fn(logits, targets, mask):
        stats = triton_kernels.forward_stats(logits, targets, mask if masked else None,
                                         inv_tau=1.4, with_entropy=with_entropy,
                                         config=config)
        return [s for s in stats if s is not None]
    return fn


def _backward(config, masked, entropy):
    def fn(logits, targets, mask):
        row = jnp.ones(targets.shape, jnp.float32)
        coefs = BackwardCoefs(row, row if entropy else None, row, row if masked else None)
        return triton_kernels.backward_logits(logits, targets, mask if masked else None, row,
                                          row if masked else None, coefs, inv_tau=1.4,
                                          config=config)
    return fn


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("x64", [True, False], ids=["x64", "x32"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_triton_kernels_lower_to_valid_ir(triton_modules, x64, dtype, config):
    """Forward (mask x entropy) and backward (mask x entropy), V = 1000 (full tiles and a
    partial one), both x64 modes, tuned and explicit launch variants: every lowered
    module verifies."""
    args = (S((16, 1000), dtype), S((16,), jnp.int32), S((16, 1000), jnp.bool_))
    with jax.enable_x64(x64):
        for make, (masked, flag) in itertools.product(
                (_forward, _backward), itertools.product((False, True), repeat=2)):
            # Any error fails: lowering needs no GPU (an assertion of the lowering is
            # one of the bugs this test is for).
            jax.jit(make(CONFIGS[config], masked, flag)).trace(*args).lower(
                lowering_platforms=("cuda",))
    assert len(triton_modules) == 8
    for module in triton_modules:
        module.operation.verify()  # raises MLIRError with the offending op
