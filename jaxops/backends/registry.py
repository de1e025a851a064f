"""The backends of the op, by name, and the one policy that chooses and configures one
for every entry point: the op (`resolve`, `for_call`), the fused head's kernels
(`use_fused_forward`, `use_fused_backward`), the bridge's routes (which ask `for_call`),
and the fallback of a call a backend's kernels cannot take (`kernels`, `fallback_reason`).

  "pallas"     Pallas kernels: the Mosaic GPU ones on Hopper and newer wherever their
               TMA tiles take V_loc, else the Triton ones (`for_call`, `pallas_backend`:
               never a function of T); off-GPU (interpret mode) the Triton kernels.
  "pallas_triton"  Pallas kernels lowered through Triton (`triton/`): compiled for the
               GPU, run in interpret mode elsewhere (slow; for tests).
  "pallas_mosaic"  Pallas kernels lowered through Mosaic GPU (`mosaic/`, Hopper and
               newer), launch parameters `MosaicConfig`; interpret mode elsewhere.
  "xla"        the same statistics in fused `jnp` (`xla.py`): the CPU path.
  "reference"  the executable definition (`jaxops/reference.py`), unsharded; no statistics.

The kernels modules are imported on first use (`kernels`), so that `import jaxops` does
not load a Pallas lowering (Triton or Mosaic GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import warnings
from types import ModuleType

from jaxops.backends.mosaic.config import MosaicConfig, mosaic_supported, supported_vocab
from jaxops.backends.triton.config import PallasConfig

# The backends' names, defined here only.
PALLAS = "pallas"  # the policy's pick of TRITON or MOSAIC (`for_call`)
TRITON = "pallas_triton"
MOSAIC = "pallas_mosaic"
XLA = "xla"
REFERENCE = "reference"
IMPLEMENTATIONS = (PALLAS, TRITON, MOSAIC, XLA, REFERENCE)
# The backends that compute per-shard statistics: name -> module providing
# `forward_stats` and `backward_logits` (see `contract.py`); "pallas" until `for_call`
# made it concrete means the Triton kernels (as in interpret mode off-GPU).
_KERNEL_MODULES = {PALLAS: "jaxops.backends.triton.kernels",
                   TRITON: "jaxops.backends.triton.kernels",
                   MOSAIC: "jaxops.backends.mosaic.kernels", XLA: "jaxops.backends.xla"}
STATISTICS_BACKENDS = (TRITON, MOSAIC, XLA)
_PALLAS = (PALLAS, TRITON, MOSAIC)
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


def check_mosaic_gpu() -> None:
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
    mask, if any, of one byte per element (bool, read in place through
    `mosaic/mask_view.py`, or uint8/int8); at least `min_mosaic_vocab` columns (the fused
    head's chunks).

    Never a function of T: the choice is the same for every batch a row can be in, so
    the default is bitwise batch invariant (each backend is on its own). T > 8 not a
    multiple of 8 moves untiled Mosaic tiles (`mosaic_rows_tile`, slower in bf16:
    docs/performance.md)."""
    import numpy as np

    from jaxops.backends.mosaic import mask_view  # here: `import jaxops` stays without jax.extend

    if capability is None or tuple(capability) < (9, 0) or not mosaic_usable:
        return TRITON
    in_place = (np.uint8, np.int8) + ((np.bool_,) if mask_view.ENABLED else ())
    if mask_dtype is not None and np.dtype(mask_dtype) not in in_place:
        return TRITON
    if not mosaic_supported(num_vocab, itemsize, mask_dtype is not None):
        return TRITON
    return MOSAIC if num_vocab >= min_mosaic_vocab else TRITON


# --- the fused LM head (`jaxops.linear`, `bridge.linear`) -------------------------------

def fused_forward_wanted(impl: str, config, pallas_config=None) -> bool:
    """Whether a call resolved to `impl` (with `config`, from `registry.resolve`)
    asks for the fused forward kernel (`backends/mosaic/linear.py`) where its shapes allow: "pallas"
    on a Hopper+ GPU, and "pallas_mosaic" (also in interpret mode off-GPU). A
    `pallas_config` that is a `PallasConfig` (the Triton kernels' parameters) keeps
    the chunked forward."""
    if impl == PALLAS:
        return (not config.interpret and not isinstance(pallas_config, PallasConfig)
                and mosaic_available())
    return impl == MOSAIC


