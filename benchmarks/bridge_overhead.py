"""What the PyTorch bridge costs on top of calling the JAX op directly.

    python -m benchmarks.bridge_overhead [--out DIR] [--device cuda|cpu] [--quick]

Prints microseconds per forward+backward call (median of repeats, many back-to-back calls
each, one device sync per repeat), for:

  jax         one jitted `jax.vjp` of `jaxops.logprob_entropy` on JAX arrays (1 dispatch)
  jax-staged  the bridge's own jitted JAX functions on JAX arrays (fwd + bwd dispatches)
  bridge      bridge.logprob_entropy + torch.autograd.grad on torch tensors (eager route,
              check_targets=False)
  bridge-fwd  the forward alone, no autograd graph (inference)
  bridge+chk  the same with check_targets=True on a fresh targets tensor each call (reads
              min/max of the targets: 1 sync; includes a clone of the targets, whose
              own cost is the bridge(+clone) column minus bridge)
  bridge+chk(cached)  check_targets=True on the same, unmodified targets (checked once)
  bridge-op   the torch.library custom-op route in eager mode
  compiled    torch.compile(fullgraph=True) of forward + loss, then autograd.grad
              (includes the loss' own small kernels)
  naive       jax.dlpack.from_dlpack -> jit(vjp) -> torch.from_dlpack, synchronising the
              device after every call (the ~360 us round trip of docs/design.md §6)

and a breakdown of the per-call costs (imports, exports, stream sync, dispatch) that
explains the difference. Overhead = bridge - jax at small shapes, where the device is idle
and the wall time is the host's dispatch time; at large shapes the host runs ahead and
the bridge's overhead hides behind the kernels. On CUDA every column uses "pallas_triton",
the JAX route (the default "pallas" takes the direct route on Hopper: docs/performance.md,
"The bridge: host cost and the direct route").
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run by path: see benchmarks/__init__.py
    import os, sys  # noqa: E401
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json
import os
import platform
import time

import bridge  # first: JAX must start without preallocating
import torch
import jax
import jax.numpy as jnp

import jaxops
from benchmarks import harness
from bridge import diagnostics, op


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeit(fn, device, calls, repeats=7, warmup=3):
    """Median wall time per call in microseconds (harness.time_calls); `fn` returns
    something to block on: its JAX arrays, then the torch device."""
    def done(out):
        jax.block_until_ready([o for o in jax.tree.leaves(out) if isinstance(o, jax.Array)])
        sync(device)

    return harness.time_calls(fn, reps=repeats, calls=calls, warmup=warmup,
                              sync=done).seconds * 1e6


def breakdown(device, calls):
    """Per-operation costs of one bridge call, in microseconds."""
    res = {}
    dev = diagnostics.dlpack_device(device)
    x = torch.randn(64, 1024, device=device)
    y64 = torch.randint(0, 1024, (64,), device=device)
    res["fast_path"] = dev.fast
    xfer = dev.begin()
    res["begin+first_import(stream)"] = timeit(lambda: dev.begin().to_jax(x), device, calls)
    xfer.to_jax(x)  # consumes the stream: the following imports are "later" imports
    res["import_fast(later)"] = timeit(lambda: xfer.to_jax(x), device, calls)
    res["import_public_jax.dlpack.from_dlpack"] = timeit(
        lambda: jax.dlpack.from_dlpack(x), device, calls)
    res["import_int64_public(x64 convert)"] = timeit(
        lambda: jax.dlpack.from_dlpack(y64), device, calls)
    res["import_int64_as_int32_pairs"] = timeit(
        lambda: xfer.to_jax(y64.view(torch.int32)), device, calls)
    ja = jnp.ones((64,), jnp.float32, device=dev.jax_device)
    res["export_fast"] = timeit(lambda: xfer.to_torch(ja), device, calls)
    res["export_public_torch.from_dlpack"] = timeit(lambda: torch.from_dlpack(ja), device, calls)
    if dev.cuda:
        res["stream_sync_event"] = timeit(dev.jax_waits_for_torch, device, calls)
    res["begin(transfer)"] = timeit(dev.begin, device, calls)
    f = jax.jit(lambda a: a + 1)
    res["jit_dispatch_trivial"] = timeit(lambda: f(ja), device, calls)
    g = jax.jit(lambda a: a[0, 0] + 1)
    owned = jnp.array(xfer.to_jax(x))
    res["jit_on_owned_[64,1024]"] = timeit(lambda: g(owned), device, calls)
    res["jit_on_fresh_import(begin+import+dispatch)"] = timeit(
        lambda: g(dev.begin().to_jax(x)), device, calls)
    res["targets_range_check(sync)"] = timeit(
        lambda: bridge.check_targets(y64, 1024), device, calls)
    return res


def staged_fns(impl, device, *, with_entropy, target_mode, logits):
    """The bridge's own jitted (forward, backward) pair for one unmasked shard, temperature 1."""
    return diagnostics.staged_functions(
        impl, device, num_vocab=logits.shape[-1], itemsize=logits.element_size(),
        with_entropy=with_entropy, target_mode=target_mode)


