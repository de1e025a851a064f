"""Tests of `bridge.linear_logprob_entropy` (the output layer fused into the bridge's op):
values and gradients to hidden and weight against a float64 torch reference, every flag,
T = 0 / 1 / not a power of two, row windows (overlapping ones included), bounded
compiles, bad calls, zero copy, TP = 1 and 2 (spawned gloo ranks), and one CUDA size.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import bridge
from bridge import _dlpack, _jaxfns, _linear_jaxfns
from bridge import _linear_run

import _bridge_linear_worker as W
import _bridge_scenarios as S
from _linear_cases import record_fused_traces
from _oracle import VALUE_RTOL, grad_rtol

CPU = torch.device("cpu")


def make(T, H, V, dtype=torch.float32, *, masked=False, seed=0, device=CPU, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) * scale / math.sqrt(H) * 3).to(dtype)
    y = torch.randint(0, V, (T,), generator=gen)
    mask = (torch.rand(T, V, generator=gen) < 0.4) if masked else None
    if masked and T > 2:
        mask[1] = False  # only the target counts: log_prob = 0
        mask[2, y[2]] = False  # the target counts with its bit off
    g_lp, g_h = torch.randn(T, generator=gen), torch.randn(T, generator=gen)
    mv = lambda t: None if t is None else t.to(device)  # noqa: E731
    return tuple(mv(t) for t in (hidden, weight, y, mask, g_lp, g_h))


def check(hidden, weight, y, mask, g_lp, g_h, *, temperature=1.0, with_entropy=True,
          entropy_grad=True, chunk_size=None, implementation=None, grad_slack=1.0, **kw):
    """One call against the float64 reference: values, dtypes, d hidden and d weight
    (for the combined cotangent and, with an entropy gradient, the log-prob alone)."""
    dtype = hidden.dtype
    h_in = hidden.clone().requires_grad_()
    w_in = weight.clone().requires_grad_()
    lp, ent = bridge.linear_logprob_entropy(
        h_in, w_in, y, keep_mask=mask, temperature=temperature, with_entropy=with_entropy,
        entropy_grad=entropy_grad, chunk_size=chunk_size, implementation=implementation, **kw)
    hr = hidden.double().requires_grad_()
    wr = weight.double().requires_grad_()
    lp_r, ent_r = W.reference(hr, wr, y, mask, temperature)
    x_max = float((hidden.double() @ weight.double().T).abs().max()) / temperature
    atol = VALUE_RTOL * max(1.0, x_max)
    T = hidden.shape[0]
    assert lp.dtype == torch.float32 and lp.shape == (T,)
    assert float((lp.double() - lp_r).abs().max()) <= atol
    if with_entropy:
        assert ent.dtype == torch.float32 and ent.shape == (T,)
        assert float((ent.double() - ent_r).abs().max()) <= atol
        assert ent.requires_grad == entropy_grad
    else:
        assert ent is None
    tol = grad_rtol(dtype, x_max) * grad_slack
    cases = [([lp], [g_lp], [lp_r])]
    if with_entropy and entropy_grad:
        cases.append(([lp, ent], [g_lp, g_h], [lp_r, ent_r]))
    for outs, cots, refs in cases:
        dh, dw = torch.autograd.grad(outs, [h_in, w_in], cots, retain_graph=True)
        dh_r, dw_r = torch.autograd.grad(refs, [hr, wr], [c.double() for c in cots],
                                         retain_graph=True)
        assert dh.dtype == dtype and dw.dtype == dtype
        assert S.rel_err(dh, dh_r) <= tol, f"d hidden: {S.rel_err(dh, dh_r):.3g} > {tol:.3g}"
        assert S.rel_err(dw, dw_r) <= tol, f"d weight: {S.rel_err(dw, dw_r):.3g} > {tol:.3g}"
    if with_entropy and not entropy_grad:
        # using the forward-only entropy in a loss changes no gradient
        a = torch.autograd.grad((lp * g_lp).sum() + (ent * g_h).sum(), [h_in, w_in],
                                retain_graph=True)
        b = torch.autograd.grad((lp * g_lp).sum(), [h_in, w_in])
        assert all(torch.equal(u, v) for u, v in zip(a, b))
    return lp, ent


# ---------------------------------------------------------------------------
# against float64: shapes, dtypes, flags, windows
# ---------------------------------------------------------------------------

# (T, H, V, dtype, masked, temperature, with_entropy, entropy_grad, chunk_size in columns)
CASES = {
    "t1": (1, 7, 10, torch.float32, False, 1.0, True, True, None),
    # H, V not multiples of anything: rows misaligned for windows -> one window of T
    "odd_mask_tau": (13, 19, 23, torch.float32, True, 0.7, True, True, 3),
    # 64-byte hidden rows: windows 16, 8 and an overlapping 8 (skip 3) over T = 29
    "windows_mask": (29, 16, 64, torch.float32, True, 1.3, True, True, 5),
    "windows_bf16": (29, 32, 45, torch.bfloat16, False, 1.0, True, True, None),
    "bf16_mask_fwd_entropy": (11, 21, 37, torch.bfloat16, True, 0.9, True, False, 4),
    "no_entropy": (29, 16, 33, torch.float32, False, 1.0, False, False, 7),
    "fp16": (10, 24, 31, torch.float16, True, 1.0, True, True, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_against_float64(name):
    T, H, V, dtype, masked, tau, with_entropy, entropy_grad, chunk = CASES[name]
    seed = zlib.crc32(name.encode()) % 1000
    check(*make(T, H, V, dtype, masked=masked, seed=seed), temperature=tau,
          with_entropy=with_entropy, entropy_grad=entropy_grad, chunk_size=chunk)


def test_overlapping_windows_are_exercised():
    """The windows case above does run an overlapping last window (d weight must not
    count its recomputed rows twice), and the odd case one exact window."""
    hidden, weight, y, mask, *_ = make(29, 16, 64, masked=True)
    windows = _linear_run.Plan(hidden, weight, y, mask, "").windows
    assert len(windows) == 3 and windows[-1].skip > 0, windows
    hidden, weight, y, mask, *_ = make(13, 19, 23, masked=True)
    assert _linear_run.Plan(hidden, weight, y, mask, "").windows == ((0, 13, 0),)


def test_matches_bridge_op_on_materialised_logits():
    """Same numbers as bridge.logprob_entropy on the fp32 logits hidden @ weight.T."""
    hidden, weight, y, mask, g_lp, g_h = make(21, 16, 40, masked=True, seed=4)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = bridge.linear_logprob_entropy(h1, w1, y, keep_mask=mask, temperature=0.8,
                                            chunk_size=6)
    g1 = torch.autograd.grad([lp, ent], [h1, w1], [g_lp, g_h])
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp2, ent2 = bridge.logprob_entropy(h2 @ w2.T, y, keep_mask=mask, temperature=0.8)
    g2 = torch.autograd.grad([lp2, ent2], [h2, w2], [g_lp, g_h])
    for a, b in zip((lp, ent) + g1, (lp2, ent2) + g2):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


def test_pallas_interpret_matches_xla():
    hidden, weight, y, mask, g_lp, g_h = make(5, 8, 21, masked=True, seed=2)
    outs = {}
    for impl in ("xla", "pallas"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = bridge.linear_logprob_entropy(h, w, y, keep_mask=mask, temperature=0.9,
                                                implementation=impl)
        outs[impl] = (lp, ent) + torch.autograd.grad([lp, ent], [h, w], [g_lp, g_h])
    for a, b in zip(outs["xla"], outs["pallas"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("with_entropy", [True, False])
def test_empty(with_entropy):
    hidden = torch.randn(0, 5, requires_grad=True)
    weight = torch.randn(7, 5, requires_grad=True)
    lp, ent = bridge.linear_logprob_entropy(hidden, weight, torch.zeros(0, dtype=torch.long),
                                            with_entropy=with_entropy)
    assert lp.shape == (0,) and lp.dtype == torch.float32
    assert (ent is None) == (not with_entropy)
    loss = lp.sum() + (ent.sum() if with_entropy else 0)
    dh, dw = torch.autograd.grad(loss, [hidden, weight])
    assert dh.shape == (0, 5) and dw.shape == (7, 5) and not dw.any()


def test_only_the_gradients_autograd_needs():
    """A frozen weight (or hidden) gets no gradient computed; the other is unchanged."""
    hidden, weight, y, _, g_lp, g_h = make(12, 16, 20, seed=5)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = bridge.linear_logprob_entropy(h, w, y)
    dh, dw = torch.autograd.grad([lp, ent], [h, w], [g_lp, g_h])
    lp, ent = bridge.linear_logprob_entropy(h, weight, y)
    assert torch.equal(torch.autograd.grad([lp, ent], h, [g_lp, g_h])[0], dh)
    lp, ent = bridge.linear_logprob_entropy(hidden, w, y)
    assert torch.equal(torch.autograd.grad([lp, ent], w, [g_lp, g_h])[0], dw)
    with torch.no_grad():
        lp2, _ = bridge.linear_logprob_entropy(h, w, y)
    assert not lp2.requires_grad and torch.equal(lp2, lp.detach())


def test_no_double_backward():
    """Under create_graph=True the gradients are exact, and differentiating them again
    raises (a constant-looking gradient would drop a second-order term silently)."""
    hidden, weight, y, _, _, _ = make(6, 8, 12, seed=8)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = bridge.linear_logprob_entropy(h, w, y)
    plain = torch.autograd.grad(lp.sum() + ent.sum(), [h, w])
    lp, ent = bridge.linear_logprob_entropy(h, w, y)
    dh, dw = torch.autograd.grad(lp.sum() + ent.sum(), [h, w], create_graph=True)
    assert torch.equal(dh, plain[0]) and torch.equal(dw, plain[1])
    for second in (dh.square().sum() + h.sum(), dw.square().sum() + w.sum()):
        with pytest.raises(RuntimeError, match="no second derivative"):
            torch.autograd.grad(second, [h, w], retain_graph=True, allow_unused=True)


def test_entropy_gradient_alone():
    """Only the entropy is used: the log-prob's cotangent is None."""
    hidden, weight, y, _, _, g_h = make(6, 8, 12, seed=6)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    _, ent = bridge.linear_logprob_entropy(h, w, y, temperature=1.2)
    dh, dw = torch.autograd.grad(ent, [h, w], g_h)
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    dh_r, dw_r = torch.autograd.grad(W.reference(hr, wr, y, None, 1.2)[1], [hr, wr],
                                     g_h.double())
    assert S.rel_err(dh, dh_r) <= 1e-5 and S.rel_err(dw, dw_r) <= 1e-5


