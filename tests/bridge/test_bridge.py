"""CPU tests of the PyTorch bridge (bridge/): values and gradients against a float64 torch
reference and Megatron-core's fused vocab-parallel cross entropy, for TP = 1 (in this
process) and TP = 2, 4 (spawned gloo groups); the Pallas kernels in interpret mode; any T
(row windows, a bounded set of compiled programs).
The scenario matrix lives in tests/bridge/_bridge_scenarios.py (shared with the CUDA tests).
Targets and bad calls: test_bridge_validation.py; zero copy, autograd, torch.compile,
opcheck and the memory policy: test_bridge_torch.py.
"""

from __future__ import annotations

import jax
import pytest
import torch

import bridge
from bridge import _jaxfns

import _bridge_scenarios as S
from _bridge_scenarios import small_inputs
from _bridge_spawn import spawn

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def megatron():
    return S.load_megatron()


# ---------------------------------------------------------------------------
# the scenario matrix
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("sc", S.scenarios(full=True), ids=lambda sc: sc.name)
def test_tp1(sc, pg, megatron):
    S.run_scenario(sc, group=pg, meg_group=pg, rank=0, world=1, device=CPU,
                   megatron=megatron)


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_gloo(world, tmp_path):
    """The scenarios on each rank of a spawned gloo group (all of them for TP = 2, a
    covering subset for TP = 4), plus collective counts (2 in the first forward of a
    shape, then 1; 0 in the backward), unequal shards, T = 0 and (TP = 2) torch.compile."""
    failures = spawn(world, str(tmp_path), "gloo", full=world == 2)
    assert not failures, "\n".join(failures)


def test_process_group_none_equals_group_of_one(pg):
    x, y, mask = small_inputs(masked=True)
    a = bridge.logprob_entropy(x, y, keep_mask=mask)
    b = bridge.logprob_entropy(x, y, keep_mask=mask, process_group=pg)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_chunk_size_changes_nothing(pg):
    x, y, mask = small_inputs(T=9, masked=True)
    outs = [bridge.calculate_log_probs_and_entropy(x, y, pg, True, chunk, mask)
            for chunk in (-1, 1, 4, 100)]
    for lp, h in outs[1:]:
        assert torch.equal(lp, outs[0][0]) and torch.equal(h, outs[0][1])


@pytest.mark.parametrize("impl,num_vocab", [("pallas", 21), ("pallas_mosaic", 48)])
def test_pallas_interpret_matches_xla(impl, num_vocab):
    """The Pallas kernels (interpret mode on CPU) through the bridge. (The Mosaic GPU
    kernels take V_loc a multiple of 16 with a mask; 48 also splits into tiles.)"""
    x, y, mask = small_inputs(T=3, V=num_vocab, masked=True)
    outs = {}
    for name in ("xla", impl):
        lp, h = bridge.logprob_entropy(x, y, keep_mask=mask, temperature=0.9,
                                       implementation=name)
        (g,) = torch.autograd.grad((lp * 0.3).sum() + h.sum(), x)
        outs[name] = (lp, h, g)
    for a, b in zip(outs["xla"], outs[impl]):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)


def test_bool_mask_reaches_the_mosaic_kernels_as_bytes():
    """The Mosaic kernels read the mask as bytes: a bool mask is handed over as its uint8
    view (same storage, no conversion pass); the other backends keep the bool tensor."""
    from bridge import _run

    x, y, mask = small_inputs(T=3, V=48, masked=True)
    plan = _run.Plan(x, y, mask, "pallas_mosaic")
    assert plan.mask.dtype == torch.uint8 and plan.mask.data_ptr() == mask.data_ptr()
    assert torch.equal(plan.mask.bool(), mask)
    for name in ("pallas_triton", "xla"):
        assert _run.Plan(x, y, mask, name).mask.dtype == torch.bool


# ---------------------------------------------------------------------------
# any T: row windows, bounded compiles
# ---------------------------------------------------------------------------

def test_row_windows_cover_every_row_once():
    from bridge._windows import MAX_WINDOW, row_windows

    for T in [*range(1, 600), 2**15 - 1, 2**15, 2**15 + 1, 3 * 2**15 + 12345, 100_003]:
        for align in (1, 4):
            windows = row_windows(T, align)
            new_rows = torch.zeros(T, dtype=torch.int64)
            for w in windows:
                assert 0 <= w.start and w.start + w.size <= T and 0 <= w.skip < w.size
                new_rows[w.start + w.skip:w.start + w.size] += 1
                if T % align == 0:
                    assert w.size & (w.size - 1) == 0 and w.size <= MAX_WINDOW
                    assert w.start % align == 0, (T, align, windows)
            assert bool((new_rows == 1).all()), (T, align, windows)
            extra = sum(w.size for w in windows) - T
            assert extra <= T / 7, (T, windows)
    assert row_windows(7, 4) == ((0, 7, 0),)  # T not a multiple of the alignment: exact


@pytest.mark.parametrize("masked", [False, True])
def test_varying_t_matches_one_call_and_compiles_a_bounded_set(masked):
    """T changes every call (random in [1, 200]): each call equals the JAX op on the same
    rows in one call, and the bridge compiles at most one program per power-of-two
    window size for the forward and the backward."""
    import jax.numpy as jnp
    import numpy as np

    import jaxops

    V = 64  # rows of 64 fp32 (and 64 mask bytes) keep every window start aligned
    gen = torch.Generator().manual_seed(3)
    before = _jaxfns.compiled_programs()
    for T in torch.randint(1, 201, (25,), generator=gen).tolist():
        x = (torch.randn(T, V, generator=gen) * 3).requires_grad_()
        y = torch.randint(0, V, (T,), generator=gen)
        mask = torch.rand(T, V, generator=gen) < 0.3 if masked else None
        g1, g2 = torch.randn(T, generator=gen), torch.randn(T, generator=gen)
        lp, h = bridge.logprob_entropy(x, y, keep_mask=mask, temperature=0.7)
        (g,) = torch.autograd.grad([lp, h], x, [g1, g2])

        def jax_op(z):
            return jaxops.logprob_entropy(
                z, jnp.asarray(y.numpy()), temperature=0.7, implementation="xla",
                keep_mask=None if mask is None else jnp.asarray(mask.numpy()))

        (lp_j, h_j), vjp = jax.vjp(jax_op, jnp.asarray(x.detach().numpy()))
        (g_j,) = vjp((jnp.asarray(g1.numpy()), jnp.asarray(g2.numpy())))
        for got, want in ((lp, lp_j), (h, h_j), (g, g_j)):
            np.testing.assert_allclose(got.detach().numpy(), np.asarray(want),
                                       rtol=1e-6, atol=1e-6, err_msg=f"T = {T}")
    compiled = _jaxfns.compiled_programs() - before
    assert compiled <= 2 * 8, f"{compiled} programs for 25 calls with T in [1, 200]"
