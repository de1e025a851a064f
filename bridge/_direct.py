"""The direct route: the Mosaic GPU kernels launched from torch, no JAX runtime per call.

Through JAX, every call pays PJRT's dispatch, a DLPack import per operand and an
export per result (~230 µs of host time for a forward and a backward at T = 16;
docs/performance.md, "The bridge: host cost and the direct route"). Here the kernels of
`jaxops/backends/mosaic/direct.py` are compiled once per row-window size into launchers that take
pointers to torch's tensors and launch on torch's default CUDA stream; every buffer comes
from torch's caching allocator:

    forward   per window: partials kernel -> finish kernel -> log_prob, entropy,
              saved multipliers (O(T), kept for the backward); one kernel doing
              both where the vocabulary is one chunk (V_loc up to ~4-6K)
    backward  torch allocates d logits; per window one kernel stores its rows into it

Taken when (`applies`): CUDA, the Mosaic kernels ("pallas" where jaxops' policy picks
them, or "pallas_mosaic" named), one vocabulary shard (no process group, or a group of
one), the eager autograd route, the logits on the current CUDA device, a GPU Mosaic GPU
compiles for (sm_90+) and a shape the kernels take (`mosaic.direct.supported`);
everything else goes through JAX (`_run.py`). Without JAX's per-call host cost the
direct route was faster on the H200 at every size measured up to T = 16,384 (V_loc
18,992 and 37,984, bf16/fp32, with and without a mask) and within 5% of the JAX route at
T = 32,768 (docs/performance.md, "The bridge: host cost and the direct route").
Work on another stream than the default is fenced with stream waits (no host sync).

The launcher (`bridge/_launch.py`) is built from the two pieces `plgpu.as_torch_kernel` is
made of in jax 0.10-0.11 (the lowered module's Mosaic GPU call, and
`mosaic.gpu.core._compile_as_torch_gpu_kernel`), without that wrapper's per-call
argument checks and per-output allocations: on the H200 host those cost ~80 µs per
launch. A window's forward buffers are carved out of one torch allocation. If a JAX
version lacks the pieces, `ready()` is False and the bridge uses the JAX route.

Targets: the kernels read int64 ids in place, as pairs of int32 words
(`wide_targets`, `mosaic.common.read_targets`): an id outside [0, 2**31) reads as -1, so
it stays out of range (NaN log-prob) instead of wrapping around, and no torch op converts
them. int32 ids are read as they are. Large windows (`GATHER_TARGET_FROM`) get the
target's logit gathered by torch.

Measured on the H200 (docs/performance.md, "The bridge: host cost and the direct route"): a
forward+backward takes 2.5-2.7x less time than through JAX at host-bound sizes; 1.2x the
torch-only floor at T = 8192, V_loc = 18,992, 2-3x at T = 16.
"""

from __future__ import annotations

import functools

import torch

from bridge._launch import launcher as _launcher
from bridge._launch import register_kernel
from jaxops.backends import registry
from jaxops.backends.mosaic.config import MosaicConfig


@functools.cache
def ready() -> bool:
    """JAX's Mosaic GPU can compile for torch here (CUDA JAX, sm_90+, the pieces)."""
    try:
        from jax._src.pallas.mosaic_gpu import torch as mgpu_torch
        from jax.experimental.mosaic.gpu import core as mgpu_core

        registry.check_mosaic_gpu()
        return (hasattr(mgpu_torch, "_find_mgpu_call_in_module")
                and hasattr(mgpu_core, "_compile_as_torch_gpu_kernel"))
    except Exception:  # no CUDA JAX, a GPU before Hopper: the JAX route decides
        return False


def applies(plan, world: int, want_stats: bool) -> bool:
    if want_stats or world != 1 or not plan.dev.cuda:
        return False
    if plan.implementation != registry.MOSAIC:
        return False
    if plan.logits.device.index != torch.cuda.current_device():
        return False
    if plan.config is not None and plan.config.interpret:
        return False
    from jaxops.backends.mosaic import direct as mosaic_direct

    return (mosaic_direct.supported(plan.num_vocab, plan.logits.element_size(),
                                    plan.mask is not None) and ready())