def test_process_group_of_one_equals_none():
    """A gloo group of one rank (TP = 1): values and both gradients bitwise those of no
    group, with either `reduce_hidden_grad`, for the chunked path and (interpret mode)
    the fused kernels."""
    cases = [(make(7, 8, 12, masked=True, seed=7), None),
             (make(16, 64, 48, torch.bfloat16, seed=8), "pallas_mosaic")]
    with S.one_rank_group("gloo", timeout_s=60) as pg:
        for (hidden, weight, y, mask, g_lp, g_h), implementation in cases:
            for reduce in (False, True):
                results = []
                for group in (None, pg):
                    h_in = hidden.clone().requires_grad_()
                    w_in = weight.clone().requires_grad_()
                    lp, ent = bridge.linear_logprob_entropy(
                        h_in, w_in, y, keep_mask=mask, process_group=group,
                        reduce_hidden_grad=reduce, chunk_size=16,
                        implementation=implementation)
                    grads = torch.autograd.grad([lp, ent], [h_in, w_in], [g_lp, g_h])
                    results.append((lp, ent, *grads))
                assert all(torch.equal(a, b) for a, b in zip(*results)), (implementation,
                                                                        reduce)


def test_varying_t_compiles_a_bounded_set():
    """T changes every call (random in [1, 100]): every call is right, and the programs
    compiled are at most, per power-of-two window size (1 ... 64), one forward and two
    backwards (d weight direct when the window is the call's only one, accumulated
    otherwise), plus the accumulator's zero-fill -- however many T."""
    H, V = 16, 24  # 64-byte hidden rows: every window start aligned
    gen = torch.Generator().manual_seed(11)
    before = _jaxfns.compiled_programs()
    for T in torch.randint(1, 101, (16,), generator=gen).tolist() + [64, 32]:
        hidden, weight, y, _, g_lp, g_h = make(T, H, V, seed=T)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = bridge.linear_logprob_entropy(h, w, y, temperature=0.9, chunk_size=8)
        dh, dw = torch.autograd.grad([lp, ent], [h, w], [g_lp, g_h])
        hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
        lp_r, ent_r = W.reference(hr, wr, y, None, 0.9)
        dh_r, dw_r = torch.autograd.grad([lp_r, ent_r], [hr, wr], [g_lp.double(),
                                                                   g_h.double()])
        assert float((lp.detach().double() - lp_r).abs().max()) < 1e-5, T
        assert float((ent.detach().double() - ent_r).abs().max()) < 1e-5, T
        assert S.rel_err(dh, dh_r) < 1e-5 and S.rel_err(dw, dw_r) < 1e-5, T
    compiled = _jaxfns.compiled_programs() - before
    assert compiled <= 7 * 3 + 1, f"{compiled} programs for 18 calls with T in [1, 100]"


