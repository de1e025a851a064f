"""Is a jitted call slower on DLPack-imported arrays? (issue 12 item 4), T=16 V=1024 fp32 CUDA.

    python -m benchmarks.host_import   # NOTES "Host cost, session 7"; writes $OUT/host_import.json
"""
import os, time, json
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import torch, jax, jax.numpy as jnp
from bridge import _run, _jaxfns, _dlpack
OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda", 0)
T, V = 16, 1024
x = torch.randn(T, V, device=dev); y = torch.randint(0, V, (T,), device=dev)
plan = _run.Plan(x, y, None, "")
fn = _jaxfns.local_forward(shard_index=0, world=1, inv_tau=1.0, with_entropy=True, masked=False,
                           implementation=plan.implementation, config=plan.config, target_mode=plan.target_mode)
w = plan.windows[0]
lx, ly, _ = plan.window_inputs(w)
d = plan.dev
priv = _dlpack._private_api()
def imp(t, stream):
    return priv[0](torch._C._to_dlpack(t), d.jax_device, stream, False, d.dl_type)
def tm(f, n=500):
    for _ in range(50): f()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): f()
    t1 = time.perf_counter(); torch.cuda.synchronize()
    return round((t1 - t0) / n * 1e6, 1)
res = {}
xo, yo = jnp.asarray(lx.cpu().numpy()), jnp.asarray(ly.cpu().numpy())
res["jit_owned"] = tm(lambda: fn(xo, yo, None))
a_s = (imp(lx, d._jax_waits_for_torch()), imp(ly, None))
res["jit_same_imported_views_reused"] = tm(lambda: fn(*a_s, None))
res["import_nostream_x2_plus_jit"] = tm(lambda: fn(imp(lx, None), imp(ly, None), None))
def with_stream():
    s = d._jax_waits_for_torch()
    return fn(imp(lx, s), imp(ly, None), None)
res["import_stream_plus_jit (bridge way)"] = tm(with_stream)
res["import_only_x2_stream"] = tm(lambda: (imp(lx, d._jax_waits_for_torch()), imp(ly, None)))
res["import_only_x2_nostream"] = tm(lambda: (imp(lx, None), imp(ly, None)))
o = fn(xo, yo, None)
res["export_only"] = tm(lambda: torch._C._from_dlpack(priv[1](o[0], stream=d._dlpack_stream(d._torch_stream()))))
res["export_only_nostream"] = tm(lambda: torch._C._from_dlpack(priv[1](o[0], stream=None)))
triv = jax.jit(lambda a: a * 2)
res["trivial_jit_owned"] = tm(lambda: triv(xo))
res["trivial_jit_imported_each"] = tm(lambda: triv(imp(lx, d._jax_waits_for_torch())))
for k, v in res.items(): print(f"{k:40s} {v:8.1f} us", flush=True)
json.dump(res, open(os.path.join(OUT, "host_import.json"), "w"), indent=1)
