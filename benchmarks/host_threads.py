"""Is it the autograd worker thread? (issue 12 item 4). Variants of one fwd+bwd, T=16, V=1024 fp32.

    python -m benchmarks.host_threads   # NOTES "Host cost, session 7"; writes $OUT/host_threads_T16_V1024.json
"""
import os, time, json, threading, queue, collections, gc
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import torch, jax, jax.numpy as jnp, bridge
from bridge import _run, _jaxfns, _dlpack
OUT = os.environ.get("OUT", "/tmp")
dev = torch.device(os.environ.get("HT_DEV", "cuda"))
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
T, V = int(os.environ.get("HT_T", 16)), int(os.environ.get("HT_V", 1024))
dt = getattr(torch, os.environ.get("HT_DTYPE", "float32"))
x = torch.randn(T, V, device=dev).to(dt).requires_grad_()
y = torch.randint(0, V, (T,), device=dev)
g = torch.randn(T, device=dev)
res = {}
def timeit(fn, n=300, warm=30):
    for _ in range(warm): fn()
    sync(); t0 = time.perf_counter()
    for _ in range(n): fn()
    sync()
    return (time.perf_counter() - t0) / n * 1e6
class Worker:
    def __init__(self):
        self.q, self.r = queue.Queue(), queue.Queue()
        threading.Thread(target=self.loop, daemon=True).start()
    def loop(self):
        while True:
            f = self.q.get(); self.r.put(f())
    def call(self, f):
        self.q.put(f); return self.r.get()
W = Worker()
def impl_main():
    plan = _run.Plan(x, y, None, "")
    out, _, st = _run.forward(plan, 1.0, True, "", 0, 1, want_stats=False)
    _run.backward(plan, st, None, g, g, 1.0, True, True, 0)
def impl_worker_bwd():
    plan = _run.Plan(x, y, None, "")
    out, _, st = _run.forward(plan, 1.0, True, "", 0, 1, want_stats=False)
    W.call(lambda: _run.backward(plan, st, None, g, g, 1.0, True, True, 0))
def full():
    lp, h = bridge.logprob_entropy(x, y); torch.autograd.grad([lp, h], [x], [g, g])
keep = collections.deque(maxlen=200)
def full_keep():
    lp, h = bridge.logprob_entropy(x, y); keep.append((lp, h, torch.autograd.grad([lp, h], [x], [g, g])))
# JAX only, owned arrays
jx = jnp.asarray(x.detach().float().cpu().numpy()).astype(jnp.bfloat16 if dt == torch.bfloat16 else jnp.float32)
jy = jnp.asarray(y.cpu().numpy().astype("int32")); jg = jnp.asarray(g.cpu().numpy())
import jaxops
fwd_j = jax.jit(lambda a, t: jax.vjp(lambda a: jaxops.logprob_entropy(a, t), a))
@jax.jit
def vjp_j(a, t, c):
    _, f = jax.vjp(lambda a: jaxops.logprob_entropy(a, t), a)
    return f((c, c))
lp_j = jax.jit(lambda a, t: jaxops.logprob_entropy(a, t))
def jax_main():
    lp_j(jx, jy); vjp_j(jx, jy, jg)
def jax_worker_bwd():
    lp_j(jx, jy); W.call(lambda: vjp_j(jx, jy, jg))
def floor_worker():
    W.call(lambda: None)
variants = [("impl_main", impl_main), ("impl_worker_bwd", impl_worker_bwd), ("full", full),
            ("full_keep200", full_keep), ("jax_main", jax_main), ("jax_worker_bwd", jax_worker_bwd),
            ("thread_roundtrip", floor_worker)]
for name, fn in variants:
    res[name] = timeit(fn)
    print(f"{name:18s} {res[name]:8.1f} us", flush=True)
gc.disable(); res["full_gc_off"] = timeit(full); gc.enable()
print(f"full_gc_off        {res['full_gc_off']:8.1f} us", flush=True)
# pieces inside the backward, per thread
stamps = collections.defaultdict(list)
Tr = _dlpack.Transfer
o_tj, o_tt = Tr.to_jax, Tr.to_torch
def tj(self, t):
    t0 = time.perf_counter(); r = o_tj(self, t); stamps["to_jax_" + threading.current_thread().name[:6]].append(time.perf_counter() - t0); return r
def tt(self, a):
    t0 = time.perf_counter(); r = o_tt(self, a); stamps["to_torch_" + threading.current_thread().name[:6]].append(time.perf_counter() - t0); return r
Tr.to_jax, Tr.to_torch = tj, tt
o_lb, o_lf = _jaxfns.local_backward, _jaxfns.local_forward
def wrapf(kind, make):
    def factory(**kw):
        fn = make(**kw)
        def timed(*a):
            t0 = time.perf_counter(); r = fn(*a); stamps[kind + "_" + threading.current_thread().name[:6]].append(time.perf_counter() - t0); return r
        return timed
    return factory
_jaxfns.local_backward = wrapf("jit_bwd", o_lb); _jaxfns.local_forward = wrapf("jit_fwd", o_lf)
for _ in range(30): full()
stamps.clear()
for _ in range(200): full()
sync()
res["pieces_full_us"] = {k: round(sorted(v)[len(v)//2] * 1e6, 1) for k, v in stamps.items()}
print("pieces in full (median us):", res["pieces_full_us"], flush=True)
stamps.clear()
for _ in range(200): impl_main()
sync()
res["pieces_impl_main_us"] = {k: round(sorted(v)[len(v)//2] * 1e6, 1) for k, v in stamps.items()}
print("pieces in impl_main (median us):", res["pieces_impl_main_us"], flush=True)
json.dump(res, open(os.path.join(OUT, f"host_threads_T{T}_V{V}.json"), "w"), indent=1)