def test_torch_compile_graph_breaks_around_it():
    """Under torch.compile (not fullgraph) the call runs eagerly between graphs."""
    torch._dynamo.reset()
    hidden, weight, y, mask, g_lp, g_h = make(6, 8, 12, masked=True, seed=8)

    def loss(h, w):
        lp, ent = bridge.linear_logprob_entropy(h * 1.0, w, y, keep_mask=mask)
        return (lp * g_lp).sum() + (ent * g_h).sum()

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    compiled = torch.compile(loss, backend="eager")(h, w)
    grads = torch.autograd.grad(compiled, [h, w])
    eager = loss(h, w)
    grads_e = torch.autograd.grad(eager, [h, w])
    assert torch.equal(compiled, eager)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_e))


# ---------------------------------------------------------------------------
# zero copy
# ---------------------------------------------------------------------------

def test_zero_copy_of_hidden_and_weight(monkeypatch):
    hidden, weight, y, _, _, _ = make(8, 16, 20, seed=9)
    hidden.requires_grad_()
    weight.requires_grad_()
    seen = []
    to_jax = _dlpack.Transfer.to_jax

    def spy(self, t):
        a = to_jax(self, t)
        seen.append((t.data_ptr(), a.unsafe_buffer_pointer(), tuple(t.shape)))
        return a

    monkeypatch.setattr(_dlpack.Transfer, "to_jax", spy)
    lp, ent = bridge.linear_logprob_entropy(hidden, weight, y)
    torch.autograd.grad(lp.sum() + ent.sum(), [hidden, weight])
    assert all(src == dst for src, dst, _ in seen), "a copy was made on import"
    imported = {(p, s) for p, _, s in seen}
    assert (hidden.data_ptr(), (8, 16)) in imported and (weight.data_ptr(), (20, 16)) in imported
    assert not any(s == (8, 20) for _, _, s in seen), "a [T, V] tensor crossed over"