def fused_backward_fits(num_tokens, hidden_size, num_vocab, dtype, masked,
                        chunk: int | None = None) -> bool:
    """Whether the backward's d logits come from `mosaic_linear.backward_logits` for
    these shapes (where the fused kernels are wanted): where the fused forward fits, up
    to `mosaic_linear.MAX_FUSED_BACKWARD_TOKENS` rows, with `chunk` (the backward's
    vocabulary columns per call; None: all V_loc at once) a multiple of 8 as the
    kernel's weight rows must be, of 16 with a mask (its slice's TMA row stride); the
    tail is then one too, as V_loc is."""
    from jaxops.backends.mosaic import linear as mosaic_linear

    return (num_tokens <= mosaic_linear.MAX_FUSED_BACKWARD_TOKENS
            and (chunk is None or chunk % (16 if masked else 8) == 0)
            and mosaic_linear.applies(num_tokens, hidden_size, num_vocab, dtype, masked))


def fused_forward_fits(num_tokens, hidden_size, num_vocab, dtype, masked) -> bool:
    """`mosaic_linear.applies`, imported on first use (it loads Mosaic GPU's Pallas)."""
    from jaxops.backends.mosaic import linear as mosaic_linear

    return mosaic_linear.applies(num_tokens, hidden_size, num_vocab, dtype, masked)


def use_fused_forward(impl, config, pallas_config, num_tokens, hidden_size, num_vocab, dtype,
                   masked) -> bool:
    """`fused_forward_wanted` and `fused_forward_fits` this call's shapes."""
    return (fused_forward_wanted(impl, config, pallas_config)
            and fused_forward_fits(num_tokens, hidden_size, num_vocab, dtype, masked))


def use_fused_backward(impl, config, pallas_config, num_tokens, hidden_size, num_vocab, dtype,
                    masked, chunk=None) -> bool:
    """`fused_forward_wanted` and `fused_backward_fits` this call's shapes."""
    return (fused_forward_wanted(impl, config, pallas_config)
            and fused_backward_fits(num_tokens, hidden_size, num_vocab, dtype, masked, chunk))


def for_call(name: str, config, pallas_config=None, *, num_vocab: int, itemsize: int,
             mask_dtype, platform: str | None = None, min_mosaic_vocab: int = 0):
    """(name, config) from `resolve`, made concrete for one call: "pallas" becomes
    "pallas_mosaic" or "pallas_triton" (`pallas_backend` on this process's first GPU);
    the other names pass through. `num_vocab`, `itemsize`, `mask_dtype`,
    `min_mosaic_vocab`: as for `pallas_backend`. `pallas_config` is what the caller passed to
    `resolve`: a `MosaicConfig` picks Mosaic, non-default `PallasConfig` parameters
    pick Triton (they tune its kernels). Off-GPU (interpret mode) "pallas" stays the
    Triton kernels."""
    if name != PALLAS:
        return name, config
    if isinstance(pallas_config, MosaicConfig):
        backend = MOSAIC
    elif config.interpret or (isinstance(pallas_config, PallasConfig) and pallas_config
                              != PallasConfig(interpret=pallas_config.interpret)):
        backend = TRITON
    else:
        found = _first_gpu_capability()
        backend = pallas_backend(num_vocab, itemsize, mask_dtype,
                                 None if found is None else found[1], _mosaic_usable(),
                                 min_mosaic_vocab)
    if backend == TRITON:
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
    return PALLAS if _platform(platform) in _GPU_PLATFORMS else XLA


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
    if name == MOSAIC:
        config = (pallas_config if isinstance(pallas_config, MosaicConfig)
                  else MosaicConfig(interpret=getattr(pallas_config, "interpret", False)))
        if platform in _GPU_PLATFORMS and not config.interpret:
            check_mosaic_gpu()
    else:
        config = (pallas_config if isinstance(pallas_config, PallasConfig)
                  else PallasConfig(interpret=getattr(pallas_config, "interpret", False)))
    if platform not in _GPU_PLATFORMS and not config.interpret:
        config = dataclasses.replace(config, interpret=True)
    return name, config


# --- the statistics backends, with the fallback for calls their kernels cannot take -------

