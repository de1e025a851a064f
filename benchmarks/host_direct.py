"""Host cost of the bridge's direct route (issue 12 item 4) on CUDA, one run.

First a ladder at T = 16, V = 1024 (host µs per piece of the route). Then per case, µs per
forward+backward (`bridge.logprob_entropy` + `torch.autograd.grad`, with entropy, int64
targets unless named), every loop in the same process:
  direct        implementation="pallas_mosaic": Mosaic kernels launched from torch
                (and with the target's logit gathered by torch / found in the kernel)
  mosaic_jax    the same kernels through JAX (the direct route switched off)
  triton        the Triton kernels through JAX ("pallas_triton"; the default route
                until the default took the direct route, session 13)
  floor         a trivial torch autograd.Function + one kernel each way (no JAX); timed
                in turns with `direct` (`paired`), and their ratio per neighbouring pair
  jax_vjp       one jitted JAX forward+backward of the op on JAX arrays (Mosaic;
                unmasked cases)
and the forward alone (no graph) through the direct route and through JAX (Triton). Then a varying-T loop (T uniform in
[1, 32768], V_loc = 18,992 bf16) against a fixed T, with the compile count.

    python -m benchmarks.host_direct --out benchmarks/results/h200_bridge_direct.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import bridge  # noqa: E402
import jaxops  # noqa: E402
from bridge import _direct, _jaxfns  # noqa: E402
from benchmarks import harness  # noqa: E402

DEV = torch.device("cuda", 0)


def _mean_us(fn, n):
    return harness.mean_call_us(fn, n, torch.cuda.synchronize)


def timeit(fn, n, repeats=5, warm=10):
    """Median over `repeats` of the mean µs per call of `n` calls (synchronised ends)."""
    for _ in range(warm):
        fn()
    return statistics.median(_mean_us(fn, n) for _ in range(repeats))


def paired(fn, floor, n, repeats=9, warm=10):
    """(median µs of fn, median µs of floor, median and range of their ratio), the two
    timed in turns: this host's speed drifts between loops (the same loop measured
    260 and 410 µs per call minutes apart in session 9), so a ratio is taken only
    between neighbouring loops."""
    for _ in range(warm):
        fn()
        floor()
    pairs = [(_mean_us(fn, n), _mean_us(floor, n)) for _ in range(repeats)]
    ratios = sorted(a / b for a, b in pairs)
    return dict(us=statistics.median(a for a, _ in pairs),
                floor_us=statistics.median(b for _, b in pairs),
                ratio=statistics.median(ratios), ratio_range=(ratios[0], ratios[-1]),
                difference_us=statistics.median(a - b for a, b in pairs))


class _Floor(torch.autograd.Function):
    """The torch-only floor: one kernel forward (a row sum), one backward (a copy)."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return x.sum(-1)

    @staticmethod
    def backward(ctx, g):
        return g[:, None].expand(ctx.shape).clone()


def floor_step(x, g):
    def step():
        torch.autograd.grad(_Floor.apply(x), [x], [g])
    return step


def bridge_step(x, y, g, implementation, direct=True, mask=None):
    def step():
        lp, h = bridge.logprob_entropy(x, y, implementation=implementation, keep_mask=mask)
        torch.autograd.grad([lp, h], [x], [g, g])

    if direct:
        return step

    def without_direct():
        saved = _direct.applies
        _direct.applies = lambda *a: False
        try:
            step()
        finally:
            _direct.applies = saved
    return without_direct


def forward_step(x, y, implementation, mask=None):
    def step():
        with torch.no_grad():
            bridge.logprob_entropy(x, y, implementation=implementation, keep_mask=mask)
    return step


