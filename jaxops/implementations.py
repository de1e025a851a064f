"""The implementations of the op, by name, and the one policy for choosing and configuring one.

  "pallas"     Pallas kernels: for now the same as "pallas_triton" (which backend it
               means is decided after the H200 measurements of issue 14).
  "pallas_triton"  Pallas kernels lowered through Triton (`pallas_gpu.py`): compiled for
               the GPU, run in interpret mode elsewhere (slow; for tests).
  "pallas_mosaic"  Pallas kernels lowered through Mosaic GPU (`pallas_mosaic.py`, Hopper
               and newer), launch parameters `MosaicConfig`; interpret mode elsewhere.
  "xla"        the same statistics in fused `jnp` (`xla.py`): the CPU path.
  "reference"  the executable definition (`reference.py`), unsharded; no statistics.

The statistics modules are imported on first use (`kernels`), so that `import jaxops`
does not load a Pallas lowering (Triton or Mosaic GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from types import ModuleType

from jaxops.pallas_config import MosaicConfig, PallasConfig

IMPLEMENTATIONS = ("pallas", "pallas_triton", "pallas_mosaic", "xla", "reference")
# The implementations that compute per-shard statistics: name -> module providing
# `forward_stats` and `backward_logits` (see `contract.py`).
_KERNEL_MODULES = {"pallas": "jaxops.pallas_gpu", "pallas_triton": "jaxops.pallas_gpu",
                   "pallas_mosaic": "jaxops.pallas_mosaic", "xla": "jaxops.xla"}
_PALLAS = ("pallas", "pallas_triton", "pallas_mosaic")
_GPU_PLATFORMS = ("gpu", "cuda")


def is_pallas(implementation: str | None) -> bool:
    """Whether `implementation` names Pallas kernels (which take a config and may run in
    interpret mode)."""
    return implementation in _PALLAS


@functools.cache
def _first_gpu_capability() -> tuple[str, tuple[int, int]] | None:
    """(device kind, compute capability) of JAX's first device that reports one. Cached:
    `resolve` runs on every call of the op and of the bridge, and the devices of a
    process do not change."""
    import jax

    for device in jax.devices():
        capability = getattr(device, "compute_capability", None)
        if capability is not None:
            return device.device_kind, tuple(int(p) for p in str(capability).split(".")[:2])
    return None


def _check_mosaic_gpu() -> None:
    """Mosaic GPU compiles for Hopper (compute capability 9.0) and newer only; say so
    before its compiler fails on an older GPU."""
    found = _first_gpu_capability()
    if found is not None and found[1] < (9, 0):
        kind, capability = found
        raise ValueError(
            f"implementation 'pallas_mosaic' needs an NVIDIA GPU of compute capability "
            f">= 9.0 (Hopper or newer); {kind} has {'.'.join(map(str, capability))}. Use "
            f"'pallas_triton' (or 'pallas', its alias) there.")


def _platform(platform: str | None) -> str:
    if platform is None:
        import jax

        return jax.default_backend()
    return platform


def default(platform: str | None = None) -> str:
    """"pallas" on a GPU, else "xla". `platform`: "gpu"/"cuda" or another JAX platform
    name ("cpu", ...); None: JAX's default backend."""
    return "pallas" if _platform(platform) in _GPU_PLATFORMS else "xla"


def resolve(implementation: str | None, platform: str | None = None,
            pallas_config: PallasConfig | MosaicConfig | None = None,
            ) -> tuple[str, PallasConfig | MosaicConfig | None]:
    """(implementation name, its launch config) for a call on `platform`.

    `implementation`: None (the `default` for the platform) or one of IMPLEMENTATIONS;
    anything else raises ValueError. `platform` as for `default`. For "pallas" the
    config is `pallas_config` (or the defaults) with interpret mode switched on off-GPU,
    where the kernels cannot be compiled; the other implementations take no config
    (None). "pallas_mosaic" takes a `MosaicConfig`; given a `PallasConfig` (the
    Triton kernels' parameters) it keeps only its `interpret` flag.
    """
    if implementation not in (None, *IMPLEMENTATIONS):
        raise ValueError(
            f"implementation must be None or one of {IMPLEMENTATIONS}, got {implementation!r}")
    platform = _platform(platform)
    name = implementation or default(platform)
    if not is_pallas(name):
        return name, None
    if name == "pallas_mosaic":
        config = (pallas_config if isinstance(pallas_config, MosaicConfig)
                  else MosaicConfig(interpret=getattr(pallas_config, "interpret", False)))
        if platform in _GPU_PLATFORMS and not config.interpret:
            _check_mosaic_gpu()
    else:
        config = (pallas_config if isinstance(pallas_config, PallasConfig)
                  else PallasConfig(interpret=getattr(pallas_config, "interpret", False)))
    if platform not in _GPU_PLATFORMS and not config.interpret:
        config = dataclasses.replace(config, interpret=True)
    return name, config


def kernels(implementation: str) -> ModuleType:
    """The module computing `implementation`'s shard statistics (imported on first use)."""
    try:
        module = _KERNEL_MODULES[implementation]
    except KeyError:
        raise ValueError(
            f"implementation {implementation!r} has no shard statistics; one of "
            f"{tuple(_KERNEL_MODULES)}") from None
    return importlib.import_module(module)
