"""The direct route's plumbing on CPU (`bridge/_direct.py`). The launches need a Hopper
GPU (tests/bridge/test_bridge_direct.py); here fake launchers stand in:
- one traces each kernel: every launch hands over as many 16-byte-aligned buffers as
  its kernel declares, with the shapes and dtypes it is traced for, in every
  configuration (mask, entropy, flags, several row windows, the target gathered by
  torch or found in the kernel);
- one runs each kernel in Mosaic GPU's interpret mode on the memory at the given
  addresses: the route end to end through `bridge.logprob_entropy` against float64,
  which fails if an offset or a window is wrong (checked by breaking them)."""

from __future__ import annotations

import contextlib
import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import bridge
from bridge import _direct, _run
from jaxops.backends.mosaic import common as mosaic_common
from jaxops.backends.mosaic.config import MosaicConfig

# The direct kernels store into buffers their caller owns, which jax 0.12 refuses to
# lower (`mosaic_common.STORES_INTO_INPUTS`): there the route is off.
needs_input_stores = pytest.mark.skipif(
    not mosaic_common.STORES_INTO_INPUTS,
    reason=f"jax {jax.__version__} lowers no store into an input: the direct route is off")

md = pytest.importorskip("jaxops.backends.mosaic.direct")


@pytest.fixture
def launches(monkeypatch):
    seen = []

    def fake_launcher(kernel, operands, device):
        structs = [jax.ShapeDtypeStruct(tuple(op[:-1]), op[-1]) for op in operands]
        out_info = jax.jit(kernel).trace(*structs).out_info  # raises on a wrong operand
        num_outputs = len(out_info) if isinstance(out_info, (list, tuple)) else 1

        def launch(pointers):
            assert len(pointers) == len(structs) + num_outputs, (len(pointers), structs)
            assert all(isinstance(p, int) and p % 16 == 0 for p in pointers), pointers
            seen.append(len(structs))
        return launch

    monkeypatch.setattr(_direct, "_launcher", fake_launcher)
    monkeypatch.setattr(_direct, "_OnDefaultStream", lambda index: contextlib.nullcontext())
    return seen


@needs_input_stores
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("with_entropy, entropy_grad", [(True, True), (True, False),
                                                        (False, False)])
@pytest.mark.parametrize("num_tokens, gather_from", [(16, 2**62), (3001, 0), (3001, 2**21)])
@pytest.mark.parametrize("V", [1024, 8192], ids=["one_chunk", "chunks"])
def test_every_launch_matches_its_kernel(masked, with_entropy, entropy_grad, num_tokens,
                                         gather_from, V, launches, monkeypatch):
    # 2**21: mixed windows (small ones find the target in the kernel, large ones not)
    monkeypatch.setattr(_direct, "GATHER_TARGET_FROM", gather_from)
    x = torch.randn(num_tokens, V)
    y = torch.randint(0, V, (num_tokens,))
    mask = torch.rand(num_tokens, V) < 0.2 if masked else None
    plan = _run.Plan(x, y, mask, "pallas_mosaic")
    outputs, state = _direct.forward(plan, 1.0, with_entropy)
    # One kernel for a window whose vocabulary is one chunk and whose target is found in
    # the kernel, two (partials, finish) otherwise.
    one_chunk = V == 1024
    assert md.one_pass(V, "float32", masked) == one_chunk
    single = [one_chunk and w.size * V < gather_from for w in plan.windows]
    assert len(launches) == sum(1 if one else 2 for one in single)
    assert tuple(outputs[0].shape) == (num_tokens,)
    for d_lp, d_h in [(torch.randn(num_tokens), torch.randn(num_tokens)),
                      (None, torch.randn(num_tokens)), (torch.randn(num_tokens), None)]:
        if d_h is not None and not (with_entropy and entropy_grad):
            d_h = None
        if d_lp is None and d_h is None:
            continue
        grad = _direct.backward(state, d_lp, d_h, entropy_grad)
        assert grad.shape == x.shape and grad.dtype == x.dtype


@needs_input_stores
def test_strided_targets_and_broadcast_cotangents(launches):
    """Targets that are a strided view and cotangents that are one expanded scalar (what
    `loss.sum()` hands back) reach the kernels as contiguous, aligned vectors."""
    T, V = 37, 1024
    x = torch.randn(T, V)
    y = torch.randint(0, V, (2 * T,))[::2]
    plan = _run.Plan(x, y, None, "pallas_mosaic")
    _, state = _direct.forward(plan, 1.0, True)
    ones = torch.ones(1).expand(T)
    grad = _direct.backward(state, ones, ones, True)
    # one forward kernel (V = 1024 is one vocabulary chunk) and the backward, per window
    assert grad.shape == x.shape and len(launches) == 2 * len(plan.windows)


# --- end to end on CPU: the launches run the kernels in interpret mode -------------------

