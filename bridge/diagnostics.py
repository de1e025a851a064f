"""What the bridge's benchmarks and examples look at besides the ops' results.

    from bridge import diagnostics
    diagnostics.compiled_programs()       # programs compiled so far, every configuration
    diagnostics.direct_route_ready()      # can the Mosaic kernels be launched from torch here
    diagnostics.kernel_build_times()      # the direct route's lowering and compile seconds
    diagnostics.row_windows(T)            # the row windows a call of T rows runs
    diagnostics.jax_device(device)        # JAX's device for a torch device (memory_stats)

and, for timing the bridge's pieces one at a time (benchmarks/bridge_overhead.py):
`dlpack_device` (the zero-copy hand-over of one device) and `staged_functions` (the
bridge's own jitted JAX functions). None of it is needed to use the ops; all of it
reads state the ops keep anyway, except that the device functions start JAX on that
device as a bridge call would.
"""

from __future__ import annotations

import torch

from bridge import _direct, _dlpack, _engine, _jaxfns, _launch, _windows
from bridge.warmup import compiled_programs

MAX_WINDOW = _windows.MAX_WINDOW  # rows of the largest window
Window = _windows.Window

__all__ = ["MAX_WINDOW", "Window", "compiled_launchers", "compiled_programs",
           "direct_route_ready", "dlpack_device", "jax_device", "kernel_build_times",
           "memory_policy_note",
           "row_windows", "staged_functions"]


def compiled_launchers() -> int:
    """Kernels compiled for the direct route so far (one per kernel, window size and
    device); `compiled_programs()` counts them too."""
    return _launch.compiled_launchers()


def kernel_build_times() -> dict:
    """Where the direct route's build time went in this process, summed over threads:
    `lower` (seconds of JAX tracing and lowering kernels to Mosaic GPU modules; a
    persistent-cache hit skips it), `compile` (seconds of Mosaic compiling modules to
    GPU code, paid in every process), `built` (kernels lowered here) and `loaded`
    (kernels whose module came from the persistent cache)."""
    return _launch.build_times()


def direct_route_ready() -> bool:
    """Whether this JAX can build the direct route's launchers: it has the Mosaic GPU
    pieces, and no GPU older than sm_90 is in sight (True on a CPU-only host too). On
    CUDA, one shard's eager calls with "pallas" or "pallas_mosaic" then take the direct
    route where the kernels take the shape (`bridge/_direct.py`)."""
    return _direct.ready()


def row_windows(num_tokens: int, align: int = 1) -> tuple[Window, ...]:
    """The windows `(start, size, skip)` that cover a call's `[T, ...]` rows, for rows
    that start aligned every `align` rows (1: every row, as for padded vocabularies)."""
    return _windows.row_windows(num_tokens, align)


def memory_policy_note() -> str:
    """What importing `bridge` did about JAX's GPU memory preallocation."""
    return _dlpack.memory_policy_note()


def dlpack_device(device):
    """The bridge's hand-over record for a torch device: `.fast` (the private DLPack
    entry points work), `.cuda`, `.jax_device`, `.jax_waits_for_torch()` and `.begin()`,
    which starts one call's hand-overs (`.to_jax(tensor)`, `.to_torch(array)`)."""
    return _dlpack.device(torch.device(device))


def jax_device(device):
    """The JAX device the bridge runs on for a torch device (its `memory_stats()` shows
    JAX's pool)."""
    return dlpack_device(device).jax_device


def staged_functions(implementation, device, *, num_vocab: int, itemsize: int,
                     with_entropy: bool, target_mode: str):
    """The bridge's own jitted (forward, backward) pair for one unmasked shard at
    temperature 1, as a call with these arguments picks them:

        forward(logits [b, V], raw_targets, None) -> (outputs [n_out, b], stats [1, K, b])
        backward(logits, raw_targets, None, stats, d_out [b, n]) -> d logits [b, V]

    `raw_targets`: int32 ids ("i32") or int64 ids viewed as int32 pairs ("i64");
    `d_out`: d log_prob and, `with_entropy`, d entropy, token-major."""
    name, config = _engine.implementation_for(
        implementation, dlpack_device(device), num_vocab=num_vocab, itemsize=itemsize)
    forward = _jaxfns.local_forward(
        shard_index=0, world=1, inv_tau=1.0, with_entropy=with_entropy, masked=False,
        implementation=name, config=config, target_mode=target_mode)
    backward = _jaxfns.local_backward(
        shard_index=0, inv_tau=1.0, with_entropy=with_entropy, entropy_grad=True,
        masked=False, has_d_log_prob=True, has_d_entropy=with_entropy,
        implementation=name, config=config, target_mode=target_mode, write_through=False)
    return forward, backward