def _ids_struct(size: int, wide: bool):
    """The target operand of a window of `size` rows: int32 ids, or (`wide`) int64 ids
    read as their two int32 words each."""
    return (size * (1 + wide), "int32")


class _WindowForward:
    """One window size's forward: its kernels, their operands, and the layout of the
    one float32 buffer they write -- the finish outputs (rows of `padded`), then the
    partials (`chunks` rows each). A vocabulary of one chunk whose target is found in
    the kernel takes one kernel (`mosaic.direct.forward_kernel`) and no partials. Made
    once per configuration (`_window_forward`), so a call only adds addresses."""

    def __init__(self, size, num_vocab, dtype, masked, with_entropy, inv_tau, config,
                 gathered, wide):
        from jaxops.backends.mosaic import direct as md

        sizes = md.layout(size, num_vocab, dtype, masked=masked, with_entropy=with_entropy,
                          gathered_target=gathered, config=config)
        chunks, padded = sizes["chunks"], sizes["padded"]
        num_outs = sizes["num_finish"]
        big = [(size, num_vocab, dtype)] + [(size, num_vocab, "uint8")] * masked  # bool
        ids = _ids_struct(size, wide)
        common = dict(masked=masked, with_entropy=with_entropy, inv_tau=inv_tau,
                      wide_targets=wide, config=config)
        self.out_offsets = [k * padded * 4 for k in range(num_outs)]
        self.single = not gathered and md.one_pass(num_vocab, dtype, masked, config)
        if self.single:
            self.kernel = md.forward_kernel(size, num_vocab, dtype, **common)
            self.operands = big + [ids]
            self.buffer_shape = (num_outs, padded)
            return
        num_parts = sizes["num_partials"]
        self.partials = md.partials_kernel(size, num_vocab, dtype, gathered_target=gathered,
                                           **common)
        self.finish = md.finish_kernel(size, num_vocab, dtype, gathered_target=gathered,
                                       **common)
        self.buffer_shape = (num_outs + num_parts * chunks, padded)
        self.part_offsets = [(num_outs + k * chunks) * padded * 4 for k in range(num_parts)]
        self.partials_operands = big + [ids] * (not gathered)
        self.finish_operands = ([(chunks, padded, "float32")] * num_parts + [ids]
                                + [(size, "float32")] * (gathered * (1 + masked)))


@functools.lru_cache(maxsize=None)
def _window_forward(*key) -> _WindowForward:
    kernels = _WindowForward(*key)
    for name in ("kernel", "partials", "finish"):
        if hasattr(kernels, name):
            register_kernel(getattr(kernels, name), (name,) + key)
    return kernels


@functools.lru_cache(maxsize=None)
def _backward_kernel(num_tokens, num_vocab, dtype, masked, with_entropy, entropy_grad,
                     has_d_log_prob, has_d_entropy, inv_tau, wide, config):
    from jaxops.backends.mosaic import direct as md

    kernel = md.backward_kernel(num_tokens, num_vocab, dtype, masked=masked,
                                with_entropy=with_entropy, entropy_grad=entropy_grad,
                                has_d_log_prob=has_d_log_prob, has_d_entropy=has_d_entropy,
                                inv_tau=inv_tau, wide_targets=wide, config=config, into=True)
    register_kernel(kernel, ("backward", num_tokens, num_vocab, dtype, masked, with_entropy,
                             entropy_grad, has_d_log_prob, has_d_entropy, inv_tau, wide, config))
    return kernel


@functools.lru_cache(maxsize=None)
def _backward_operands(size, num_vocab, dtype, masked, wide, num_saved,
                       num_cotangents) -> list:
    from jaxops.backends.mosaic import direct as md

    padded = md.padded_rows(size)
    return ([(size, num_vocab, dtype)] + [(size, num_vocab, "uint8")] * masked
            + [_ids_struct(size, wide)] + [(padded, "float32")] * num_saved
            + [(size, "float32")] * num_cotangents + [(size, num_vocab, dtype)])


