"""CUDA tests of the PyTorch bridge (skipped without a CUDA device).

The CPU scenario matrix (tests/bridge/_bridge_scenarios.py) on one GPU with the Pallas kernels,
against the float64 reference and Megatron-core; CUDA stream ordering without host
synchronisation; zero copy; the memory policy; torch.compile and opcheck on CUDA; and a
TP = 2 NCCL group when two GPUs are present.

Run with XLA_PYTHON_CLIENT_PREALLOCATE=false in the environment: tests/conftest.py starts
JAX before any test module can import the bridge.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

import bridge  # noqa: E402
from bridge import _dlpack, _engine, op  # noqa: E402

import _bridge_scenarios as S  # noqa: E402
from _bridge_spawn import one_rank_group, spawn  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUDA = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def nccl_group():
    """A one-rank NCCL group (Megatron needs a group; the bridge then runs no collective)."""
    torch.cuda.set_device(CUDA)
    with one_rank_group("nccl", timeout_s=120) as group:
        yield group


@pytest.fixture(scope="module")
def megatron():
    return S.load_megatron()


@pytest.mark.parametrize("sc", S.scenarios(full=True), ids=lambda sc: sc.name)
def test_cuda_tp1(sc, nccl_group, megatron):
    """The default implementation: on sm_90+ the direct route (`bridge/_direct.py`)."""
    S.run_scenario(sc, group=nccl_group, meg_group=nccl_group, rank=0, world=1,
                   device=CUDA, megatron=megatron)


@pytest.mark.parametrize("sc", [sc for sc in S.scenarios(full=True) if sc.api != "slime"],
                         ids=lambda sc: sc.name)
def test_cuda_tp1_through_jax(sc, nccl_group, megatron):
    """The same scenarios through JAX (the Triton kernels): the route of GPUs before
    Hopper and of process groups of more than one rank."""
    S.run_scenario(sc, group=nccl_group, meg_group=nccl_group, rank=0, world=1,
                   device=CUDA, megatron=megatron, implementation="pallas_triton")


def test_default_takes_the_direct_route():
    """On sm_90+ the default ("pallas") launches the Mosaic kernels from torch, also at
    a V_loc where the JAX op would pick the Triton kernels (bridge/_direct.py)."""
    from bridge import diagnostics

    if torch.cuda.get_device_capability(CUDA) < (9, 0):
        pytest.skip("the direct route needs sm_90+")
    x = torch.randn(24, 18992, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, 18992, (24,), device=CUDA)
    launchers, programs = diagnostics.compiled_launchers(), diagnostics.compiled_programs()
    lp, h = bridge.logprob_entropy(x, y)
    torch.autograd.grad([lp, h], x, [torch.ones_like(lp), torch.ones_like(h)])
    new_launchers = diagnostics.compiled_launchers() - launchers
    assert new_launchers > 0
    assert diagnostics.compiled_programs() - programs == new_launchers  # no JAX program


def test_cuda_uses_pallas_and_fast_dlpack():
    x = torch.randn(4, 100, device=CUDA)
    y = torch.randint(0, 100, (4,), device=CUDA)
    bridge.logprob_entropy(x, y)
    dev = _dlpack.device(CUDA)
    assert dev.fast, "JAX's DLPack fast path is not in use on CUDA"
    # V = 100: rows of 200/400 bytes, which TMA cannot tile: the Triton kernels on any GPU.
    assert _engine.implementation_for("", dev, num_vocab=100, itemsize=4)[0] == "pallas_triton"
    assert dev.jax_device.platform == "gpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_large_vocab(dtype):
    """Qwen-sized vocabulary, masked, temperature: against float64 on the GPU."""
    gen = torch.Generator(device=CUDA).manual_seed(3)
    T, V = 64, 151936
    x = (torch.randn(T, V, device=CUDA, generator=gen) * 3).to(dtype).requires_grad_()
    y = torch.randint(0, V, (T,), device=CUDA, generator=gen)
    mask = torch.rand(T, V, device=CUDA, generator=gen) < 0.01
    g1, g2 = torch.randn(T, device=CUDA), torch.randn(T, device=CUDA)
    lp, h = bridge.logprob_entropy(x, y, keep_mask=mask, temperature=0.9)
    (g,) = torch.autograd.grad([lp, h], x, [g1, g2])
    xr = x.detach().double().requires_grad_()
    lp_r, h_r = S.reference(xr, y, mask, 0.9)
    (g_r,) = torch.autograd.grad([lp_r, h_r], xr, [g1.double(), g2.double()])
    scale = max(1.0, float(x.detach().float().abs().max()) / 0.9)
    assert float((lp.double() - lp_r).abs().max()) <= 1e-5 * scale
    assert float((h.double() - h_r).abs().max()) <= 1e-5 * scale
    assert S.rel_err(g, g_r) <= S.grad_tol(str(dtype).replace("torch.", ""))


@pytest.mark.parametrize("impl", ["pallas", "pallas_triton"])
def test_stream_ordering_without_host_sync(impl):
    """On a side stream: logits written at the end of a long GPU chain, the bridge called
    at once, its outputs consumed and its input overwritten right after -- no sync in
    between. Any missing stream dependency reads or writes the wrong values."""
    T, V = 16, 4000
    gen = torch.Generator(device=CUDA).manual_seed(0)
    base = torch.randn(T, V, device=CUDA, generator=gen)
    y = torch.randint(0, V, (T,), device=CUDA, generator=gen)
    g = torch.randn(T, device=CUDA, generator=gen)
    # compile the JAX functions for these shapes first
    warm = base.clone().requires_grad_()
    torch.autograd.grad(bridge.logprob_entropy(warm, y, implementation=impl)[0], warm, g)
    lp_r, h_r = S.reference(base.double(), y, None, 1.0)
    torch.cuda.synchronize()

    side = torch.cuda.Stream(device=CUDA)
    with torch.cuda.stream(side):
        x = torch.full((T, V), 1e4, device=CUDA)  # wrong values, visible if read early
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the real values land
        with torch.no_grad():
            x.copy_(base)
        x.requires_grad_()
        lp, h = bridge.logprob_entropy(x, y, check_targets=False, implementation=impl)
        lp_used, h_used = lp * 1.0, h * 1.0  # torch reads JAX's outputs immediately
        (d,) = torch.autograd.grad(lp, x, g)
        d_used = d * 1.0
        with torch.no_grad():
            x.fill_(float("nan"))  # must not reach JAX's backward, which read x before
    torch.cuda.synchronize()
    assert float((lp_used.double() - lp_r).abs().max()) < 1e-4
    assert float((h_used.double() - h_r).abs().max()) < 1e-4
    xr = base.double().requires_grad_()
    (d_r,) = torch.autograd.grad(S.reference(xr, y, None, 1.0)[0], xr, g.double())
    assert torch.isfinite(d_used).all() and S.rel_err(d_used, d_r) < 1e-5


@pytest.mark.parametrize("impl", ["pallas", "pallas_triton"])
def test_no_host_synchronisation(impl):
    """With check_targets=False a forward+backward returns to the host while the GPU is
    still busy with earlier work: nothing in the bridge (torch or JAX side) waits."""
    T, V = 32, 32000
    x = torch.randn(T, V, device=CUDA, requires_grad=True)
    y = torch.randint(0, V, (T,), device=CUDA)
    g = torch.randn(T, device=CUDA)
    for _ in range(2):  # compile + warm
        torch.autograd.grad(bridge.logprob_entropy(x, y, check_targets=False,
                                                   implementation=impl), x, [g, g])
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time queued ahead of the bridge
    t0 = time.perf_counter()
    lp, h = bridge.logprob_entropy(x, y, check_targets=False, implementation=impl)
    torch.autograd.grad([lp, h], x, [g, g])
    host = time.perf_counter() - t0
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    gpu_left = time.perf_counter() - t1
    # The host's time first: a sync (or a compile) leaves the GPU idle by the time it
    # returns, so the second check alone would call the test void.
    assert host < 0.05, (f"the bridge blocked the host for {host:.3f} s (a device sync or "
                         f"a compile; the GPU had {gpu_left:.3f} s left)")
    assert gpu_left > 0.05, f"the GPU was idle already ({gpu_left:.3f} s): test is void"
    # and the check does synchronise (so this test can tell the difference)
    torch.cuda._sleep(1_000_000_000)
    t0 = time.perf_counter()
    bridge.logprob_entropy(x, y, check_targets=True, implementation=impl)
    assert time.perf_counter() - t0 > 0.05
    torch.cuda.synchronize()


@pytest.mark.parametrize("impl", ["pallas", "pallas_triton"])
def test_torch_sync_debug_mode_sees_no_sync(impl):
    """Fresh targets every call (as in training), varying T (row windows, overlapping
    ones included), a mask, the slime drop-in: torch sees no synchronisation."""
    V = 1024
    calls = [(8, False), (13, True), (300, False), (1000, True), (8, True), (13, False)]
    for T, masked in calls:  # compile outside the check
        x = torch.randn(T, V, device=CUDA, requires_grad=True)
        mask = torch.rand(T, V, device=CUDA) < 0.3 if masked else None
        lp, h = bridge.logprob_entropy(x, torch.randint(0, V, (T,), device=CUDA),
                                       keep_mask=mask, implementation=impl)
        torch.autograd.grad([lp, h], x, [torch.ones_like(lp), torch.ones_like(h)])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for T, masked in calls:
            x = torch.randn(T, V, device=CUDA, requires_grad=True)
            y = torch.randint(0, V, (T,), device=CUDA)  # a new tensor every call
            mask = torch.rand(T, V, device=CUDA) < 0.3 if masked else None
            lp, h = bridge.logprob_entropy(x, y, keep_mask=mask, implementation=impl)
            torch.autograd.grad([lp, h], x, [torch.ones_like(lp), torch.ones_like(h)])
            lp2, h2 = bridge.calculate_log_probs_and_entropy(
                x, y, None, with_entropy=True, log_prob_keep_mask=mask)
            torch.autograd.grad([lp2.sum(), h2.sum()], x)
        with pytest.raises(RuntimeError, match="synchroniz"):
            bridge.logprob_entropy(x, y, check_targets=True,  # the opt-in check syncs
                                   implementation=impl)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("impl", ["pallas", "pallas_triton"])
def test_varying_t_bounded_compiles_and_exact(impl):
    """A loop whose T changes every call compiles a bounded set of programs (one per
    power-of-two window size, forward and backward), and every call is right."""
    from bridge import _jaxfns

    gen = torch.Generator(device=CUDA).manual_seed(7)
    V, t_max = 2048, 3000
    sizes = torch.randint(1, t_max + 1, (60,), generator=torch.Generator().manual_seed(7))
    before = _jaxfns.compiled_programs()  # the direct route's launchers included
    for i, T in enumerate(sizes.tolist()):
        x = (torch.randn(T, V, device=CUDA, generator=gen) * 3).to(torch.bfloat16)
        x.requires_grad_()
        y = torch.randint(0, V, (T,), device=CUDA, generator=gen)
        g1, g2 = torch.randn(T, device=CUDA), torch.randn(T, device=CUDA)
        lp, h = bridge.logprob_entropy(x, y, temperature=0.9, implementation=impl)
        (g,) = torch.autograd.grad([lp, h], x, [g1, g2])
        xr = x.detach().double().requires_grad_()
        lp_r, h_r = S.reference(xr, y, None, 0.9)
        (g_r,) = torch.autograd.grad([lp_r, h_r], xr, [g1.double(), g2.double()])
        scale = max(1.0, float(x.detach().float().abs().max()) / 0.9)
        assert float((lp.double() - lp_r).abs().max()) <= 1e-5 * scale, (i, T)
        assert float((h.double() - h_r).abs().max()) <= 1e-5 * scale, (i, T)
        assert S.rel_err(g, g_r) <= S.grad_tol("bfloat16"), (i, T)
    new = _jaxfns.compiled_programs() - before
    # Window sizes 1 .. 2**11, forward and backward; the direct route compiles up to two
    # forward kernels per window size (partials and finish).
    bound = (3 if impl == "pallas" else 2) * (t_max.bit_length() + 1)
    assert 0 < new <= bound, f"{new} programs compiled for 60 calls (bound {bound})"


def test_gradient_lives_in_torchs_cache_and_jax_holds_o_of_t():
    """torch's cache holds nearly all free GPU memory (allocated, freed, kept cached);
    the bridge then runs at a size whose gradient fits only in that cache. No OOM,
    the gradient is torch's, and what JAX holds afterwards is O(T)."""
    code = """
import bridge, torch
T, V = 8192, 151936
x = torch.randn(T, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
y = torch.randint(0, V, (T,), device="cuda")
free, total = torch.cuda.mem_get_info()
filler = torch.empty(free - (1 << 30), dtype=torch.uint8, device="cuda")  # leave 1 GiB
del filler  # freed to torch's cache, not to the GPU
torch.cuda.reset_peak_memory_stats()
free_outside, _ = torch.cuda.mem_get_info()
grad_bytes = x.numel() * x.element_size()
assert grad_bytes > free_outside, (grad_bytes, free_outside)
for _ in range(3):
    lp, h = bridge.logprob_entropy(x, y)
    (g,) = torch.autograd.grad([lp, h], x, [torch.ones_like(lp), torch.ones_like(h)])
    torch.cuda.synchronize()
    assert torch.isfinite(g.float().sum())
d = bridge._dlpack.device(x.device).jax_device
s = d.memory_stats() or {}
pool = s.get("pool_bytes", s.get("bytes_reserved", 0))
print(grad_bytes, free_outside, pool, torch.cuda.max_memory_allocated())
"""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    grad_bytes, free_outside, pool, torch_peak = (int(v) for v in proc.stdout.split()[-4:])
    print(f"gradient {grad_bytes / 2**30:.2f} GiB, free outside torch's cache "
          f"{free_outside / 2**30:.2f} GiB, JAX pool after 3 calls {pool / 2**20:.1f} MiB, "
          f"torch peak allocated {torch_peak / 2**30:.2f} GiB")
    assert pool < 64 * 2**20, f"JAX holds {pool / 2**20:.0f} MiB after the calls (want O(T))"
    assert torch_peak >= 2 * grad_bytes, "torch's allocator did not see the gradient"


