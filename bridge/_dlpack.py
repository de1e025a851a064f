"""Zero-copy torch <-> JAX hand-over on one device: DLPack, CUDA stream order, memory policy.

What this module relies on (checked against jax 0.10.2 and the 0.11.2 sources):

* Import (torch -> JAX). `dlpack_managed_tensor_to_buffer(capsule, device, stream, ...)`
  (the function behind `jax.dlpack.from_dlpack`) wraps the tensor's memory in a PJRT
  view buffer -- no copy. With a `stream` it records the buffer's *definition event* on
  that stream, and every JAX computation that reads the buffer waits for that event.
  The stream must be one JAX handed out (`Device.get_stream_for_external_ready_events`;
  PJRT looks it up among its own streams), and the producer must order its work onto it
  first; without a stream the event goes on JAX's compute stream, unordered with torch.
  `torch.Tensor.__dlpack__(stream=s)` does the ordering per tensor in Python (a new
  `ExternalStream` and `Event` each time). We do it once per call: record one event on
  torch's *current* stream, make JAX's stream wait on it, import the call's first tensor
  with that stream and the others without (they feed the same JAX computation, which
  waits for the first one; see `Transfer`). No host synchronisation: the waits happen
  on the GPU.
* Export (JAX -> torch). `buffer_to_dlpack_managed_tensor(array, stream=s)` (behind
  `Array.__dlpack__`) makes the consumer stream `s` -- torch's current stream -- wait
  on the array's definition event (`WaitUntilBufferReadyOnStream`), again on the GPU.
  The capsule keeps the JAX buffer alive for as long as the torch tensor lives.
* Lifetimes. Torch memory read by JAX stays alive (the capsule holds a reference to the
  tensor) until JAX drops its view buffer; every bridge call ends by exporting its
  outputs onto torch's current stream, so later torch work on that stream -- including
  reuse of freed input memory by torch's caching allocator -- is ordered after the JAX
  kernels. Symmetrically every JAX computation of the bridge starts from an import that
  waited for torch's current stream, so JAX reusing memory that torch released (the
  gradient) is ordered after torch's last use of it. Both hold as long as torch works
  on its current stream, which is the same assumption `torch.Tensor.__dlpack__` makes.
* The two private entry points (`jax._src.lib._jax.dlpack_managed_tensor_to_buffer`,
  `.buffer_to_dlpack_managed_tensor`) skip most of the Python of
  `jax.dlpack.from_dlpack` (platform lookups, per-tensor stream/event objects, an
  exception on CPU, a `jnp.asarray` dispatch, and for int64 an x64 conversion: on the
  H200 host 60 us per tensor, 217 us for int64, against 17 us). They are probed once per
  device with a round trip that checks the pointers; if they are missing or misbehave we
  fall back to the public `jax.dlpack.from_dlpack` / `torch.from_dlpack`, which follow
  the same protocol.

Memory policy: JAX preallocates 75% of a GPU when its backend starts unless
`XLA_PYTHON_CLIENT_PREALLOCATE=false`. `apply_memory_policy()` (run when `bridge` is
imported) sets that default if JAX has not started yet, and, on the first CUDA call,
starts JAX only on the GPU of the tensor (`jax_cuda_visible_devices`) so that a rank
does not create CUDA contexts on its neighbours' GPUs. If JAX was started earlier with
preallocation, the first CUDA call warns. With preallocation off, JAX's BFC allocator
still keeps what it frees in its own pool (the pool never shrinks): after the first
backward it holds about one gradient, [T, V_loc] in the logits' dtype, which torch
cannot reuse. `XLA_PYTHON_CLIENT_MEM_FRACTION` caps the pool; the platform allocator
(`XLA_PYTHON_CLIENT_ALLOCATOR=platform`) returns memory at once but makes every
allocation synchronous, so it is not the default here.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings

import torch

_PREALLOC = "XLA_PYTHON_CLIENT_PREALLOCATE"
_FALSE = ("false", "False", "0")
_ALL_GPUS_ENV = "JAXOPS_BRIDGE_JAX_GPUS"  # "all": let JAX see every GPU when the bridge starts it

# DLPack device types
_KDLCPU, _KDLCUDA = 1, 2

_policy_note: str = ""  # what apply_memory_policy() found, for diagnostics
_lock = threading.Lock()
_devices: dict = {}  # torch device -> _Device
_fast_ok: dict = {}  # jax platform -> bool (private DLPack entry points usable)


def apply_memory_policy() -> str:
    """Make JAX allocate GPU memory on demand, if it has not started yet. Returns a note."""
    global _policy_note
    started = False
    if "jax" in sys.modules:
        try:
            from jax._src import xla_bridge

            started = xla_bridge.backends_are_initialized()
        except Exception:  # pragma: no cover - very old / very new JAX
            started = True
    if not started:
        if _PREALLOC not in os.environ:
            os.environ[_PREALLOC] = "false"
            _policy_note = f"set {_PREALLOC}=false before JAX started"
        else:
            _policy_note = f"left {_PREALLOC}={os.environ[_PREALLOC]} as the user set it"
    else:
        _policy_note = "JAX had already started when the bridge was imported"
    return _policy_note


def memory_policy_note() -> str:
    return _policy_note


def _jax_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def _start_jax_for(index: int) -> None:
    """Start JAX's GPU backend on torch's device only (unless JAX already started)."""
    import jax

    if _jax_started() or os.environ.get(_ALL_GPUS_ENV, "").lower() == "all":
        return
    try:
        current = jax.config.read("jax_cuda_visible_devices")
        if current == "all":
            jax.config.update("jax_cuda_visible_devices", str(index))
    except (AttributeError, KeyError, ValueError) as err:  # option renamed or removed
        warnings.warn(
            f"bridge: could not restrict JAX to GPU {index} ({err!r}); JAX will start on "
            f"every visible GPU (a CUDA context on each). Set CUDA_VISIBLE_DEVICES per rank, "
            f"or {_ALL_GPUS_ENV}=all to silence this.", RuntimeWarning, stacklevel=4)


def _warn_if_preallocated(jax_device) -> None:
    try:
        stats = jax_device.memory_stats()
    except (NotImplementedError, RuntimeError):  # no allocator statistics on this platform:
        stats = None                              # judge by the environment variable below
    pool = (stats or {}).get("pool_bytes") or (stats or {}).get("bytes_reserved") or 0
    limit = (stats or {}).get("bytes_limit") or 0
    env = os.environ.get(_PREALLOC, "")
    preallocated = (limit and pool >= 0.5 * limit) if stats else env not in _FALSE
    if preallocated:
        warnings.warn(
            f"JAX started before the bridge and preallocated "
            f"{pool / 2**30:.1f} GiB of GPU memory on {jax_device} that PyTorch cannot use. "
            f"Import `bridge` before anything starts JAX, or set {_PREALLOC}=false in the "
            "environment.", RuntimeWarning, stacklevel=4)


_private = None


def _private_api():
    global _private
    if _private is None:
        try:
            from jax._src.lib import _jax
        except ImportError:  # pragma: no cover - older layout
            from jax._src.lib import xla_extension as _jax
        _private = (_jax.dlpack_managed_tensor_to_buffer, _jax.buffer_to_dlpack_managed_tensor)
    return _private


class _Device:
    """JAX's view of one torch device, and the per-device stream-ordering state."""

    def __init__(self, tdev: torch.device):
        import jax

        from bridge import cache

        cache.enable()  # before the bridge's first compile (the probe below is one)
        self.torch_device = tdev
        self.cuda = tdev.type == "cuda"
        if self.cuda:
            index = tdev.index if tdev.index is not None else torch.cuda.current_device()
            self.torch_device = tdev = torch.device("cuda", index)
            _start_jax_for(index)
            from jax._src import xla_bridge

            backend = xla_bridge.get_backend("cuda")
            try:
                self.jax_device = backend.device_from_local_hardware_id(index)
            except Exception:
                matches = [d for d in backend.local_devices()
                           if getattr(d, "local_hardware_id", None) == index]
                if not matches:
                    raise RuntimeError(
                        f"JAX has no device for {tdev} (its GPUs: {backend.local_devices()}). "
                        f"If JAX was started for another GPU, set {_ALL_GPUS_ENV}=all or start "
                        "JAX yourself before the bridge's first call.") from None
                self.jax_device = matches[0]
            _warn_if_preallocated(self.jax_device)
            self.dl_type = _KDLCUDA
            self.alignment = 16  # XLA/Triton assume 16-byte aligned entry buffers
            self._event = torch.cuda.Event()
            self._ext_streams: dict = {}
            self._streams: dict = {}  # raw stream pointer -> torch.cuda.Stream
            self._index = index
            self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
                lambda i: torch.cuda.current_stream(i).cuda_stream)
            # The C++ event methods guard the device themselves; torch.cuda.Event's
            # Python wrappers add a device context manager per call.
            base = torch._C._CudaEventBase
            self._record = getattr(base, "record", None) or torch.cuda.Event.record
            self._wait = getattr(base, "wait", None) or torch.cuda.Event.wait
        else:
            if tdev.type != "cpu":
                raise ValueError(f"the bridge supports CPU and CUDA tensors, got {tdev}")
            self.jax_device = jax.devices("cpu")[0]
            self.dl_type = _KDLCPU
            self.alignment = 64  # the XLA CPU client refuses views of less-aligned memory
        self.platform = self.jax_device.platform
        self.fast = self._probe_fast()

    # -- fast path probe ---------------------------------------------------------
    def _probe_fast(self) -> bool:
        if self.platform in _fast_ok:
            return _fast_ok[self.platform]
        ok = False
        try:
            to_buffer, to_capsule = _private_api()
            probe = torch.arange(64, dtype=torch.float32, device=self.torch_device)
            stream = self.jax_waits_for_torch() if self.cuda else None
            arr = to_buffer(torch._C._to_dlpack(probe), self.jax_device, stream, False,
                            self.dl_type)
            ok = arr.unsafe_buffer_pointer() == probe.data_ptr()
            out = self._dlpack_stream(self._torch_stream()) if self.cuda else None
            back = torch._C._from_dlpack(to_capsule(arr * 2, stream=out))
            ok = ok and bool(torch.equal(back, probe * 2))
        except Exception as err:  # pragma: no cover - depends on the JAX version
            warnings.warn(f"bridge: JAX's DLPack fast path is unavailable ({err!r}); "
                          "using jax.dlpack.from_dlpack / torch.from_dlpack", RuntimeWarning)
        _fast_ok[self.platform] = ok
        return ok

    # -- stream ordering ---------------------------------------------------------
    def _torch_stream(self):
        """torch's current stream on this device (a torch.cuda.Stream), looked up by its
        raw pointer: `torch.cuda.current_stream` builds a new Python object per call,
        which cost tens of microseconds of host time per bridge call."""
        ptr = self._raw_stream(self._index)
        stream = self._streams.get(ptr)
        if stream is None:
            stream = self._streams[ptr] = torch.cuda.current_stream(self.torch_device)
        return stream

    @staticmethod
    def _dlpack_stream(stream) -> int:
        """A torch stream as a DLPack stream number (1 = the legacy default stream)."""
        ptr = stream.cuda_stream
        return 1 if ptr == 0 else ptr

    def _jax_waits_for(self, torch_stream) -> int:
        """Make one of JAX's external-ready streams wait (on the GPU) for all work queued
        so far on `torch_stream`; return that JAX stream for this call's imports.

        (PJRT records each imported buffer's definition event on the stream it is given
        and accepts only its own external-ready streams there, round-robin among a few:
        hence one ExternalStream per stream pointer, cached.)"""
        ptr = self.jax_device.get_stream_for_external_ready_events()
        ext = self._ext_streams.get(ptr)
        if ext is None:
            ext = torch.cuda.ExternalStream(ptr, device=self.torch_device)
            self._ext_streams[ptr] = ext
        # One event serves every call: a wait captures the event's latest record.
        self._record(self._event, torch_stream)
        self._wait(self._event, ext)
        return ptr

    def jax_waits_for_torch(self) -> int:
        """`_jax_waits_for` torch's current stream: the JAX stream for the next import."""
        return self._jax_waits_for(self._torch_stream())

    def begin(self) -> "Transfer":
        return Transfer(self)