class _OnDefaultStream:
    """The launcher launches on torch's default stream: fence it with the current
    stream when that is another one (stream waits only, no host sync). Tensors made on
    the current stream for the kernels must stay referenced until the exit's wait:
    freed earlier, torch's allocator could hand their memory to current-stream work
    while a default-stream kernel still reads it."""

    __slots__ = ("index", "other")

    def __init__(self, index):
        self.index = index

    def __enter__(self):
        self.other = torch._C._cuda_getCurrentRawStream(self.index) != 0  # 0: default
        if self.other:
            torch.cuda.default_stream(self.index).wait_stream(torch.cuda.current_stream())
        return self

    def __exit__(self, *exc):
        if self.other:
            torch.cuda.current_stream().wait_stream(torch.cuda.default_stream(self.index))


class State:
    """What the backward needs: per window the addresses of the targets and of the saved
    multipliers, and `buffers`, which holds the tensors at those addresses."""

    __slots__ = ("plan", "config", "targets", "wide", "saved", "with_entropy", "inv_tau",
                 "buffers")

    def __init__(self, plan, config, targets, wide, saved, with_entropy, inv_tau, buffers):
        self.plan, self.config, self.targets, self.wide = plan, config, targets, wide
        self.saved, self.with_entropy, self.inv_tau = saved, with_entropy, inv_tau
        self.buffers = buffers


_JAX_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# From this many logits per row window on, the target's logit (and mask bit) are
# gathered by torch (2-4 small ops, +160-220 µs of host time per call on the H200 host) instead
# of tested for in every element of the partials kernel (+134 µs of GPU time per call
# at T = 8192, V = 151,936 bf16; docs/performance.md, "The bridge: host cost and the
# direct route").
GATHER_TARGET_FROM = 2**28


def _target_ids(plan) -> tuple[torch.Tensor, bool]:
    """(ids [T], contiguous -- the kernels read b consecutive ids per window --, whether
    they are int64: the kernels then read each as two int32 words, `wide_targets`)."""
    if plan.target_mode == "i64":
        return plan.raw_targets.view(torch.int64), True
    return plan.raw_targets.contiguous(), False


def _config(plan) -> MosaicConfig:
    return plan.config if isinstance(plan.config, MosaicConfig) else MosaicConfig()


def _rows_ptr(t: torch.Tensor, w, keep: list) -> int:
    """Address of row `w.start` of a contiguous tensor, without making a view (host
    time per call counts here). An O(T) vector's window that does not start on a
    16-byte boundary (TMA's requirement) is copied; the [T, V] operands' windows always
    do (`_windows.row_align`)."""
    ptr = t.data_ptr() + w.start * t.stride(0) * t.element_size()
    if ptr % 16:
        copy = t[w.start:w.start + w.size].clone()
        keep.append(copy)
        ptr = copy.data_ptr()
    return ptr


def _big_pointers(plan, w, keep) -> list:
    """Addresses of window w's [b, V] operands: logits (and the mask, bool as bytes)."""
    pointers = [_rows_ptr(plan.logits, w, keep)]
    if plan.mask is not None:
        pointers.append(_rows_ptr(plan.mask, w, keep))
    return pointers


