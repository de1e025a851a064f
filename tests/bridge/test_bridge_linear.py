"""Tests of `bridge.linear_logprob_entropy` (the output layer fused into the bridge's op):
values and gradients to hidden and weight against a float64 torch reference, every flag,
T = 0 / 1 / not a power of two, row windows (overlapping ones included), bounded
compiles, zero copy, TP = 1 and 2 (spawned gloo ranks), and one CUDA size.
Bad calls: test_bridge_linear_bad_calls.py; the fused Mosaic GPU kernels (interpret
mode): test_bridge_linear_fused.py.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import bridge
from bridge import _dlpack, _jaxfns
from bridge import _linear_run

from _bridge_linear_cases import check, make
import _bridge_linear_worker as W
import _bridge_scenarios as S
from _bridge_spawn import one_rank_group
from _oracle import grad_rtol


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
    with one_rank_group("gloo", timeout_s=60) as pg:
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
