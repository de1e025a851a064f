"""Bridge host cost on CUDA (session 6 probe): fwd+bwd through the bridge vs a trivial torch
autograd.Function + kernel (the floor) vs one jitted JAX vjp, at T=16 V=1024 fp32 and T=8192
V=18992 bf16; a varying-T sequence; a cProfile of the small call. Results in
benchmarks/results/h200_bridge_host_probe.json (run: python benchmarks/host_probe.py).
"""
import os, time, cProfile, pstats, io, json
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import torch
import bridge
from bridge import _jaxfns
import jax, jax.numpy as jnp
import jaxops
dev = torch.device("cuda", 0)
res = {}


@jax.jit
def jvjp(a, b, c):  # one jitted JAX forward+backward of the op (the JAX baseline)
    (lp, h), vjp = jax.vjp(lambda z: jaxops.logprob_entropy(z, b), a)
    return vjp((c, c))[0]

def timeit(fn, n, warm=10):
    for _ in range(warm): fn()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6

def floor_fn(x, g):
    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.sum(-1)
        @staticmethod
        def backward(ctx, g):
            return g[:, None].expand_as(x).clone()
    def step():
        torch.autograd.grad(F.apply(x), [x], [g])
    return step

for T, V, dt in [(16, 1024, torch.float32), (8192, 18992, torch.bfloat16)]:
    x = torch.randn(T, V, device=dev, dtype=dt, requires_grad=True)
    y = torch.randint(0, V, (T,), device=dev)
    g = torch.randn(T, device=dev)
    def step():
        lp, h = bridge.logprob_entropy(x, y)
        torch.autograd.grad([lp, h], [x], [g, g])
    def fwd():
        with torch.no_grad():
            bridge.logprob_entropy(x, y)
    jx = jnp.asarray(x.detach().float().cpu().numpy()).astype(jnp.bfloat16 if dt == torch.bfloat16 else jnp.float32)
    jy = jnp.asarray(y.cpu().numpy()).astype(jnp.int32)
    jg = jnp.asarray(g.cpu().numpy())
    def jstep():
        jvjp(jx, jy, jg).block_until_ready()
    n = 300 if T == 16 else 100
    r = dict(bridge=timeit(step, n), bridge_fwd=timeit(fwd, n), torch_floor=timeit(floor_fn(x, g), n),
             jax_vjp=timeit(jstep, n))
    r["ratio_to_floor"] = r["bridge"] / r["torch_floor"]
    res[f"T{T}_V{V}_{str(dt)[6:]}"] = r
    print(T, V, dt, {k: round(v, 1) for k, v in r.items()}, flush=True)

# varying T vs exact-shape JAX on the same sequence (V_loc = 18992, bf16, entropy)
V = 18992
big = torch.randn(32768, V, device=dev, dtype=torch.bfloat16)
ys = torch.randint(0, V, (32768,), device=dev)
gs = torch.randn(32768, device=dev)
Ts = torch.randint(1, 32769, (40,), generator=torch.Generator().manual_seed(0)).tolist()
c0 = _jaxfns.compiled_programs()
def run_seq(seq):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for T in seq:
        x = big[:T].detach().requires_grad_()
        lp, h = bridge.logprob_entropy(x, ys[:T])
        torch.autograd.grad([lp, h], [x], [gs[:T], gs[:T]])
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / len(seq) * 1e3
first = run_seq(Ts); c1 = _jaxfns.compiled_programs()
second = run_seq(Ts); c2 = _jaxfns.compiled_programs()
Ts2 = torch.randint(1, 32769, (40,), generator=torch.Generator().manual_seed(1)).tolist()
third = run_seq(Ts2); c3 = _jaxfns.compiled_programs()
fixed = run_seq([16384] * 40)
jbig = jnp.asarray(big.float().cpu().numpy()).astype(jnp.bfloat16)
jys = jnp.asarray(ys.cpu().numpy()).astype(jnp.int32); jgs = jnp.asarray(gs.cpu().numpy())
slices = {T: (jbig[:T], jys[:T], jgs[:T]) for T in set(Ts)}
for T in set(Ts): jvjp(*slices[T]).block_until_ready()
t0 = time.perf_counter()
for T in Ts: jvjp(*slices[T]).block_until_ready()
jax_seq = (time.perf_counter() - t0) / len(Ts) * 1e3
res["varying_T"] = dict(Ts=Ts, mean_T=sum(Ts) / len(Ts), first_pass_ms=first, second_pass_ms=second,
    new_sequence_ms=third, compiled_first=c1 - c0, compiled_second=c2 - c1, compiled_new_sequence=c3 - c2,
    fixed_T16384_ms=fixed, jax_exact_shapes_ms=jax_seq)
print(json.dumps(res["varying_T"], indent=1)[:2000], flush=True)
out = os.environ.get("OUT", "/tmp")
json.dump(res, open(os.path.join(out, "probe2.json"), "w"), indent=1)

T, V = 16, 1024
x = torch.randn(T, V, device=dev, requires_grad=True)
y = torch.randint(0, V, (T,), device=dev)
g = torch.randn(T, device=dev)
def step():
    lp, h = bridge.logprob_entropy(x, y)
    torch.autograd.grad([lp, h], [x], [g, g])
for _ in range(20): step()
pr = cProfile.Profile(); pr.enable()
for _ in range(300): step()
torch.cuda.synchronize(); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35); print(s.getvalue()[:7000])