# ---------------------------------------------------------------------------
# bad calls: a clear TypeError / ValueError before any kernel runs
# ---------------------------------------------------------------------------

@pytest.fixture
def no_kernels(monkeypatch):
    def refuse(**_):
        raise AssertionError("a kernel was launched before the error")

    for name in ("local_forward", "local_backward", "zero_accumulator"):
        monkeypatch.setattr(_linear_jaxfns, name, refuse)


def _bad_calls():
    hidden, weight, y, mask, *_ = make(4, 6, 12, masked=True)
    big = torch.randn(5, 12)  # 48-byte rows: big[1:] is not 64-byte aligned
    cases = [
        ("hidden not a tensor", TypeError, "hidden must be a torch.Tensor",
         dict(hidden=hidden.numpy())),
        ("weight not a tensor", TypeError, "weight must be a torch.Tensor",
         dict(weight=[[1.0]])),
        ("hidden 3-D", ValueError, r"\[T, H\]", dict(hidden=hidden[None])),
        ("weight 1-D", ValueError, r"\[V_loc, H\]", dict(weight=weight[0])),
        ("H disagrees", ValueError, "H must agree", dict(weight=torch.randn(12, 5))),
        ("hidden integer", TypeError, "float32, bfloat16 or float16",
         dict(hidden=hidden.long(), weight=weight.long())),
        ("hidden float64", TypeError, "float32, bfloat16 or float16",
         dict(hidden=hidden.double(), weight=weight.double())),
        ("dtypes differ", TypeError, "same dtype", dict(weight=weight.bfloat16())),
        ("targets float", TypeError, "integer token ids", dict(targets=y.float())),
        ("targets wrong length", ValueError, r"shape \[T\] = \[4\]", dict(targets=y[:3])),
        ("targets on another device", ValueError, "targets is on",
         dict(targets=y.to("meta"))),
        ("weight on another device", ValueError, "weight is on",
         dict(weight=weight.to("meta"))),
        ("mask not bool", TypeError, "keep_mask must be a bool", dict(keep_mask=mask.int())),
        ("mask wrong shape", ValueError, r"\[T, V_loc\] = \[4, 12\]",
         dict(keep_mask=mask[:, :5])),
        ("temperature 0", ValueError, "temperature", dict(temperature=0.0)),
        ("temperature nan", ValueError, "temperature", dict(temperature=math.nan)),
        ("temperature tensor", TypeError, "temperature", dict(temperature=torch.tensor(1.0))),
        ("with_entropy not bool", TypeError, "with_entropy", dict(with_entropy=1)),
        ("entropy_grad not bool", TypeError, "entropy_grad", dict(entropy_grad=None)),
        ("reduce_hidden_grad not bool", TypeError, "reduce_hidden_grad",
         dict(reduce_hidden_grad="yes")),
        ("chunk_size 0", ValueError, "chunk_size", dict(chunk_size=0)),
        ("chunk_size float", ValueError, "chunk_size", dict(chunk_size=2.0)),
        ("chunk_size bool", ValueError, "chunk_size", dict(chunk_size=True)),
        ("bad implementation", ValueError, "implementation", dict(implementation="cuda")),
        ("bad process_group", TypeError, "process_group", dict(process_group="tp")),
        ("hidden transposed", ValueError, "hidden must be contiguous",
         dict(hidden=torch.randn(6, 4).t())),
        ("weight transposed", ValueError, "weight must be contiguous",
         dict(weight=torch.randn(6, 12).t())),
        ("weight misaligned", ValueError, "aligned.*does not copy",
         dict(weight=big[1:], hidden=torch.randn(4, 12), keep_mask=None)),
        ("out-of-range target", ValueError, r"\[0, 12\)",
         dict(targets=torch.tensor([0, 1, 12, 3]), check_targets=True)),
    ]
    return [pytest.param(expected, pattern,
                         dict(dict(hidden=hidden, weight=weight, targets=y), **kw), id=name)
            for name, expected, pattern, kw in cases]