def test_cuda_large_call_rows_match_reference():
    """T = 16,384, V = 151,936 (2.49e9 elements per [T, V] operand) through the bridge,
    masked, bf16: first, middle and last rows and those around 2**31 / V."""
    gen = torch.Generator(device=CUDA).manual_seed(11)
    T, V, tau = 16_384, 151_936, 0.9
    x = (torch.randn(T, V, device=CUDA, generator=gen) * 3).to(torch.bfloat16)
    x.requires_grad_()
    y = torch.randint(0, V, (T,), device=CUDA, generator=gen)
    mask = torch.rand(T, V, device=CUDA, generator=gen) < 0.3
    g1, g2 = torch.randn(T, device=CUDA), torch.randn(T, device=CUDA)
    lp, h = bridge.logprob_entropy(x, y, keep_mask=mask, temperature=tau)
    (g,) = torch.autograd.grad([lp, h], x, [g1, g2])
    rows = torch.tensor([0, 1, T // 2, 14_133, 14_134, 14_135, T - 2, T - 1], device=CUDA)
    xr = x.detach()[rows].double().requires_grad_()
    lp_r, h_r = S.reference(xr, y[rows], mask[rows], tau)
    (g_r,) = torch.autograd.grad([lp_r, h_r], xr, [g1[rows].double(), g2[rows].double()])
    scale = max(1.0, float(xr.detach().abs().max()) / tau)
    assert float((lp[rows].double() - lp_r).abs().max()) <= 1e-5 * scale
    assert float((h[rows].double() - h_r).abs().max()) <= 1e-5 * scale
    for i in range(len(rows)):
        assert S.rel_err(g[rows[i]], g_r[i]) <= S.grad_tol("bfloat16"), int(rows[i])


def test_cuda_zero_copy(monkeypatch):
    """Through JAX (the route of multi-rank groups): DLPack hands over, no copies."""
    x = torch.randn(8, 512, device=CUDA, requires_grad=True)
    y = torch.randint(0, 512, (8,), device=CUDA)
    seen = []
    to_jax, to_torch = _dlpack.Transfer.to_jax, _dlpack.Transfer.to_torch
    monkeypatch.setattr(_dlpack.Transfer, "to_jax", lambda self, t: seen.append(
        ("in", t.data_ptr(), (a := to_jax(self, t)).unsafe_buffer_pointer(), t.shape)) or a)
    monkeypatch.setattr(_dlpack.Transfer, "to_torch", lambda self, a: seen.append(
        ("out", a.unsafe_buffer_pointer(), (t := to_torch(self, a)).data_ptr(), t.shape)) or t)
    lp, h = bridge.logprob_entropy(x, y, implementation="pallas_triton")
    (g,) = torch.autograd.grad(lp.sum(), x)
    assert all(src == dst for _, src, dst, _ in seen), seen
    assert any(k == "in" and p == x.data_ptr() for k, p, _, _ in seen)
    # the gradient is torch's tensor, handed to JAX for the kernel to write in place
    assert any(k == "in" and p == g.data_ptr() and shape == g.shape
               for k, p, _, shape in seen), seen


def test_cuda_torch_compile_and_opcheck():
    torch._dynamo.reset()
    x = torch.randn(6, 300, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, 300, (6,), device=CUDA)
    mask = torch.rand(6, 300, device=CUDA) < 0.2

    def loss(x, y, mask):
        lp, h = bridge.logprob_entropy(x, y, keep_mask=mask, temperature=0.8)
        return (lp * 0.5).sum() + h.sum()

    c = torch.compile(loss, fullgraph=True)(x, y, mask)
    (cg,) = torch.autograd.grad(c, x)
    e = loss(x, y, mask)
    (eg,) = torch.autograd.grad(e, x)
    torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cg, eg)  # bf16 tolerances: same kernels, same cotangents
    torch.library.opcheck(op.logprob_entropy_fwd,
                          (x, y, mask, 1.25, True, True, "", "", 0, 1))


def test_cuda_memory_policy_fresh_process():
    """Bridge imported first: JAX starts on torch's GPU only, without preallocating."""
    code = """
import bridge, torch, jax
x = torch.randn(64, 1000, device="cuda", requires_grad=True)
y = torch.randint(0, 1000, (64,), device="cuda")
lp, h = bridge.logprob_entropy(x, y)
torch.autograd.grad(lp.sum(), x)
d = bridge._dlpack.device(x.device).jax_device
s = d.memory_stats() or {}
pool = s.get("pool_bytes", s.get("bytes_reserved", 0))
print(len(jax.devices("cuda")), pool, s.get("bytes_limit", 0))
"""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    n_dev, pool, limit = (int(v) for v in proc.stdout.split()[-3:])
    assert n_dev == 1, f"JAX started on {n_dev} GPUs"
    assert pool < 2**30, f"JAX holds {pool / 2**30:.1f} GiB after a tiny call"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_vocab_parallel_nccl(tmp_path):
    failures = spawn(2, str(tmp_path), "nccl", full=True)
    assert not failures, "\n".join(failures)
