"""Vocab-parallel checks of `bridge.linear_logprob_entropy` on spawned gloo ranks (run by
tests/bridge/test_bridge_linear.py through `spawn`).

Every rank builds the same full `hidden [T, H]`, `weight [R * V_loc, H]`, targets and
mask, and passes its own weight rows `[r * V_loc, (r + 1) * V_loc)` (and mask columns).
Checked against the float64 reference on the full vocabulary: values, this rank's
d weight rows, and d hidden in both settings of `reduce_hidden_grad` -- True: the
op's own d hidden is the full sum; False: this rank's part, which Megatron's
`copy_to_tensor_model_parallel_region` (imitated here) all-reduces into the full sum.
Also: collective counts, T = 0, unequal shards, and 1-rank groups equal to no group.

Nothing heavy at module level: spawned children import this module first.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback

V_LOCAL = 13  # weight rows per rank: not a power of two
HIDDEN = 11
CASES = {  # name: (T, dtype, masked, temperature, entropy mode, chunk_size)
    "f32_mask": (9, "float32", True, 0.7, "grad", 4),
    "bf16": (6, "bfloat16", False, 1.0, "grad", None),
    "f32_fwd_entropy": (5, "float32", False, 1.3, "fwd", 2),
    "f32_no_entropy": (5, "float32", True, 1.0, "off", None),
    # the fused Mosaic GPU kernels (interpret mode) need T % 8, H % 64, V_loc % 8: 48
    # columns per rank in chunks of 16
    "bf16_fused": (16, "bfloat16", False, 0.8, "grad", 16),
}
FUSED = {"bf16_fused": dict(implementation="pallas_mosaic", hidden_size=64, v_local=48)}


def make_inputs(T, dtype, masked, world, seed=0, hidden_size=HIDDEN, v_local=V_LOCAL):
    import torch

    gen = torch.Generator().manual_seed(seed)
    V = world * v_local
    hidden = torch.randn(T, hidden_size, generator=gen).to(getattr(torch, dtype))
    weight = (torch.randn(V, hidden_size, generator=gen) * 0.6).to(getattr(torch, dtype))
    y = torch.randint(0, V, (T,), generator=gen)
    if T > 1:
        y[0], y[1] = 0, V - 1  # first and last shard
    mask = (torch.rand(T, V, generator=gen) < 0.3) if masked else None
    g_lp, g_h = torch.randn(T, generator=gen), torch.randn(T, generator=gen)
    return hidden, weight, y, mask, g_lp, g_h


def reference(hidden, weight, y, mask, tau):
    """float64 (log_prob, entropy) of (hidden @ weight.T) / tau, differentiable."""
    import torch

    z = (hidden.double() @ weight.double().T) / tau
    lse = torch.logsumexp(z, -1)
    target = z.gather(1, y[:, None])[:, 0]
    if mask is None:
        log_prob = target - lse
    else:
        kept = mask.clone()
        kept[torch.arange(len(y)), y] = True
        log_prob = target - torch.logsumexp(torch.where(kept, z, float("-inf")), -1)
    p = torch.softmax(z, -1)
    return log_prob, lse - (p * z).sum(-1)


def rel_err(a, b):
    a, b = a.double(), b.double()
    den = float(b.norm())
    return float((a - b).norm()) / den if den > 0 else float((a - b).norm())


GRAD_RTOL = {"float32": 1e-5, "bfloat16": 4e-3, "float16": 1e-3}  # tests/_oracle.py's table


class _CopyToRegion:
    """Megatron's copy_to_tensor_model_parallel_region: identity forward, all-reduce of
    the gradient over the group in the backward."""

    @staticmethod
    def make(group):
        import torch
        import torch.distributed as dist

        class Copy(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.view_as(x)

            @staticmethod
            def backward(ctx, g):
                g = g.clone()
                dist.all_reduce(g, group=group)
                return g

        return Copy.apply


def run_case(name, group, rank, world):
    import torch

    import bridge

    T, dtype, masked, tau, entropy, chunk = CASES[name]
    fused = FUSED.get(name, {})
    implementation = fused.get("implementation")
    v_local = fused.get("v_local", V_LOCAL)
    hidden_full, weight_full, y, mask_full, g_lp, g_h = make_inputs(
        T, dtype, masked, world, hidden_size=fused.get("hidden_size", HIDDEN), v_local=v_local)
    rows = slice(rank * v_local, (rank + 1) * v_local)
    traced = _count_fused_kernels() if fused else None
    weight = weight_full[rows].clone().requires_grad_()  # its own, aligned memory
    mask = None if mask_full is None else mask_full[:, rows].contiguous()
    with_entropy, entropy_grad = entropy != "off", entropy == "grad"
    hr = hidden_full.double().requires_grad_()
    wr = weight_full.double().requires_grad_()
    lp_r, h_r = reference(hr, wr, y, mask_full, tau)
    outs_r = [lp_r, h_r] if entropy_grad else [lp_r]
    cots = [g_lp, g_h] if entropy_grad else [g_lp]
    dh_r, dw_r = torch.autograd.grad(outs_r, [hr, wr], [c.double() for c in cots],
                                     retain_graph=True)
    (dh_r_lp,) = torch.autograd.grad(lp_r, hr, g_lp.double())
    scale = max(1.0, float((hidden_full.double() @ weight_full.double().T).abs().max()) / tau)
    copy = _CopyToRegion.make(group)
    tol = GRAD_RTOL[dtype]

    for reduce in (False, True):
        hidden = hidden_full.clone().requires_grad_()
        # At a Megatron output layer (reduce=False) the input passes through
        # copy_to_tensor_model_parallel_region, which sums d hidden over the ranks.
        inp = hidden if reduce else copy(hidden)
        lp, h = bridge.linear_logprob_entropy(
            inp, weight, y, process_group=group, keep_mask=mask, temperature=tau,
            with_entropy=with_entropy, entropy_grad=entropy_grad, chunk_size=chunk,
            reduce_hidden_grad=reduce, implementation=implementation)
        err = float((lp.double() - lp_r).detach().abs().max())
        assert err <= 1e-5 * scale, f"log_prob error {err:.3g} (reduce={reduce})"
        if with_entropy:
            err = float((h.double() - h_r).detach().abs().max())
            assert err <= 1e-5 * scale, f"entropy error {err:.3g}"
            assert h.requires_grad == entropy_grad
        else:
            assert h is None
        outs = [lp, h] if entropy_grad else [lp]
        dh, dw = torch.autograd.grad(outs, [hidden, weight], cots)
        assert dh.dtype == hidden.dtype and dw.dtype == weight.dtype
        err = rel_err(dw, dw_r[rows])
        assert err <= tol, f"d weight: relative error {err:.3g} (reduce={reduce})"
        err = rel_err(dh, dh_r)
        assert err <= tol, f"d hidden: relative error {err:.3g} (reduce={reduce})"
        if not reduce:
            # The op alone returns this rank's part, not the sum.
            (part,) = torch.autograd.grad(
                bridge.linear_logprob_entropy(
                    hidden, weight, y, process_group=group, keep_mask=mask,
                    temperature=tau, with_entropy=with_entropy, entropy_grad=entropy_grad,
                    chunk_size=chunk, implementation=implementation)[0], hidden, g_lp)
            assert rel_err(part, dh_r_lp) > 0.05, "d hidden was summed over ranks by default"
    if traced is not None:
        # the forward kernel on the whole shard; the backward one on the 16-column chunks
        assert set(traced) == {("forward_stats", (T, 64), (v_local, 64)),
                               ("backward_logits", (T, 64), (16, 64))}, traced



def _count_fused_kernels() -> list:
    """`_linear_cases.record_fused_traces`, with the bridge's caches of traced functions
    cleared so that they trace afresh."""
    from _linear_cases import record_fused_traces
    from bridge import _linear_jaxfns

    _linear_jaxfns.local_forward.cache_clear()
    _linear_jaxfns.local_backward.cache_clear()
    return record_fused_traces()


def extra_checks(group, rank, world):
    import torch
    import torch.distributed as dist

    import bridge
    from _bridge_spawn import CollectiveCounter

    fresh = dist.new_group(list(range(world)))  # a group the bridge has not seen
    counts = []
    for T in (5, 6, 5):
        hidden, weight_full, y, _, _, _ = make_inputs(T, "float32", False, world, seed=T)
        hidden.requires_grad_()
        weight = weight_full[rank * V_LOCAL:(rank + 1) * V_LOCAL].clone()
        with CollectiveCounter() as c:
            lp, h = bridge.linear_logprob_entropy(hidden, weight, y, process_group=fresh)
        counts.append(c.count)
    with CollectiveCounter() as plain:
        torch.autograd.grad([lp, h], hidden, [torch.ones_like(lp), torch.ones_like(h)])
    lp, h = bridge.linear_logprob_entropy(hidden, weight, y, process_group=fresh,
                                          reduce_hidden_grad=True)
    with CollectiveCounter() as reduced:
        torch.autograd.grad([lp, h], hidden, [torch.ones_like(lp), torch.ones_like(h)])
    assert (counts, plain.count, reduced.count) == ([2, 1, 1], 0, 1), (
        f"collectives: forwards {counts} (want 2 on the group's first call, then 1), "
        f"backward {plain.count} (want 0) and with reduce_hidden_grad {reduced.count} (1)")

    # T = 0: no collective at all, empty outputs, zero gradients
    hidden = torch.randn(0, HIDDEN, requires_grad=True)
    weight = torch.randn(V_LOCAL, HIDDEN, requires_grad=True)
    with CollectiveCounter() as c:
        lp, h = bridge.linear_logprob_entropy(hidden, weight, torch.zeros(0, dtype=torch.long),
                                              process_group=group, reduce_hidden_grad=True)
        dh, dw = torch.autograd.grad(lp.sum() + h.sum(), [hidden, weight])
    assert c.count == 0 and lp.shape == (0,) and h.shape == (0,), (c.count, lp.shape)
    assert dh.shape == (0, HIDDEN) and not dw.any()

    # unequal vocabulary shards: a clear error on every rank, before any kernel
    other = dist.new_group(list(range(world)))
    v_loc = V_LOCAL + (rank == world - 1)
    try:
        bridge.linear_logprob_entropy(torch.randn(4, HIDDEN), torch.randn(v_loc, HIDDEN),
                                      torch.zeros(4, dtype=torch.long), process_group=other)
    except ValueError as err:
        assert "V_loc" in str(err) and "same" in str(err), str(err)
    else:
        raise AssertionError("unequal vocabulary shards were accepted")


def worker(rank: int, world: int, port: int, out_dir: str):
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 "
                          "--xla_cpu_multi_thread_eigen=false")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    failures, timings = [], {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        group = dist.new_group(list(range(world)))
        import bridge  # noqa: F401  (before anything else starts JAX)

        checks = [(name, lambda n=name: run_case(n, group, rank, world)) for name in CASES]
        checks.append(("extra", lambda: extra_checks(group, rank, world)))
        for name, fn in checks:
            t0 = time.perf_counter()
            try:
                fn()
            except Exception:
                failures.append(f"[rank {rank}] {name}: {traceback.format_exc(limit=8)}")
            timings[name] = round(time.perf_counter() - t0, 2)
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        failures.append(f"[rank {rank}] worker: {traceback.format_exc()}")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "failures": failures, "timings_s": timings}, fh)


def spawn(world: int, out_dir: str) -> list[str]:
    """Run `worker` on `world` spawned gloo ranks; return all failures."""
    import torch.multiprocessing as mp

    from _bridge_spawn import free_port, rank_results

    mp.spawn(worker, args=(world, free_port(), out_dir), nprocs=world, join=True)
    failures, results = rank_results(world, out_dir)
    for rank, result in results.items():
        failures += result["failures"]
        print(f"rank {rank} timings (s): {result['timings_s']}")
    return failures
