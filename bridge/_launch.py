"""The direct route's launchers: a Mosaic GPU kernel compiled for torch's pointers.

`launcher(kernel, operands, device)` returns the kernel compiled once for operands of
fixed shapes on one device (`Launcher`), building it on first use: JAX traces and
lowers the kernel to a Mosaic GPU module (`lower`), or the persistent cache
(`bridge/cache.py`) supplies that module, and Mosaic compiles it to a cubin and a host
launcher. `register_kernel` gives a kernel the configuration the cache keys it by.
Builds are thread-safe: different kernels build at once (Mosaic's compile releases the
GIL), the same kernel once. `build_times()` says where the build time went.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time

import torch

from bridge import cache as _cache

_LAUNCHERS: dict = {}  # (kernel, device index) -> Launcher
# kernel -> everything its factory was given: the persistent cache's key
_KERNEL_KEYS: dict = {}
_thread = threading.local()
# One lock per launcher being built, so that threads (`bridge.warmup(threads=N)`) build
# different kernels at once and never the same one twice.
_BUILD_LOCKS: dict = {}
_BUILD_LOCKS_GUARD = threading.Lock()
# Seconds spent building launchers, by phase, summed over threads: "lower" (JAX's
# tracing and lowering to a Mosaic GPU module; skipped on a persistent-cache hit) and
# "compile" (Mosaic's compile of the module to a cubin and its host launcher, which
# runs in every process); "loaded" counts modules taken from the persistent cache.
_BUILD_TIMES = {"lower": 0.0, "compile": 0.0, "loaded": 0, "built": 0}


def register_kernel(kernel, config: tuple) -> None:
    """Key `kernel`'s persistent-cache entries by `config` (everything its factory was
    given); a kernel never registered is built in every process."""
    _KERNEL_KEYS[kernel] = config


def compiled_launchers() -> int:
    """Kernels compiled for the direct route so far (one per kernel, window size and device)."""
    return len(_LAUNCHERS)


def build_times() -> dict:
    """A copy of `_BUILD_TIMES`: where the direct route's compile time went so far."""
    with _BUILD_LOCKS_GUARD:
        return dict(_BUILD_TIMES)


def _add_build_time(phase: str, seconds: float) -> None:
    with _BUILD_LOCKS_GUARD:
        _BUILD_TIMES[phase] += seconds


class Launcher:
    """One kernel compiled for operands of fixed shapes on one device; `launcher(pointers)`
    launches it on that device's default torch stream with the buffers at these
    addresses (inputs, then outputs, as the kernel declares them)."""

    def __init__(self, kernel, structs, device):
        from jax.experimental.mosaic.gpu import core as mgpu_core

        def compile_module(asm):
            t0 = time.perf_counter()
            try:
                return mgpu_core._compile_as_torch_gpu_kernel(asm)
            finally:
                _add_build_time("compile", time.perf_counter() - t0)

        # The lowered module from the persistent cache (`cache.py`) where it has one,
        # which skips JAX's tracing and lowering (Mosaic's compile to a cubin still runs).
        # A kernel never passed to `register_kernel` is not cached.
        config = _KERNEL_KEYS.get(kernel)
        key = _cache.kernel_key(config, structs, device) if config else None
        entry = _cache.load_kernel(key) if key else None
        launch = None
        if entry is not None:
            asm, num_results = entry
            try:
                launch, self._unload = compile_module(asm)
                _add_build_time("loaded", 1)
            except RuntimeError:  # an entry Mosaic cannot compile here: build it anew
                launch = None
        if launch is None:
            t0 = time.perf_counter()
            asm, num_results = lower(kernel, structs)
            _add_build_time("lower", time.perf_counter() - t0)
            launch, self._unload = compile_module(asm)
            _add_build_time("built", 1)
            if key:
                _cache.store_kernel(key, asm, num_results)
        self._pointers = ctypes.c_void_p * (len(structs) + num_results)
        # The wrapper looks up torch's default stream on every launch (~2 µs of host
        # time, and ~5 µs with its closure); the stream of a device never changes, so
        # the compiled launch function is called directly where the wrapper's closure
        # exposes it, else through the wrapper.
        cells = dict(zip(launch.__code__.co_freevars,
                         (c.cell_contents for c in launch.__closure__ or ())))
        stream = torch.cuda.default_stream(device)._as_parameter_
        launch_c, function = cells.get("launch_c"), cells.get("function")
        if callable(launch_c) and function is not None:
            self._call = functools.partial(launch_c, function, stream)
        else:
            self._call = lambda arr: launch(arr, device)

    def __call__(self, pointers):
        self._call(self._pointers(*pointers))


def lower(kernel, structs) -> tuple[bytes, int]:
    """(the kernel's Mosaic GPU module as `MosaicGpuCompile` takes it, its result count)."""
    import jax
    from jax._src.lib.mlir import passmanager
    from jax._src.pallas.mosaic_gpu import torch as mgpu_torch
    from jax.experimental.mosaic import gpu as mgpu

    with jax.enable_x64(False):  # the kernels are float32/int32 throughout
        module = jax.jit(kernel).trace(*structs).lower().compiler_ir()
    with module.context:
        # jit outlines the kernel call into a function; inline it back.
        mgpu.dialect.register_inliner_extensions(module.context)
        passmanager.PassManager.parse("builtin.module(inline{default-pipeline=})").run(
            module.operation)
        call = mgpu_torch._find_mgpu_call_in_module(module)[0]
    if len(call.operands) != len(structs):
        raise RuntimeError("the kernel module has operands besides the kernel's own")
    return call.attributes["mhlo.backend_config"]["module"].value_bytes, len(call.results)


def bind_primary_context(device_index: int) -> None:
    """Make the device's primary CUDA context current on this thread, once per thread.

    Mosaic's compiler and launcher use the CUDA driver API, which needs a current
    context; torch's runtime API binds one lazily, so a thread that has only run
    torch's cached allocations -- torch's autograd device thread, where the backward
    runs -- may have none ("Failed to compile the module")."""
    if getattr(_thread, "bound", None) == device_index:
        return
    cuda = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    if cuda.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value:
        dev = ctypes.c_int()
        if (cuda.cuDeviceGet(ctypes.byref(dev), device_index) != 0
                or cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0
                or cuda.cuCtxSetCurrent(ctx) != 0):
            raise RuntimeError(f"could not make CUDA device {device_index}'s context current")
    _thread.bound = device_index


def launcher(kernel, operands, device):
    """The launcher of `kernel`, compiled on first use for `operands`: (*shape, dtype)
    tuples (ShapeDtypeStructs are made only then: they cost microseconds each)."""
    bind_primary_context(device.index)  # compiling and launching both need it
    key = (kernel, device.index)  # a compiled module belongs to one device's context
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        with _BUILD_LOCKS_GUARD:
            lock = _BUILD_LOCKS.setdefault(key, threading.Lock())
        with lock:
            launcher = _LAUNCHERS.get(key)
            if launcher is None:
                structs = [struct(op[:-1], op[-1]) for op in operands]
                launcher = _LAUNCHERS[key] = Launcher(kernel, structs, device)
    return launcher


def struct(shape, dtype):
    import jax

    return jax.ShapeDtypeStruct(tuple(shape), dtype)
