"""The bridge's direct route on CUDA (`bridge/_direct.py`): the Mosaic GPU kernels
launched from torch without the JAX runtime (skipped without a Hopper-class GPU).

Against the float64 reference at the shapes and flags users run, varying T (row
windows), int64 and out-of-range targets, a side stream, no host synchronisation, and
a bounded number of compiled kernels. The kernels' numerics are also checked on CPU,
in Mosaic GPU's interpret mode (tests/jaxops/test_mosaic_direct.py).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

import bridge  # noqa: E402
from bridge import _direct, _jaxfns  # noqa: E402

import _bridge_scenarios as S  # noqa: E402

CUDA = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def _hopper():
    if not _direct.ready():
        pytest.skip("Mosaic GPU cannot compile for torch here (needs sm_90+ and CUDA JAX)")


@pytest.fixture
def direct_calls(monkeypatch):
    """Counts forwards that took the direct route."""
    calls = []
    forward = _direct.forward

    def spy(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(_direct, "forward", spy)
    return calls


def _inputs(T, V, dtype, masked, seed):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    x = (torch.randn(T, V, device=CUDA, generator=gen) * 3).to(dtype)
    y = torch.randint(0, V, (T,), device=CUDA, generator=gen)
    mask = None
    if masked:
        mask = torch.rand(T, V, device=CUDA, generator=gen) < 0.2
        if T > 3:
            mask[1] = False  # only the target counts: log_prob 0
            mask[2, y[2]] = False  # the target counts with its bit off
            col = (int(y[3]) + 1) % V
            mask[3, col] = False
            x[3, col] = float("-inf")  # a -inf logit that the mask removes
    g_lp = torch.randn(T, device=CUDA, generator=gen)
    g_h = torch.randn(T, device=CUDA, generator=gen)
    return x, y, mask, g_lp, g_h


def _check(x, y, mask, g_lp, g_h, tau, lp, h, grad, *, entropy_grad=True):
    xr = x.detach().double().requires_grad_()
    lp_r, h_r = S.reference(xr, y, mask, tau)
    outs, cots = [lp_r], [g_lp.double()]
    if h is not None and entropy_grad:
        outs.append(h_r)
        cots.append(g_h.double())
    (g_r,) = torch.autograd.grad(outs, xr, cots)
    scale = max(1.0, float(x.detach().float().abs().max()) / tau)
    assert float((lp.double() - lp_r).abs().max()) <= 1e-5 * scale
    if h is not None:
        finite = torch.isfinite(x.detach()).all(-1)
        assert float((h.double() - h_r)[finite].abs().max()) <= 1e-5 * scale
    assert S.rel_err(grad, g_r) <= S.grad_tol(str(x.dtype).split(".")[-1])


CASES = [  # (T, V_loc, dtype, masked, tau)
    (16, 1024, torch.float32, False, 1.0),
    (16, 1024, torch.float32, True, 0.7),
    (1, 18992, torch.bfloat16, False, 1.0),
    (70, 18992, torch.bfloat16, True, 1.3),
    (3001, 1024, torch.bfloat16, False, 0.9),  # three row windows, the last overlapping
    (1000, 18992, torch.float32, True, 1.0),
    (8192, 18992, torch.bfloat16, False, 1.0),
    (300, 151936, torch.bfloat16, True, 1.0),
]


@pytest.mark.parametrize("T, V, dtype, masked, tau", CASES,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_direct_matches_float64(T, V, dtype, masked, tau, direct_calls):
    x, y, mask, g_lp, g_h = _inputs(T, V, dtype, masked, seed=T + V)
    x.requires_grad_()
    lp, h = bridge.logprob_entropy(x, y, keep_mask=mask, temperature=tau,
                                   implementation="pallas_mosaic")
    (grad,) = torch.autograd.grad([lp, h], x, [g_lp, g_h])
    assert direct_calls, "the direct route was not taken"
    assert grad.dtype == x.dtype and lp.dtype == torch.float32
    _check(x, y, mask, g_lp, g_h, tau, lp, h, grad)


@pytest.mark.parametrize("mode", ["no_entropy", "entropy_no_grad", "entropy_only_loss"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_direct_flags(mode, masked, direct_calls):
    T, V, tau = 200, 2048, 0.8
    x, y, mask, g_lp, g_h = _inputs(T, V, torch.bfloat16, masked, seed=3)
    x.requires_grad_()
    lp, h = bridge.logprob_entropy(
        x, y, keep_mask=mask, temperature=tau, implementation="pallas_mosaic",
        with_entropy=mode != "no_entropy", entropy_grad=mode != "entropy_no_grad")
    assert direct_calls
    if mode == "no_entropy":
        assert h is None
        (grad,) = torch.autograd.grad(lp, x, g_lp)
        _check(x, y, mask, g_lp, g_h, tau, lp, None, grad)
    elif mode == "entropy_no_grad":
        assert not h.requires_grad
        (grad,) = torch.autograd.grad(lp, x, g_lp)
        _check(x, y, mask, g_lp, g_h, tau, lp, h, grad, entropy_grad=False)
    else:  # only the entropy reaches the loss: d log_prob is None
        (grad,) = torch.autograd.grad(h, x, g_h)
        xr = x.detach().double().requires_grad_()
        _, h_r = S.reference(xr, y, mask, tau)
        (g_r,) = torch.autograd.grad(h_r, xr, g_h.double())
        assert S.rel_err(grad, g_r) <= S.grad_tol("bfloat16")


def test_direct_targets_out_of_range_give_nan(direct_calls):
    T, V = 8, 1024
    x, _, _, g_lp, g_h = _inputs(T, V, torch.float32, False, seed=5)
    y = torch.tensor([0, V - 1, V, -1, 2**40, -(2**40), 5, 2**32 + 3], device=CUDA)
    lp, h = bridge.logprob_entropy(x.requires_grad_(), y, implementation="pallas_mosaic")
    assert direct_calls
    bad = torch.tensor([False, False, True, True, True, True, False, True], device=CUDA)
    assert torch.isnan(lp[bad]).all() and torch.isfinite(lp[~bad]).all()
    assert torch.isfinite(h).all()
    (grad,) = torch.autograd.grad([lp[~bad].sum(), h.sum()], x)
    assert torch.isfinite(grad).all()


def test_direct_on_a_side_stream(direct_calls):
    T, V = 4096, 18992
    x, y, mask, g_lp, g_h = _inputs(T, V, torch.bfloat16, True, seed=11)
    x.requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lp, h = bridge.logprob_entropy(x, y, keep_mask=mask, implementation="pallas_mosaic")
        (grad,) = torch.autograd.grad([lp, h], x, [g_lp, g_h])
        grad = grad.clone()  # read on the side stream right away
    torch.cuda.current_stream().wait_stream(side)
    assert direct_calls
    _check(x, y, mask, g_lp, g_h, 1.0, lp, h, grad)


def test_direct_no_host_sync(direct_calls):
    V = 2048
    calls = [(8, False), (13, True), (300, False), (1000, True)]

    def run(inputs):
        for x, y, mask, g_lp, g_h in inputs:
            lp, h = bridge.logprob_entropy(x, y, keep_mask=mask,
                                           implementation="pallas_mosaic")
            torch.autograd.grad([lp, h], x, [g_lp, g_h])

    def fresh():  # new tensors every call, made before the check (their setup syncs)
        out = [_inputs(T, V, torch.bfloat16, masked, seed=T) for T, masked in calls]
        for x, *_ in out:
            x.requires_grad_()
        torch.cuda.synchronize()
        return out

    run(fresh())  # compile outside the check
    inputs = fresh()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert direct_calls


def test_direct_varying_t_bounded_compiles(direct_calls):
    V, t_max = 1024, 3000
    sizes = torch.randint(1, t_max + 1, (40,), generator=torch.Generator().manual_seed(3))
    before = _jaxfns.compiled_programs()
    for T in sizes.tolist():
        x, y, _, g_lp, g_h = _inputs(T, V, torch.bfloat16, False, seed=T)
        x.requires_grad_()
        lp, h = bridge.logprob_entropy(x, y, implementation="pallas_mosaic")
        torch.autograd.grad([lp, h], x, [g_lp, g_h])
    compiled = _jaxfns.compiled_programs() - before
    # window sizes 1 .. 2**11: partials + finish + backward each
    assert compiled <= 3 * (t_max.bit_length() + 1), compiled
    assert len(direct_calls) == len(sizes)


def test_direct_warmup_with_threads_builds_every_kernel(direct_calls):
    # Kernels built by several threads at once (bridge/_launch.py's per-kernel locks)
    # must be the ones later calls use.
    V, tau = 1536, 0.9375  # a configuration no other test compiles
    x, y, _, g_lp, g_h = _inputs(300, V, torch.bfloat16, False, seed=11)

    def call():
        xg = x.detach().requires_grad_()
        lp, h = bridge.logprob_entropy(xg, y, temperature=tau, implementation="pallas_mosaic")
        (grad,) = torch.autograd.grad([lp, h], xg, [g_lp, g_h])
        return lp, h, grad

    report = bridge.warmup(512, V, temperature=tau, implementation="pallas_mosaic",
                           progress=False, threads=8)
    assert report.programs > 0 and len(direct_calls) == len(report.windows)
    before = _jaxfns.compiled_programs()
    first = call()
    assert _jaxfns.compiled_programs() == before  # nothing left to build
    assert len(direct_calls) == len(report.windows) + 1
    for a, b in zip(first, call()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_direct_with_the_target_gathered_by_torch(masked, monkeypatch, direct_calls):
    """Large calls gather the target's logit with torch (GATHER_TARGET_FROM); forced
    here at a small size, with out-of-range ids among the targets."""
    monkeypatch.setattr(_direct, "GATHER_TARGET_FROM", 0)
    T, V, tau = 300, 2048, 0.9
    x, y, mask, g_lp, g_h = _inputs(T, V, torch.bfloat16, masked, seed=17)
    y[5], y[6] = V, -3
    x.requires_grad_()
    lp, h = bridge.logprob_entropy(x, y, keep_mask=mask, temperature=tau,
                                   implementation="pallas_mosaic")
    assert direct_calls
    assert torch.isnan(lp[5:7]).all()
    ok = torch.ones(T, dtype=torch.bool, device=CUDA)
    ok[5:7] = False
    g_ok = torch.where(ok, g_lp, 0)  # no cotangent on the NaN rows
    (grad,) = torch.autograd.grad([lp, h], x, [g_ok, g_h])
    xr = x.detach().double().requires_grad_()
    lp_r, h_r = S.reference(xr, torch.where(ok, y, 0), mask, tau)
    (g_r,) = torch.autograd.grad([lp_r, h_r], xr, [g_ok.double(), g_h.double()])
    scale = max(1.0, float(x.detach().float().abs().max()) / tau)
    assert float((lp.double() - lp_r)[ok].abs().max()) <= 1e-5 * scale
    assert float((h.double() - h_r).abs().max()) <= 1e-5 * scale
    assert S.rel_err(grad, g_r) <= S.grad_tol("bfloat16")


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_direct_single_kernel_forward_matches_two_kernels_bitwise(masked, monkeypatch,
                                                                  direct_calls):
    """V_loc of one vocabulary chunk takes one forward kernel (`forward_kernel`); the
    partials + finish pair computes the same bits."""
    from jaxops.backends.mosaic import direct as md

    T, V = 300, 1024
    assert md.one_pass(V, "bfloat16", masked)
    x, y, mask, g_lp, g_h = _inputs(T, V, torch.bfloat16, masked, seed=23)
    y[7] = -1

    def run():
        _direct._window_forward.cache_clear()
        xx = x.detach().requires_grad_()
        lp, h = bridge.logprob_entropy(xx, y, keep_mask=mask, temperature=0.8,
                                       implementation="pallas_mosaic")
        (grad,) = torch.autograd.grad([lp, h], xx, [torch.where(y >= 0, g_lp, 0), g_h])
        return lp, h, grad

    one = run()
    monkeypatch.setattr(md, "one_pass", lambda *args, **kwargs: False)
    two = run()
    _direct._window_forward.cache_clear()
    assert len(direct_calls) == 2
    for a, b in zip(one, two):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    assert torch.isnan(one[0][7]) and not torch.isnan(one[0][:7]).any()


@pytest.mark.parametrize("V, dtype, masked", [
    (151936, torch.bfloat16, False),
    (151936, torch.bfloat16, True),
    (151936, torch.float32, False),
    (18992, torch.bfloat16, True),
], ids=lambda v: str(v).replace("torch.", ""))
def test_direct_batch_invariance(V, dtype, masked, direct_calls):
    """README "Guarantees" for the direct route: a row's log-prob, entropy and gradient are
    bitwise the same in the full batch (T = 8192: one window, the target gathered by
    torch), alone, and at position 3 of batches of 7 and 100 (other windows, the target
    found in the kernel), and from run to run."""
    T, tau = 8192, 0.8
    x, y, mask, g_lp, g_h = _inputs(T, V, dtype, masked, seed=V + masked)

    def run(rows):
        xs = x[rows].clone().requires_grad_()
        m = None if mask is None else mask[rows].clone()
        lp, h = bridge.logprob_entropy(xs, y[rows].clone(), keep_mask=m, temperature=tau,
                                       implementation="pallas_mosaic")
        (grad,) = torch.autograd.grad([lp, h], xs, [g_lp[rows].clone(), g_h[rows].clone()])
        return lp, h, grad

    every = torch.arange(T, device=CUDA)
    full = run(every)
    for name, a, b in zip(("log_prob", "entropy", "grad"), full, run(every)):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), f"{name}: run to run"
    for row in (0, 5, 4097, T - 1):
        batches = [torch.tensor([row], device=CUDA)]
        for size in (7, 100):
            others = [(row + 1 + k) % T for k in range(size - 1)]
            batches.append(torch.tensor(others[:3] + [row] + others[3:], device=CUDA))
        for rows in batches:
            at = int((rows == row).nonzero()[0, 0])
            for name, a, b in zip(("log_prob", "entropy", "grad"), full, run(rows)):
                assert torch.equal(a[row].nan_to_num(), b[at].nan_to_num()), (
                    f"{name}: row {row} in a batch of {len(rows)}")
    assert direct_calls
