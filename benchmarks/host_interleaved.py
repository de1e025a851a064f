"""The direct route's host time at T = 16, call by call (issue 12 item 4, sessions 9, 14).

Four functions in turns, their order rotating from round to round, each call timed on its
own (host µs; the GPU is idle at this size): the torch-only floor, the floor behind the
bridge's Function signature, the direct route with int64 ids and with int32 ids. 3 runs of 1000 rounds each with Python's
GC on, off, and on again; per run the p10/p50/p90/mean and p50 / the floor's p50. Timing
in turns is needed on a host whose speed drifts between loops (benchmarks/NOTES.md,
"The direct route, host cost again").

    python -m benchmarks.host_interleaved > benchmarks/results/h200_bridge_direct_interleaved.txt
    python -m benchmarks.host_interleaved --vocab 18992 --dtype bfloat16   # one TP = 8 shard
"""
import argparse, gc, os, time, statistics
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import torch
import bridge
from benchmarks.host_direct import _Floor, _FloorOurSignature

parser = argparse.ArgumentParser()
parser.add_argument("--vocab", type=int, default=1024)
parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
parser.add_argument("--rounds", type=int, default=1000)
args = parser.parse_args()
dev = torch.device("cuda", 0)
T, V = 16, args.vocab
print(f"T = {T}, V = {V}, {args.dtype}, {args.rounds} rounds per run", flush=True)
x = torch.randn(T, V, device=dev).to(getattr(torch, args.dtype)).requires_grad_()
y64 = torch.randint(0, V, (T,), device=dev)
y32 = y64.int()
g = torch.randn(T, device=dev)
call = (1.0, True, True, "pallas_mosaic", "", 0, 1, False)


def step(y):
    lp, h = bridge.logprob_entropy(x, y, implementation="pallas_mosaic")
    torch.autograd.grad([lp, h], [x], [g, g])


fns = {
    "floor": lambda: torch.autograd.grad(_Floor.apply(x), [x], [g]),
    "floor_our_signature": lambda: torch.autograd.grad(
        list(_FloorOurSignature.apply(x, y64, None, call)), [x], [g, g]),
    "direct_i64": lambda: step(y64),
    "direct_i32": lambda: step(y32),
}
collections = [0]
gc.callbacks.append(lambda phase, info: collections.__setitem__(0, collections[0] + (phase == "start")))


def interleaved(rounds):
    times = {k: [] for k in fns}
    names = list(fns)
    for i in range(rounds):
        # Each function takes each place in the round equally often: the one right after
        # another's call finds that call's code and data warm.
        for k in names[i % len(names):] + names[:i % len(names)]:
            fn = fns[k]
            t0 = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - t0) * 1e6)
        if i % 50 == 49:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    out = {}
    for k, v in times.items():
        v.sort()
        n = len(v)
        out[k] = dict(p10=round(v[n // 10], 1), p50=round(v[n // 2], 1), p90=round(v[9 * n // 10], 1),
                      mean=round(sum(v) / n, 1))
    return out


for fn in fns.values():
    for _ in range(30):
        fn()
torch.cuda.synchronize()
for label in ("gc on", "gc off", "gc on again"):
    if label == "gc off":
        gc.disable()
    else:
        gc.enable()
    collections[0] = 0
    for rep in range(3):
        r = interleaved(args.rounds)
        print(label, rep, "collections", collections[0], flush=True)
        for k, v in r.items():
            print(f"   {k:22s} {v}", flush=True)
        ratio = {k: round(r[k]["p50"] / r["floor"]["p50"], 2) for k in r}
        print("   p50 / floor p50:", ratio, flush=True)