def _array_at(pointer, shape, dtype):
    """The numpy array that lives at `pointer` (a CPU torch tensor's memory)."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    raw = (ctypes.c_char * size).from_address(pointer)
    return np.frombuffer(raw, dtype=np.uint8).view(dtype).reshape(shape)


@pytest.fixture
def interpreted(monkeypatch):
    """Launches that run each kernel in Mosaic GPU's interpret mode on the buffers at
    the given addresses: the direct route end to end on CPU, pointers and all. The
    backward kernel stores through an input on the GPU; here its JAX form (`into=False`)
    runs and its result is copied to the gradient's address."""

    def backward_kernel(*args):
        return ("backward", args)

    def fake_launcher(kernel, operands, device):
        shapes = [(op[:-1], jnp.dtype(op[-1])) for op in operands]

        def launch(pointers):
            inputs = [jnp.asarray(_array_at(p, s, d)) for p, (s, d) in zip(pointers, shapes)]
            if isinstance(kernel, tuple):  # the backward: grad is the last input
                (num_tokens, num_vocab, dtype, masked, with_entropy, entropy_grad,
                 has_d_log_prob, has_d_entropy, inv_tau, wide, config) = kernel[1]
                fn = md.backward_kernel(
                    num_tokens, num_vocab, dtype, masked=masked, with_entropy=with_entropy,
                    entropy_grad=entropy_grad, has_d_log_prob=has_d_log_prob,
                    has_d_entropy=has_d_entropy, inv_tau=inv_tau, wide_targets=wide,
                    config=config, into=False)
                grad = np.asarray(fn(*inputs[:-1]))[:num_tokens, :num_vocab]
                _array_at(pointers[len(shapes) - 1], *shapes[-1])[...] = grad
                return
            outs = kernel(*inputs)
            outs = outs if isinstance(outs, (list, tuple)) else [outs]
            for p, out in zip(pointers[len(shapes):], outs):
                out = np.asarray(out)
                _array_at(p, out.shape, out.dtype)[...] = out
        return launch

    monkeypatch.setattr(_direct, "_launcher", fake_launcher)
    monkeypatch.setattr(_direct, "_backward_kernel", backward_kernel)
    monkeypatch.setattr(_direct, "_OnDefaultStream", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(_direct, "applies", lambda plan, world, want_stats: (
        world == 1 and not want_stats and plan.implementation == "pallas_mosaic"))


@needs_input_stores
@pytest.mark.parametrize("num_tokens, masked, gather_from, chunk_v, dtype, ids", [
    (70, True, 2**62, 384, torch.float32, torch.int64),
    (70, False, 0, 384, torch.float32, torch.int64),
    (300, True, 2**16, 384, torch.float32, torch.int64),
    (5, False, 2**62, 384, torch.float32, torch.int64),
    (70, True, 2**62, 1024, torch.float32, torch.int64),
    (300, False, 2**62, 1024, torch.float32, torch.int64),
    (70, True, 2**62, 384, torch.bfloat16, torch.int64),
    (70, True, 0, 1024, torch.float16, torch.int64),
    (70, True, 2**62, 384, torch.float32, torch.int32),
    (300, False, 2**62, 1024, torch.bfloat16, torch.int32)])
def test_direct_route_end_to_end_in_interpret_mode(num_tokens, masked, gather_from, chunk_v,
                                                   dtype, ids, interpreted, monkeypatch):
    """Through `bridge.logprob_entropy` (eager autograd) against the float64 reference:
    every pointer, offset and window of the route, with the kernels interpreted; int64
    ids read in place as word pairs, int32 ids as they are."""
    monkeypatch.setattr(_direct, "GATHER_TARGET_FROM", gather_from)
    monkeypatch.setattr(_run.Plan, "__init__", _cuda_like_plan(_run.Plan.__init__))
    # V = 640 is five 128-column tiles: several vocabulary chunks at chunk_v = 384 (the
    # partials' offsets), one at 1024 (the single-kernel forward).
    monkeypatch.setattr(_direct, "_config", lambda plan: MosaicConfig(interpret=True,
                                                                      chunk_v=chunk_v))
    import _bridge_scenarios as S

    V, tau = 640, 0.8
    gen = torch.Generator().manual_seed(num_tokens)
    x = (torch.randn(num_tokens, V, generator=gen) * 3).to(dtype).requires_grad_()
    y = torch.randint(0, V, (num_tokens,), generator=gen).to(ids)
    mask = torch.rand(num_tokens, V, generator=gen) < 0.2 if masked else None
    g_lp, g_h = torch.randn(num_tokens, generator=gen), torch.randn(num_tokens, generator=gen)
    calls = []
    forward = _direct.forward
    monkeypatch.setattr(_direct, "forward", lambda *a: calls.append(1) or forward(*a))
    lp, h = bridge.logprob_entropy(x, y, keep_mask=mask, temperature=tau,
                                   implementation="pallas_mosaic")
    (grad,) = torch.autograd.grad([lp, h], x, [g_lp, g_h])
    assert calls, "the direct route was not taken"
    xr = x.detach().double().requires_grad_()
    lp_r, h_r = S.reference(xr, y, mask, tau)
    (g_r,) = torch.autograd.grad([lp_r, h_r], xr, [g_lp.double(), g_h.double()])
    scale = max(1.0, float(x.detach().abs().max()) / tau)
    assert float((lp.double() - lp_r).abs().max()) <= 1e-5 * scale
    assert float((h.double() - h_r).abs().max()) <= 1e-5 * scale
    assert grad.dtype == dtype
    assert S.rel_err(grad, g_r) <= S.grad_tol(str(dtype).removeprefix("torch."))


def _cuda_like_plan(init):
    """Plan.__init__ that resolves "pallas_mosaic" in interpret mode on CPU, as on CUDA
    (where the direct route is taken) -- `_run.forward` asks `plan.dev.cuda` first."""
    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        object.__setattr__(self, "dev", _CudaFlag(self.dev))
    return patched


class _CudaFlag:
    """The CPU device record with `cuda` reading True (only `_run.forward`'s gate asks)."""

    def __init__(self, dev):
        self._dev = dev

    def __getattr__(self, name):
        return True if name == "cuda" else getattr(self._dev, name)


def test_which_calls_take_the_direct_route(monkeypatch):
    """`_direct.applies`: calls whose kernels are the Mosaic ones ("pallas" where the
    policy picks them, or "pallas_mosaic" named) on one shard in eager mode, where the
    kernels take the shape; the Triton kernels, a group of several ranks, the
    torch.compile route (which needs the statistics) and shapes the kernels refuse go
    through JAX. (`ready()`, the sm_90+ Mosaic GPU check, is faked here.)"""
    from types import SimpleNamespace as NS

    monkeypatch.setattr(_direct, "ready", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(mosaic_common, "STORES_INTO_INPUTS", True)  # any JAX here

    def plan(implementation, num_vocab=151936, masked=False, cuda=True):
        logits = NS(device=NS(index=0), element_size=lambda: 2)
        return NS(dev=NS(cuda=cuda), implementation=implementation, config=None,
                  logits=logits, num_vocab=num_vocab, mask=object() if masked else None)

    assert _direct.applies(plan("pallas_mosaic"), 1, False)
    assert _direct.applies(plan("pallas_mosaic", masked=True), 1, False)
    assert _direct.applies(plan("pallas_mosaic", num_vocab=18992), 1, False)
    # The policy's Triton pick (older GPUs, a V_loc TMA cannot tile) keeps its kernels.
    assert not _direct.applies(plan("pallas_triton", num_vocab=18992), 1, False)
    assert not _direct.applies(plan("pallas_mosaic"), 2, False)
    assert not _direct.applies(plan("pallas_mosaic"), 1, True)
    assert not _direct.applies(plan("pallas_mosaic", num_vocab=1001), 1, False)
    assert not _direct.applies(plan("xla", cuda=False), 1, False)
    # A JAX that refuses stores into inputs (0.12) has no direct route.
    monkeypatch.setattr(mosaic_common, "STORES_INTO_INPUTS", False)
    assert not _direct.applies(plan("pallas_mosaic"), 1, False)


def test_pallas_runs_the_policys_kernels_on_every_route(monkeypatch):
    """The bridge's "pallas" is jaxops' policy (`registry.for_call`), whatever the
    route: where the JAX op picks Mosaic (Hopper, faked here) the
    route through JAX (several ranks, torch.compile) runs Mosaic too, a bool mask handed
    over as its bytes; the Mosaic backward can write into torch's gradient as the Triton
    one does (`can_write_into`, where `IN_PLACE_GRADIENT`). A named "pallas_triton" keeps
    the Triton kernels."""
    from jaxops.backends import registry
    from jaxops.backends.mosaic import kernels as mosaic_kernels

    real_for_call = registry.for_call

    def hopper(name, config, pallas_config=None, **kw):
        if name == "pallas":
            return "pallas_mosaic", MosaicConfig()
        return real_for_call(name, config, pallas_config, **kw)

    monkeypatch.setattr(registry, "for_call", hopper)
    real_device = _run._dlpack.device
    monkeypatch.setattr(_run._dlpack, "device", lambda d: _CudaFlag(real_device(d)))
    x, y = torch.randn(3, 64), torch.randint(0, 64, (3,))
    mask = torch.rand(3, 64) < 0.5
    plan = _run.Plan(x, y, mask, None)
    assert plan.implementation == "pallas_mosaic" and isinstance(plan.config, MosaicConfig)
    assert plan.mask.dtype == torch.uint8
    assert hasattr(mosaic_kernels, "can_write_into")
    named = _run.Plan(x, y, mask, "pallas_triton")
    assert named.implementation == "pallas_triton" and named.mask.dtype == torch.bool