class _TorchFloor(torch.autograd.Function):
    """A torch-only autograd.Function with the bridge's signature shape: two [T] outputs,
    a [T, V] gradient. Its cost is torch's own autograd floor for such an op."""

    @staticmethod
    def forward(ctx, x):
        ctx.x_shape = x.shape
        return x[:, 0].clone(), x[:, 1].clone()

    @staticmethod
    def backward(ctx, d_a, d_b):
        return d_a[:, None] + d_b[:, None] * d_a.new_ones(ctx.x_shape)


def ladder(device, impl, calls, num_tokens=16, num_vocab=1024):
    """Host microseconds of one fwd+bwd call, adding the bridge's pieces one at a time
    (T = 16, V = 1024 fp32 with entropy: the device is idle, the host is what is timed)."""
    dev = diagnostics.dlpack_device(device)
    x = torch.randn(num_tokens, num_vocab, device=device)
    y = torch.randint(0, num_vocab, (num_tokens,), device=device)
    y32 = y.view(torch.int32)  # int64 ids as int32 pairs, as the bridge passes them
    d = torch.randn(num_tokens, 2, device=device)  # token-major, as the bridge passes them
    fwd, bwd = staged_fns(impl, device, with_entropy=True, target_mode="i64", logits=x)
    xfer = dev.begin()
    jx, jy, jd = xfer.to_jax(x), xfer.to_jax(y32), xfer.to_jax(d)
    ox, oy, od = jnp.array(jx), jnp.array(jy), jnp.array(jd)
    kept = []

    def on(a, b, dd):
        _, st = fwd(a, b, None)
        return bwd(a, b, None, st, dd)

    def fresh(export=False, keep=False):
        t = dev.begin()
        a, b = t.to_jax(x), t.to_jax(y32)
        out, st = fwd(a, b, None)
        outs = [t.to_torch(out)] if export else []
        t = dev.begin()
        g = bwd(a, b, None, st, t.to_jax(d))
        if not export:
            return g
        outs.append(t.to_torch(g))
        if keep:  # as in real use: the previous call's tensors die during this call
            kept[:] = outs
        return outs

    xr = x.clone().requires_grad_()

    def bridge_full():
        lp, h = bridge.logprob_entropy(xr, y, check_targets=False)
        return torch.autograd.grad([lp, h], xr, [d[:, 0], d[:, 1]])

    def bridge_forward():  # records the graph; dropping it drops the saved JAX views
        return bridge.logprob_entropy(xr, y, check_targets=False)

    kept_lp, kept_h = bridge.logprob_entropy(xr, y, check_targets=False)

    def bridge_backward():  # the same graph's backward again and again
        return torch.autograd.grad([kept_lp, kept_h], xr, [d[:, 0], d[:, 1]], retain_graph=True)

    xf = x.clone().requires_grad_()

    def torch_floor():
        a, b = _TorchFloor.apply(xf)
        return torch.autograd.grad([a, b], xf, [d[:, 0], d[:, 1]])

    steps = [
        ("1 staged jit fwd+bwd on owned arrays", lambda: on(ox, oy, od)),
        ("2 ... on DLPack views imported once", lambda: on(jx, jy, jd)),
        ("3 ... importing x, y, d every call", fresh),
        ("4 ... + exporting the outputs and dx to torch", lambda: fresh(export=True)),
        ("5 ... + torch keeps them until the next call", lambda: fresh(export=True, keep=True)),
        ("6 op.forward_impl + op.backward_impl (no autograd)",
         lambda: op.backward_impl(x, y, None, op.forward_impl(x, y, None, 1.0, True, impl,
                                                               "", 0, 1)[2],
                                  d[:, 0], d[:, 1], 1.0, True, True, impl, 0)),
        ("7 bridge.logprob_entropy + autograd.grad", bridge_full),
        ("7a ... its forward alone (graph recorded, then dropped)", bridge_forward),
        ("7b ... its backward alone (autograd.grad, retain_graph)", bridge_backward),
        ("torch-only autograd.Function floor", torch_floor),
    ]
    return {name: timeit(fn, device, calls) for name, fn in steps}


