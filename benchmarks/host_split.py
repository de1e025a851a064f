"""Split of one eager bridge call at T = 16, V = 1024 fp32 (CUDA): the full fwd+bwd, the forward
with its graph, the backward alone on a retained graph, the implementation functions without
torch autograd; under the default and a 1 us GIL switch interval. NOTES, session 6.

    python benchmarks/host_split.py
"""
import os, sys, time
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import torch, bridge
dev = torch.device("cuda", 0)
T, V = 16, 1024
x = torch.randn(T, V, device=dev, requires_grad=True)
y = torch.randint(0, V, (T,), device=dev)
g = torch.randn(T, device=dev)
def timeit(fn, n=300, warm=20):
    for _ in range(warm): fn()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6
def full():
    lp, h = bridge.logprob_entropy(x, y); torch.autograd.grad([lp, h], [x], [g, g])
lp0, h0 = bridge.logprob_entropy(x, y)
def bwd_only():
    torch.autograd.grad([lp0, h0], [x], [g, g], retain_graph=True)
def fwd_only():
    bridge.logprob_entropy(x, y)
from bridge import _run
def impl_only():  # forward + backward without torch autograd
    plan = _run.Plan(x, y, None, "")
    out, _, st = _run.forward(plan, 1.0, True, "", 0, 1, want_stats=False)
    _run.backward(plan, st, None, g, g, 1.0, True, True, 0)
for si in (None, 1e-6):
    if si: sys.setswitchinterval(si)
    print(f"switchinterval={sys.getswitchinterval()}: full {timeit(full):.0f} us, fwd(graph) {timeit(fwd_only):.0f}, "
          f"bwd only {timeit(bwd_only):.0f}, impl fwd+bwd no autograd {timeit(impl_only):.0f}", flush=True)
