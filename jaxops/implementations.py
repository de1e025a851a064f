"""The implementations of the op, by name, and the one policy for choosing and configuring one.

  "pallas"     Pallas kernels: the Mosaic GPU ones on Hopper and newer wherever their
               TMA tiles take V_loc, else the Triton ones (`for_call`, `pallas_backend`:
               never a function of T); off-GPU (interpret mode) the Triton kernels.
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

from jaxops.pallas_config import MosaicConfig, PallasConfig, mosaic_supported

IMPLEMENTATIONS = ("pallas", "pallas_triton", "pallas_mosaic", "xla", "reference")
# The implementations that compute per-shard statistics: name -> module providing
# `forward_stats` and `backward_logits` (see `contract.py`).
_KERNEL_MODULES = {"pallas": "jaxops.pallas_gpu", "pallas_triton": "jaxops.pallas_gpu",
                   "pallas_mosaic": "jaxops.pallas_mosaic", "xla": "jaxops.xla"}
_PALLAS = ("pallas", "pallas_triton", "pallas_mosaic")
_GPU_PLATFORMS = ("gpu", "cuda")

# The fused head's chunk scan reads fp32 logits chunks `[T, chunk]`; for chunks narrower
# than this "pallas" keeps the Triton kernels there (docs/performance.md, "Which backend
# 'pallas' means": on the H200, at V_loc = 18,992 the Triton kernels were faster in 7 of
# 8 timings, at 75,968 and wider Mosaic in all 8). The op itself runs Mosaic at every
# V_loc on Hopper: one kernel family, the same kernels on every entry point and route.
FUSED_CHUNK_MOSAIC_MIN_VOCAB = 65536


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
            f"'pallas_triton' there (or 'pallas', which picks it on such GPUs).")


@functools.cache
def _mosaic_usable() -> bool:
    """This JAX has the Mosaic GPU Pallas pieces the kernels use (checked: 0.10.2, 0.11.2)."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except Exception:  # noqa: BLE001 -- a JAX without (a working) Mosaic GPU
        return False
    return all(hasattr(plgpu, name) for name in (
        "kernel", "emit_pipeline", "layout_cast", "Layout", "SwizzleTransform",
        "TilingTransform", "copy_gmem_to_smem", "CompilerParams"))


def mosaic_available() -> bool:
    """Whether this process's first GPU and this JAX run the Mosaic GPU kernels
    (compute capability 9.0+, `_mosaic_usable`)."""
    found = _first_gpu_capability()
    return found is not None and found[1] >= (9, 0) and _mosaic_usable()


def pallas_backend(num_vocab: int, itemsize: int, mask_dtype, capability,
                   mosaic_usable: bool = True, min_mosaic_vocab: int = 0) -> str:
    """The Pallas backend "pallas" means for one call on a GPU: "pallas_mosaic" or
    "pallas_triton".

    `num_vocab`: V_loc; `itemsize`: the logits' bytes per element; `mask_dtype`: None,
    or the dtype of the keep mask; `capability`: the GPU's compute capability (major,
    minor), None if unknown. Mosaic wherever it runs: sm_90+, a JAX with its pieces, a
    V_loc its TMA tiles take (`mosaic_supported`: a function of V_loc and dtype) and a
    mask, if any, of one byte per element (bool, read in place through `_mask_view`, or
    uint8/int8); at least `min_mosaic_vocab` columns (the fused head's chunks).

    Never a function of T: the choice is the same for every batch a row can be in, so
    the default is bitwise batch invariant (each backend is on its own). T > 8 not a
    multiple of 8 moves untiled Mosaic tiles (`mosaic_rows_tile`, slower in bf16:
    docs/performance.md)."""
    import numpy as np

    from jaxops import _mask_view  # here: `import jaxops` stays without jax.extend

    if capability is None or tuple(capability) < (9, 0) or not mosaic_usable:
        return "pallas_triton"
    in_place = (np.uint8, np.int8) + ((np.bool_,) if _mask_view.ENABLED else ())
    if mask_dtype is not None and np.dtype(mask_dtype) not in in_place:
        return "pallas_triton"
    if not mosaic_supported(num_vocab, itemsize, mask_dtype is not None):
        return "pallas_triton"
    return "pallas_mosaic" if num_vocab >= min_mosaic_vocab else "pallas_triton"


def for_call(name: str, config, pallas_config=None, *, num_vocab: int, itemsize: int,
             mask_dtype, platform: str | None = None, min_mosaic_vocab: int = 0):
    """(name, config) from `resolve`, made concrete for one call: "pallas" becomes
    "pallas_mosaic" or "pallas_triton" (`pallas_backend` on this process's first GPU);
    the other names pass through. `num_vocab`, `itemsize`, `mask_dtype`,
    `min_mosaic_vocab`: as for `pallas_backend`. `pallas_config` is what the caller passed to
    `resolve`: a `MosaicConfig` picks Mosaic, non-default `PallasConfig` parameters
    pick Triton (they tune its kernels). Off-GPU (interpret mode) "pallas" stays the
    Triton kernels."""
    if name != "pallas":
        return name, config
    if isinstance(pallas_config, MosaicConfig):
        backend = "pallas_mosaic"
    elif config.interpret or (isinstance(pallas_config, PallasConfig) and pallas_config
                              != PallasConfig(interpret=pallas_config.interpret)):
        backend = "pallas_triton"
    else:
        found = _first_gpu_capability()
        backend = pallas_backend(num_vocab, itemsize, mask_dtype,
                                 None if found is None else found[1], _mosaic_usable(),
                                 min_mosaic_vocab)
    if backend == "pallas_triton":
        return backend, config
    return resolve(backend, platform, pallas_config)


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