def profile(device, impl, calls):
    """Where the host time of one small bridge call goes (cProfile, top functions)."""
    import cProfile
    import io
    import pstats

    x = torch.randn(16, 1024, device=device, requires_grad=True)
    y = torch.randint(0, 1024, (16,), device=device)
    g = torch.randn(16, device=device)

    def call():
        lp, h = bridge.logprob_entropy(x, y, implementation=impl, check_targets=False)
        return torch.autograd.grad([lp, h], x, [g, g])

    for _ in range(5):
        call()
    sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    sync(device)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    return out.getvalue()


def scenario(device, T, V, dtype, with_entropy, calls, impl, do_compile, do_naive):
    torch.manual_seed(0)
    x = (torch.randn(T, V, device=device) * 3).to(dtype).requires_grad_()
    y = torch.randint(0, V, (T,), device=device)
    g1 = torch.randn(T, device=device)
    g2 = torch.randn(T, device=device)
    res = {"T": T, "V": V, "dtype": str(dtype).replace("torch.", ""),
           "entropy": with_entropy, "gib_logits": x.numel() * x.element_size() / 2**30}

    # --- JAX direct, on JAX arrays holding the same values ---------------------------
    dev = diagnostics.dlpack_device(device)
    xfer = dev.begin()
    jx = jnp.array(xfer.to_jax(x.detach()))  # a JAX-owned copy
    jy = jnp.asarray(xfer.to_jax(y.to(torch.int32)))
    jg1, jg2 = jnp.array(xfer.to_jax(g1)), jnp.array(xfer.to_jax(g2))
    sync(device)

    @jax.jit
    def jax_fb(x, y, g1, g2):
        def f(x):
            lp, h = jaxops.logprob_entropy(x, y, with_entropy=with_entropy,
                                           implementation=impl)
            return (lp, h) if with_entropy else (lp,)
        outs, vjp = jax.vjp(f, x)
        (dx,) = vjp((g1, g2) if with_entropy else (g1,))
        return outs, dx

    res["jax"] = timeit(lambda: jax_fb(jx, jy, jg1, jg2), device, calls)

    fwd, bwd = staged_fns(impl, device, with_entropy=with_entropy, target_mode="i32",
                          logits=x)

    # token-major incoming gradients, as the bridge passes them
    jd = jnp.stack([jg1, jg2], axis=1) if with_entropy else jg1[:, None]

    def staged():
        out, st = fwd(jx, jy, None)
        return out, bwd(jx, jy, None, st, jd)

    res["jax-staged"] = timeit(staged, device, calls)

    # --- the bridge ------------------------------------------------------------------
    def bridge_call(check=False, fresh_targets=False):
        yy = y.clone() if fresh_targets else y  # a new tensor defeats the check's cache
        lp, h = bridge.logprob_entropy(x, yy, with_entropy=with_entropy, implementation=impl,
                                       check_targets=check)
        outs, grads = ([lp, h], [g1, g2]) if with_entropy else ([lp], [g1])
        return torch.autograd.grad(outs, x, grads)

    res["bridge"] = timeit(bridge_call, device, calls)
    res["bridge-fwd"] = timeit(  # inference forward (no graph)
        lambda: bridge.logprob_entropy(x.detach(), y, with_entropy=with_entropy,
                                       implementation=impl, check_targets=False),
        device, calls)
    res["bridge+chk"] = timeit(lambda: bridge_call(True, fresh_targets=True), device, calls)
    res["bridge+chk(cached)"] = timeit(lambda: bridge_call(True), device, calls)
    res["bridge(+clone)"] = timeit(lambda: bridge_call(False, fresh_targets=True), device,
                                   calls)
    op.USE_CUSTOM_OP_IN_EAGER = True
    try:
        res["bridge-op"] = timeit(bridge_call, device, calls)
    finally:
        op.USE_CUSTOM_OP_IN_EAGER = False

    if do_compile:
        def loss(x, y, g1, g2):  # compiled forward; its compiled backward runs in .grad
            lp, h = bridge.logprob_entropy(x, y, with_entropy=with_entropy,
                                           implementation=impl)
            return (lp * g1).sum() + ((h * g2).sum() if with_entropy else 0.0)

        compiled = torch.compile(loss, fullgraph=True)
        t0 = time.perf_counter()
        torch.autograd.grad(compiled(x, y, g1, g2), x)
        sync(device)
        res["compile_s"] = time.perf_counter() - t0
        res["compiled"] = timeit(lambda: torch.autograd.grad(compiled(x, y, g1, g2), x),
                                 device, calls)

    if do_naive:
        def naive():
            jxn = jax.dlpack.from_dlpack(x.detach())
            jyn = jax.dlpack.from_dlpack(y)  # int64: converted (copied) to int32
            outs, dx = jax_fb(jxn, jyn, jax.dlpack.from_dlpack(g1), jax.dlpack.from_dlpack(g2))
            r = [torch.from_dlpack(o) for o in outs] + [torch.from_dlpack(dx)]
            sync(device)
            return r

        res["naive"] = timeit(naive, device, max(calls // 4, 5))

    # first call with a new T (compiles the JAX functions for that shape)
    x2 = x.detach()[: max(T - 1, 1)].clone().requires_grad_()
    t0 = time.perf_counter()
    lp, h = bridge.logprob_entropy(x2, y[: x2.shape[0]], with_entropy=with_entropy,
                                   implementation=impl)
    torch.autograd.grad([lp], x2, [g1[: x2.shape[0]]])
    sync(device)
    res["new_T_first_call_ms"] = (time.perf_counter() - t0) * 1e3
    res["overhead_vs_jax"] = res["bridge"] - res["jax"]
    res["overhead_vs_staged"] = res["bridge"] - res["jax-staged"]
    return res


def memory(device):
    out = {}
    if device.type == "cuda":
        out["torch_reserved_gib"] = torch.cuda.memory_reserved(device) / 2**30
        stats = diagnostics.jax_device(device).memory_stats() or {}
        out["jax_pool_gib"] = stats.get("pool_bytes", stats.get("bytes_reserved", 0)) / 2**30
        out["jax_peak_in_use_gib"] = stats.get("peak_bytes_in_use", 0) / 2**30
        out["jax_bytes_limit_gib"] = stats.get("bytes_limit", 0) / 2**30
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small shapes and few calls only")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else 0)
        torch.cuda.set_device(device)
    # The JAX route's pieces, all of them: "pallas" would take the direct route on Hopper
    # in the eager columns while the ladder's steps time the JAX route (the direct
    # route's own costs: docs/performance.md, "The bridge: host cost and the direct route").
    impl = "pallas_triton" if device.type == "cuda" else "xla"
    calls = 20 if args.quick else 200
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "jax": jax.__version__, "device": str(device),
            "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "memory_policy": diagnostics.memory_policy_note(),
            "XLA_PYTHON_CLIENT_PREALLOCATE": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")}
    print(json.dumps(info), flush=True)
    results = {"info": info, "breakdown": breakdown(device, calls), "scenarios": []}
    print("per-operation costs (us):", flush=True)
    for k, v in results["breakdown"].items():
        print(f"  {k:40s} {v if isinstance(v, bool) else f'{v:8.1f}'}", flush=True)
    results["ladder"] = ladder(device, impl, calls)
    print("host cost of one fwd+bwd call, piece by piece (us):", flush=True)
    for k, v in results["ladder"].items():
        print(f"  {k:56s} {v:8.1f}", flush=True)

    shapes = [(16, 1024, torch.float32), (256, 32768, torch.bfloat16)]
    if not args.quick and device.type == "cuda":
        shapes += [(1024, 151936, torch.bfloat16), (8192, 151936, torch.bfloat16),
                   (8192, 151936, torch.float32)]
    cols = ["jax", "jax-staged", "bridge", "bridge-fwd", "bridge+chk", "bridge+chk(cached)",
            "bridge(+clone)", "bridge-op", "compiled", "naive"]
    header = " ".join(f"{c:>{max(10, len(c))}}" for c in cols)
    print(f"{'T':>5} {'V':>7} {'dtype':>9} {'ent':>3} {header} {'overhead':>9} {'vs staged':>9}"
          "  (us per fwd+bwd call)", flush=True)
    for T, V, dtype in shapes:
        for with_entropy in (True, False):
            small = T * V <= 256 * 32768
            r = scenario(device, T, V, dtype, with_entropy,
                         calls if small else max(calls // 10, 10), impl,
                         do_compile=small and not args.no_compile and with_entropy,
                         do_naive=small)
            results["scenarios"].append(r)
            print(f"{T:5d} {V:7d} {r['dtype']:>9} {int(with_entropy):3d} "
                  + " ".join(f"{r[c]:{max(10, len(c))}.1f}" if c in r
                           else f"{'-':>{max(10, len(c))}}" for c in cols)
                  + f" {r['overhead_vs_jax']:9.1f} {r['overhead_vs_staged']:9.1f}"
                  + f"   new-T first call {r['new_T_first_call_ms']:.0f} ms"
                  + (f", torch.compile {r['compile_s']:.1f} s" if "compile_s" in r else ""),
                  flush=True)
    prof = profile(device, impl, calls)
    print("cProfile of the bridge, small shape (host time per function, "
          f"{calls} fwd+bwd calls):\n" + prof, flush=True)
    results["profile"] = prof
    results["memory"] = memory(device)
    print("memory:", json.dumps(results["memory"]), flush=True)
    if args.out:
        harness.write_json(os.path.join(args.out, "bridge_overhead.json"), results)


if __name__ == "__main__":
    main()