@pytest.mark.parametrize("expected, pattern, kwargs", _bad_calls())
def test_bad_calls(expected, pattern, kwargs, no_kernels):
    hidden, weight, targets = (kwargs.pop(k) for k in ("hidden", "weight", "targets"))
    with pytest.raises(expected, match=pattern):
        bridge.linear_logprob_entropy(hidden, weight, targets, **kwargs)


def test_out_of_range_target_is_nan_by_default():
    hidden, weight, y, *_ = make(5, 8, 11, seed=10)
    good, _ = bridge.linear_logprob_entropy(hidden, weight, y)
    y[3] = 11
    lp, ent = bridge.linear_logprob_entropy(hidden, weight, y)
    assert torch.isnan(lp[3]) and torch.equal(lp[[0, 1, 2, 4]], good[[0, 1, 2, 4]])
    assert torch.isfinite(ent).all()


# ---------------------------------------------------------------------------
# vocab parallel: spawned gloo ranks
# ---------------------------------------------------------------------------

def test_vocab_parallel_gloo_two_ranks(tmp_path):
    """TP = 2: values, d weight per shard, d hidden with reduce_hidden_grad True (the op
    sums) and False (Megatron's copy-to-region autograd sums; the op alone does not),
    collective counts, T = 0, unequal shards; "pallas_mosaic" runs both fused kernels
    (Mosaic GPU's interpreter) on each rank's shard."""
    failures = W.spawn(2, str(tmp_path))
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_against_fp32_reference():
    """T = 4096, H = 1024, V = 32768 in bf16 (on Hopper+ the fused forward kernel, then
    Pallas statistics on each chunk of the backward) against torch's fp32 logits; torch
    allocates nothing [T, V] for the op."""
    cuda = torch.device("cuda", 0)
    T, H, V = 4096, 1024, 32768
    gen = torch.Generator(device=cuda).manual_seed(0)
    hidden = torch.randn(T, H, device=cuda, generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(V, H, device=cuda, generator=gen) * 0.1).bfloat16().requires_grad_()
    y = torch.randint(0, V, (T,), device=cuda, generator=gen)
    g_lp, g_h = torch.randn(T, device=cuda, generator=gen), torch.randn(T, device=cuda,
                                                                        generator=gen)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(cuda)
    base = torch.cuda.memory_allocated(cuda)
    lp, ent = bridge.linear_logprob_entropy(hidden, weight, y, temperature=0.9,
                                            chunk_size=1024)
    dh, dw = torch.autograd.grad([lp, ent], [hidden, weight], [g_lp, g_h])
    torch.cuda.synchronize()
    torch_peak = torch.cuda.max_memory_allocated(cuda) - base
    assert torch_peak < T * V * 2, f"torch held {torch_peak / 2**20:.0f} MiB during the op"
    assert dh.dtype == dw.dtype == torch.bfloat16

    hr = hidden.detach().float().requires_grad_()
    wr = weight.detach().float().requires_grad_()
    z = (hr @ wr.T) / 0.9
    lse = torch.logsumexp(z, -1)
    lp_r = z.gather(1, y[:, None])[:, 0] - lse
    ent_r = lse - (torch.softmax(z, -1) * z).sum(-1)
    dh_r, dw_r = torch.autograd.grad([lp_r, ent_r], [hr, wr], [g_lp, g_h])
    scale = max(1.0, float(z.detach().abs().max()))
    # fp32 reference: its own error is ~1e-6 relative, far below bf16's gradient bound
    assert float((lp - lp_r).abs().max()) <= 2e-5 * scale
    assert float((ent - ent_r).abs().max()) <= 2e-5 * scale
    assert S.rel_err(dh, dh_r) <= grad_rtol("bfloat16")
    assert S.rel_err(dw, dw_r) <= grad_rtol("bfloat16")