def fallback_reason(implementation: str, logits, keep_mask, config) -> str | None:
    """Why `implementation`'s kernels cannot take this call, so that the XLA backend
    computes it ("" where that needs no warning: T = 0), or None where they can.
    `logits` `[T, V_loc]` and `keep_mask` (or None) may be tracers; only shapes and
    dtypes are read."""
    num_tokens, num_vocab = logits.shape
    if implementation == MOSAIC:
        if num_tokens == 0:
            return ""
        if not mosaic_supported(num_vocab, logits.dtype.itemsize, keep_mask is not None):
            rule = supported_vocab(logits.dtype.itemsize, keep_mask is not None)
            return (f"pallas_mosaic: logits [{num_tokens}, {num_vocab}] {logits.dtype}: V_loc "
                    f"must be {rule}; computing this call with the XLA implementation "
                    "instead.")
    elif implementation in (PALLAS, TRITON):
        from jaxops.backends.triton import common

        if not common.indexes_safely(config or PallasConfig(), logits, keep_mask):
            return ("This JAX's Pallas Triton lowering indexes bool arrays of 2**31+ elements "
                    "with 32-bit offsets and jaxops could not correct it; computing this call "
                    "with the XLA implementation instead (correct, slower).")
    return None


class Statistics:
    """A backend's `forward_stats` and `backward_logits` (`contract.py`) behind the
    registry's one fallback rule (`fallback_reason`): the kernels modules only ever see
    calls they take. `module` is the backend's kernels module."""

    def __init__(self, name: str, module: ModuleType):
        self.name, self.module = name, module
        # (logits, keep_mask, config) -> whether callers should hand `backward_logits` a
        # buffer to write into (False wherever the call would fall back); None for the
        # backends that never can
        self.can_write_into = getattr(module, "can_write_into", None)

    def _xla(self, logits, keep_mask, config):
        reason = fallback_reason(self.name, logits, keep_mask, config)
        if reason is None:
            return None
        if reason:
            warnings.warn(reason, RuntimeWarning, stacklevel=4)
        from jaxops.backends import xla

        return xla

    def forward_stats(self, logits, local_targets, keep_mask, *, inv_tau, with_entropy,
                      config=None):
        xla = self._xla(logits, keep_mask, config)
        if xla is None:
            return self.module.forward_stats(logits, local_targets, keep_mask,
                                             inv_tau=inv_tau, with_entropy=with_entropy,
                                             **_given(config=config))
        return xla.forward_stats(logits, local_targets, _as_bool(keep_mask),
                                 inv_tau=inv_tau, with_entropy=with_entropy)

    def backward_logits(self, logits, local_targets, keep_mask, max_logit, masked_max,
                        coefs, *, inv_tau, config=None, into=None, out_dtype=None):
        # With `into` the kernels check for themselves that they can store into it (their
        # `can_write_into` is False wherever this would fall back).
        xla = None if into is not None else self._xla(logits, keep_mask, config)
        if xla is None:
            return self.module.backward_logits(logits, local_targets, keep_mask, max_logit,
                                               masked_max, coefs, inv_tau=inv_tau,
                                               out_dtype=out_dtype,
                                               **_given(config=config, into=into))
        if self.name == MOSAIC:  # as the Mosaic kernel would: its dtype, then out_dtype
            dlogits = xla.backward_logits(logits, local_targets, _as_bool(keep_mask),
                                          max_logit, masked_max, coefs, inv_tau=inv_tau)
            return dlogits if out_dtype is None else dlogits.astype(out_dtype)
        return xla.backward_logits(logits, local_targets, keep_mask, max_logit, masked_max,
                                   coefs, inv_tau=inv_tau, out_dtype=out_dtype)


def _given(**kwargs):
    """The keyword arguments that are not None (the kernels keep their own defaults)."""
    return {k: v for k, v in kwargs.items() if v is not None}


def _as_bool(keep_mask):
    """A uint8 keep mask (nonzero = kept; the Mosaic kernels' bytes) as bool, for XLA."""
    if keep_mask is None or keep_mask.dtype == bool:
        return keep_mask
    return keep_mask.astype(bool)


@functools.cache
def kernels(implementation: str) -> Statistics:
    """`implementation`'s shard statistics (its kernels module imported on first use)."""
    try:
        module = _KERNEL_MODULES[implementation]
    except KeyError:
        raise ValueError(
            f"implementation {implementation!r} has no shard statistics; one of "
            f"{tuple(_KERNEL_MODULES)}") from None
    return Statistics(implementation, importlib.import_module(module))