def forward(plan, inv_tau: float, with_entropy: bool):
    """-> (outputs [n_out][T] float32, State): log_prob and (with_entropy) entropy."""
    config = _config(plan)
    masked = plan.mask is not None
    device = plan.logits.device
    ids, wide = _target_ids(plan)
    dtype = _JAX_DTYPES[plan.logits.dtype]
    # Per window size, so that each size always uses the same kernels (bounded compiles).
    gathers = [w.size * plan.num_vocab >= GATHER_TARGET_FROM for w in plan.windows]
    extra = []  # [T] float32: the target's raw logit (and mask bit), gathered by torch
    if any(gathers):
        index = ids.long().clamp(0, plan.num_vocab - 1).unsqueeze(1)  # valid rows: the id
        extra.append(plan.logits.gather(1, index).view(-1).float())
        if masked:
            extra.append(plan.mask.gather(1, index).view(-1).float())
    pieces, targets, saved = [], [], []
    keep = []  # temporaries live until the fence at the end (see _OnDefaultStream)
    with _OnDefaultStream(device.index):
        for w, gathered in zip(plan.windows, gathers):
            kernels = _window_forward(w.size, plan.num_vocab, dtype, masked, with_entropy,
                                      inv_tau, config, gathered, wide)
            buffer = torch.empty(kernels.buffer_shape, dtype=torch.float32, device=device)
            keep.append(buffer)
            base = buffer.data_ptr()
            out_ptrs = [base + offset for offset in kernels.out_offsets]
            t_ptr = _rows_ptr(ids, w, keep)
            pointers = _big_pointers(plan, w, keep)
            if not gathered:
                pointers.append(t_ptr)
            if kernels.single:
                _launcher(kernels.kernel, kernels.operands, device)(pointers + out_ptrs)
            else:
                part_ptrs = [base + offset for offset in kernels.part_offsets]
                _launcher(kernels.partials, kernels.partials_operands, device)(
                    pointers + part_ptrs)
                extra_ptrs = [_rows_ptr(e, w, keep) for e in extra] if gathered else []
                _launcher(kernels.finish, kernels.finish_operands, device)(
                    part_ptrs + [t_ptr] + extra_ptrs + out_ptrs)
            pieces.append(buffer[:1 + with_entropy])
            saved.append(out_ptrs[1 + with_entropy:])
            targets.append(t_ptr)
    outputs = _assemble(plan, pieces, 1 + with_entropy)
    # The state keeps every buffer its pointers point into.
    return outputs, State(plan, config, targets, wide, saved, with_entropy, inv_tau,
                          (keep, ids))


def _assemble(plan, pieces, n_out):
    """Per-window [n_out, padded] -> [n_out][T] (views where one window covers T)."""
    num_tokens = plan.num_tokens
    if len(pieces) == 1:
        return [pieces[0][k, :num_tokens] for k in range(n_out)]
    out = pieces[0].new_empty((n_out, num_tokens))
    for w, piece in zip(plan.windows, pieces):
        out[:, w.start + w.skip:w.start + w.size] = piece[:, w.skip:w.size]
    return out


_placeholders: dict = {}  # device index -> int32 [1], the backward's unwritten output


def backward(state: State, d_log_prob, d_entropy, entropy_grad: bool) -> torch.Tensor:
    """d loss / d logits [T, V_loc] in the logits' dtype, written by the kernels into a
    torch-allocated tensor."""
    plan = state.plan
    masked = plan.mask is not None
    device = plan.logits.device
    has_d_entropy = d_entropy is not None and state.with_entropy and entropy_grad
    dtype = _JAX_DTYPES[plan.logits.dtype]
    grads = [g.float().contiguous() for g in (d_log_prob, d_entropy if has_d_entropy else None)
             if g is not None]
    grad = torch.empty_like(plan.logits)
    placeholder = _placeholders.get(device.index)
    if placeholder is None:
        placeholder = _placeholders[device.index] = torch.empty(1, dtype=torch.int32,
                                                                device=device)
    keep = []  # temporaries live until the fence at the end (see _OnDefaultStream)
    with _OnDefaultStream(device.index):
        for w, t_ptr, saved_ptrs in zip(plan.windows, state.targets, state.saved):
            kernel = _backward_kernel(w.size, plan.num_vocab, dtype, masked,
                                      state.with_entropy, entropy_grad,
                                      d_log_prob is not None, has_d_entropy, state.inv_tau,
                                      state.wide, state.config)
            pointers = _big_pointers(plan, w, keep)
            pointers += ([t_ptr] + saved_ptrs + [_rows_ptr(g, w, keep) for g in grads]
                         + [_rows_ptr(grad, w, keep), placeholder.data_ptr()])
            structs = _backward_operands(w.size, plan.num_vocab, dtype, masked, state.wide,
                                         len(saved_ptrs), len(grads))
            _launcher(kernel, structs, device)(pointers)
    del keep
    return grad