def jax_step(x, y, g):
    @jax.jit
    def vjp(a, b, c):
        (_, _), f = jax.vjp(lambda z: jaxops.logprob_entropy(
            z, b, implementation="pallas_mosaic"), a)
        return f((c, c))[0]

    dtype = jnp.bfloat16 if x.dtype == torch.bfloat16 else jnp.float32
    jx = jnp.asarray(x.detach().float().cpu().numpy()).astype(dtype)
    jy = jnp.asarray(y.cpu().numpy()).astype(jnp.int32)
    jg = jnp.asarray(g.cpu().numpy())

    def step():  # not blocked per call: timeit's device-wide synchronize covers JAX's stream
        vjp(jx, jy, jg)
    return step


def run_case(T, V, dtype, n, masked=False):
    x = torch.randn(T, V, device=DEV, dtype=dtype, requires_grad=True)
    y = torch.randint(0, V, (T,), device=DEV)
    g = torch.randn(T, device=DEV)
    m = torch.rand(T, V, device=DEV) < 0.1 if masked else None
    step = bridge_step(x, y, g, "pallas_mosaic", mask=m)
    vs_floor = paired(step, floor_step(x, g), n)
    r = dict(
        direct=vs_floor["us"],
        floor=vs_floor["floor_us"],
        direct_over_floor=vs_floor["ratio"],
        direct_over_floor_range=vs_floor["ratio_range"],
        direct_int32_targets=timeit(bridge_step(x, y.int(), g, "pallas_mosaic", mask=m), n),
        direct_forward=timeit(forward_step(x, y, "pallas_mosaic", mask=m), n),
        triton_forward=timeit(forward_step(x, y, "pallas_triton", mask=m), n),
        mosaic_jax=timeit(bridge_step(x, y, g, "pallas_mosaic", direct=False, mask=m), n),
        triton=timeit(bridge_step(x, y, g, "pallas_triton", mask=m), n),
    )
    saved = _direct.GATHER_TARGET_FROM
    for name, threshold in (("direct_target_gathered", 0),
                            ("direct_target_in_kernel", 2**62)):
        _direct.GATHER_TARGET_FROM = threshold
        try:
            r[name] = timeit(bridge_step(x, y, g, "pallas_mosaic", mask=m), n)
        finally:
            _direct.GATHER_TARGET_FROM = saved
    if not masked:
        vs_jax = paired(step, jax_step(x, y, g), n, repeats=7)
        r["jax_vjp"] = vs_jax["floor_us"]
        r["direct_minus_jax_vjp"] = vs_jax["difference_us"]
    r["triton_over_floor"] = r["triton"] / r["floor"]
    return r


class _FloorOurSignature(torch.autograd.Function):
    """The floor's kernels behind `bridge.op._EagerFunction`'s signature and bookkeeping
    (four inputs, two outputs sharing one buffer, three saved tensors): what autograd
    itself costs for an op shaped like ours."""

    @staticmethod
    def forward(ctx, x, y, mask, call):
        ctx.set_materialize_grads(False)
        ctx.params = call[:4]
        ctx.save_for_backward(x, y, mask)
        s = x.sum(-1)
        return s, s.view(-1)

    @staticmethod
    def backward(ctx, g1, g2):
        x, _, _ = ctx.saved_tensors
        return g1[:, None].expand(x.shape).clone(), None, None, None