def test_plan_picks_the_backend_for_the_chunks(backend_choices):
    """As `jaxops.linear_logprob_entropy`: the backend is chosen for one chunk of fp32
    logits, not for V_loc in the inputs' dtype."""
    hidden = torch.randn(40, 16, dtype=torch.bfloat16)
    weight = torch.randn(1000, 16, dtype=torch.bfloat16)
    y = torch.randint(0, 1000, (40,))
    for chunk_size, width in ((256, 256), (None, 1000)):
        _linear_run.Plan(hidden, weight, y, None, "", chunk_size)
        assert (backend_choices[-1]["num_vocab"], backend_choices[-1]["itemsize"]) == (
            width, 4)


@pytest.fixture
def fused_traces(monkeypatch):
    """The fused kernels' traces, (kernel, hidden shape, weight shape) each
    (`_linear_cases.record_fused_traces`), with the bridge's caches of traced functions
    cleared before and after, so that they trace afresh with the recording kernels."""
    _linear_jaxfns.local_forward.cache_clear()
    _linear_jaxfns.local_backward.cache_clear()
    yield record_fused_traces(monkeypatch.setattr)
    _linear_jaxfns.local_forward.cache_clear()
    _linear_jaxfns.local_backward.cache_clear()


def test_fused_forward_in_interpret_mode(fused_traces):
    """"pallas_mosaic" runs each window's forward as the fused kernel and its backward's
    d logits with the recomputing one (`mosaic/linear.py`, Mosaic GPU's interpreter here)
    where their shapes allow, as the JAX op does: values and gradients against float64,
    and the kernels traced once per window size (and chunk)."""
    check(*make(16, 64, 200, torch.bfloat16, seed=3), temperature=0.8, chunk_size=64,
          implementation="pallas_mosaic")
    # one window of 16 rows; the backward: the 64-column chunks' scan body and the tail,
    # traced for each of `check`'s two cotangents (log-prob alone: no entropy term)
    assert sorted(fused_traces) == [("backward_logits", (16, 64), (8, 64))] * 2 + [
        ("backward_logits", (16, 64), (64, 64))] * 2 + [
        ("forward_stats", (16, 64), (200, 64))], fused_traces
    fused_traces.clear()  # a mask with V_loc % 16 != 0 keeps the chunked forward and backward
    check(*make(16, 64, 200, torch.bfloat16, masked=True, seed=4), chunk_size=64,
          implementation="pallas_mosaic")
    assert fused_traces == []
    # chunks that are not a multiple of 8 columns keep the chunked backward
    check(*make(16, 64, 80, torch.bfloat16, seed=5), chunk_size=20,
          implementation="pallas_mosaic")
    assert fused_traces == [("forward_stats", (16, 64), (80, 64))]


