"""The implementations of the op, by name.

  "pallas"     Pallas kernels (`pallas_gpu.py`): compiled for the GPU, run in interpret
               mode elsewhere (slow; for tests).
  "xla"        the same statistics in fused `jnp` (`xla.py`): the CPU path.
  "reference"  the executable definition (`reference.py`), unsharded; no statistics.

The statistics modules are imported on first use (`kernels`), so that `import jaxops`
does not load Pallas's Triton lowering.
"""

from __future__ import annotations

import importlib
from types import ModuleType

IMPLEMENTATIONS = ("pallas", "xla", "reference")
# The implementations that compute per-shard statistics: name -> module providing
# `forward_stats` and `backward_logits` (see `contract.py`).
_KERNEL_MODULES = {"pallas": "jaxops.pallas_gpu", "xla": "jaxops.xla"}
_GPU_PLATFORMS = ("gpu", "cuda")


def _platform(platform: str | None) -> str:
    if platform is None:
        import jax

        return jax.default_backend()
    return platform


def default(platform: str | None = None) -> str:
    """"pallas" on a GPU, else "xla". `platform`: "gpu"/"cuda" or another JAX platform
    name ("cpu", ...); None: JAX's default backend."""
    return "pallas" if _platform(platform) in _GPU_PLATFORMS else "xla"


def kernels(implementation: str) -> ModuleType:
    """The module computing `implementation`'s shard statistics (imported on first use)."""
    try:
        module = _KERNEL_MODULES[implementation]
    except KeyError:
        raise ValueError(
            f"implementation {implementation!r} has no shard statistics; one of "
            f"{tuple(_KERNEL_MODULES)}") from None
    return importlib.import_module(module)