class Transfer:
    """The hand-overs of one bridge call on one device.

    `begin` makes one JAX external-ready stream wait for torch's current stream. The
    *first* import after `begin`/`resync` carries that stream, so its definition event
    -- which every JAX computation reading the buffer waits for -- lies after all torch
    work queued so far. Later imports of the same call are made without a stream (their
    definition events sit on JAX's compute stream, i.e. "ready in stream order"): they
    are inputs of the same JAX computation as the first one, whose wait already orders
    them after torch's writes. This saves a CUDA event and a deferred release per
    tensor. Rule for callers: the first import after begin/resync must be an input of
    the next JAX computation.
    """

    __slots__ = ("dev", "_torch_stream", "_import_stream", "_export_stream")

    def __init__(self, dev: _Device):
        self.dev = dev
        self._import_stream = None
        self._export_stream = None
        if dev.cuda and dev.fast:
            self._torch_stream = dev._torch_stream()
            self._import_stream = dev._jax_waits_for(self._torch_stream)
            self._export_stream = dev._dlpack_stream(self._torch_stream)

    def resync(self) -> None:
        """Order the next JAX computation after torch work queued since `begin`."""
        if self.dev.cuda and self.dev.fast:
            self._import_stream = self.dev._jax_waits_for(self._torch_stream)

    def to_jax(self, t: torch.Tensor):
        """Zero-copy `jax.Array` view of a contiguous, suitably aligned torch tensor."""
        if self.dev.fast:
            stream, self._import_stream = self._import_stream, None
            return _private[0](torch._C._to_dlpack(t), self.dev.jax_device, stream, False,
                               self.dev.dl_type)
        import jax.dlpack

        return jax.dlpack.from_dlpack(t)

    def to_torch(self, a) -> torch.Tensor:
        """Zero-copy torch tensor over a JAX array; torch's current stream waits for it."""
        if self.dev.fast:
            return torch._C._from_dlpack(_private[1](a, stream=self._export_stream))
        return torch.from_dlpack(a)


def device(tdev: torch.device) -> _Device:
    d = _devices.get(tdev)
    if d is None:
        with _lock:
            d = _devices.get(tdev)
            if d is None:
                d = _Device(tdev)
                _devices[tdev] = d
                _devices[d.torch_device] = d
    return d


def begin(tdev: torch.device) -> Transfer:
    return device(tdev).begin()