def test_fused_kernels_with_mask(fused_traces):
    """A bool torch mask goes to both fused kernels (`mosaic.linear.MASKED`, on by
    default)."""
    check(*make(16, 64, 80, torch.bfloat16, masked=True, seed=10), temperature=0.9,
          chunk_size=32, implementation="pallas_mosaic")
    # the backward's 32-column scan body and 16-column tail, for `check`'s two cotangents
    assert sorted(fused_traces) == sorted(
        [("forward_stats", (16, 64), (80, 64))]
        + [("backward_logits", (16, 64), (cols, 64)) for cols in (32, 16)] * 2)


@pytest.mark.parametrize("dtype,with_entropy,entropy_grad", [
    (torch.bfloat16, True, True), (torch.float16, True, False), (torch.float16, False, False)])
def test_fused_kernels_over_two_windows(dtype, with_entropy, entropy_grad, fused_traces):
    """T = 24: windows of 16 and 8 rows, each through both fused kernels, d weight summed
    over the windows (the accumulating path of `chunked_backward` with the fused d
    logits), for each entropy mode and fp16; against float64, every trace counted."""
    check(*make(24, 64, 80, dtype, seed=9), temperature=1.2, chunk_size=32,
          with_entropy=with_entropy, entropy_grad=entropy_grad,
          implementation="pallas_mosaic")
    # per window: the forward; the backward's 32-column scan body and 16-column tail,
    # for each of `check`'s cotangents (two with the entropy's gradient)
    backwards = 2 if with_entropy and entropy_grad else 1
    want = sorted([("forward_stats", (rows, 64), (80, 64)) for rows in (16, 8)]
                  + [("backward_logits", (rows, 64), (cols, 64))
                     for rows in (16, 8) for cols in (32, 16)] * backwards)
    assert sorted(fused_traces) == want, fused_traces