def ladder(T=16, V=1024, n=300):
    """Host µs per piece of the direct route at a host-bound size (fp32, entropy, int64
    targets); every loop in this process, pieces timed on their own."""
    from bridge import _run, op

    x = torch.randn(T, V, device=DEV, requires_grad=True)
    y = torch.randint(0, V, (T,), device=DEV)
    g = torch.randn(T, device=DEV)
    plan = _run.Plan(x, y, None, "pallas_mosaic")
    _, state = _direct.forward(plan, 1.0, True)
    kept = bridge.logprob_entropy(x, y, implementation="pallas_mosaic")
    call = (1.0, True, True, "pallas_mosaic", "", 0, 1, False)
    steps = {
        "floor: trivial Function, one kernel each way": floor_step(x, g),
        "floor with our Function's signature": lambda: torch.autograd.grad(
            list(_FloorOurSignature.apply(x, y, None, call)), [x], [g, g]),
        "validate": lambda: op.validate(x, y, None, 1.0, True, True, None, "pallas_mosaic"),
        "Plan": lambda: _run.Plan(x, y, None, "pallas_mosaic"),
        "int64 ids as the kernels read them (a view; 2 torch ops before session 14)": (
            lambda: _direct._target_ids(plan)),
        "_direct.forward (launches included)": lambda: _direct.forward(plan, 1.0, True),
        "_direct.backward (launch included)": lambda: _direct.backward(state, g, g, True),
        "bridge forward alone (graph recorded, dropped)": lambda: bridge.logprob_entropy(
            x, y, implementation="pallas_mosaic"),
        "bridge backward alone (retain_graph)": lambda: torch.autograd.grad(
            list(kept), [x], [g, g], retain_graph=True),
        "bridge forward+backward": bridge_step(x, y, g, "pallas_mosaic"),
    }
    return {name: timeit(fn, n) for name, fn in steps.items()}


def varying_t(V=18992, calls=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 32769, (calls,), generator=gen).tolist()
    x_all = torch.randn(32768, V, device=DEV, dtype=torch.bfloat16)
    y_all = torch.randint(0, V, (32768,), device=DEV)
    g_all = torch.randn(32768, device=DEV)

    def loop(ts):
        for T in ts:
            x = x_all[:T].detach().requires_grad_()
            lp, h = bridge.logprob_entropy(x, y_all[:T], implementation="pallas_mosaic")
            torch.autograd.grad([lp, h], [x], [g_all[:T], g_all[:T]])

    out = {}
    before = _jaxfns.compiled_programs()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    loop(sizes)
    torch.cuda.synchronize()
    out["first_pass_ms"] = (time.perf_counter() - t0) / calls * 1e3
    out["compiled_first_pass"] = _jaxfns.compiled_programs() - before
    before = _jaxfns.compiled_programs()
    for name, ts in (("same_sequence_ms", sizes),
                     ("new_sequence_ms", torch.randint(1, 32769, (calls,),
                                                       generator=gen).tolist()),
                     ("fixed_T16384_ms", [16384] * calls)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loop(ts)
        torch.cuda.synchronize()
        out[name] = (time.perf_counter() - t0) / calls * 1e3
    out["compiled_after_first_pass"] = _jaxfns.compiled_programs() - before
    out["mean_T"] = sum(sizes) / calls
    return out


def _rounded(value):
    if isinstance(value, (tuple, list)):
        return [_rounded(v) for v in value]
    return round(value, 2) if isinstance(value, float) else value


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "jax": jax.__version__,
               "torch": torch.__version__, "cases": {}}

    def save():  # after every part: a timeout still leaves what was measured
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    results["ladder_T16_V1024_float32"] = ladder()
    print("ladder", json.dumps(_rounded(results["ladder_T16_V1024_float32"]), indent=1),
          flush=True)
    save()
    for T, V, dtype, n, masked in [(16, 1024, torch.float32, 300, False),
                                   (16, 18992, torch.bfloat16, 300, False),
                                   (8192, 18992, torch.bfloat16, 100, False),
                                   (8192, 151936, torch.bfloat16, 30, False),
                                   (8192, 151936, torch.bfloat16, 20, True),
                                   (8192, 151936, torch.float32, 20, False)]:
        key = f"T{T}_V{V}_{str(dtype).split('.')[-1]}" + ("_mask" if masked else "")
        results["cases"][key] = run_case(T, V, dtype, n, masked)
        print(key, json.dumps(_rounded(results["cases"][key])), flush=True)
        save()
    results["varying_t"] = varying_t()
    print("varying_t", json.dumps(_rounded(results["varying_t"])), flush=True)
    save()


if __name__ == "__main__":
    main()
