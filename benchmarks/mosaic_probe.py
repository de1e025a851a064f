"""Mosaic GPU vs Triton Pallas kernels, T=8192 (and 1024, 32768), V=151936: fwd and fwd+bwd vs
roofline, both backends in one process (NOTES, "Mosaic GPU kernels, first GPU run").

    python -m benchmarks.mosaic_probe   # writes $OUT/mosaic_probe.json
"""
import os, time, json
import jax, jax.numpy as jnp
import jaxops
from benchmarks.harness import roofline_bytes
OUT = os.environ.get("OUT", "/tmp")
V = 151936
# The roofline uses the H200's measured copy bandwidth of the bench runs (docs/design.md §7).
# (The session-7 JSON's "bandwidth_Bps", 0.92e12, came from a broken in-script copy probe;
# NOTES recomputes every ratio at 4.24 TB/s.)
BW = 4.24e12
def timeit(f, *a, n=20):
    jax.block_until_ready(f(*a)); jax.block_until_ready(f(*a))
    t0 = time.perf_counter()
    for _ in range(n): out = f(*a)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n * 1e3
res = {"bandwidth_Bps": BW, "cases": []}
cases = [(8192, dt, ent, m) for dt in ("float32", "bfloat16") for ent in (True, False) for m in (False, True)]
cases += [(1024, "bfloat16", True, False), (32768, "bfloat16", True, False)]
for T, dt, ent, m in cases:
    k = jax.random.split(jax.random.key(T), 4)
    x = (jax.random.normal(k[0], (T, V), jnp.float32) * 3).astype(dt)
    y = jax.random.randint(k[1], (T,), 0, V)
    mask = jax.random.uniform(k[2], (T, V)) < 0.3 if m else None
    g = jax.random.normal(k[3], (T,), jnp.float32)
    fb_bytes = roofline_bytes(dt, T, V, m)
    row = dict(T=T, dtype=dt, entropy=ent, mask=m, roofline_ms=[b / BW * 1e3 for b in fb_bytes])
    outs = {}
    for impl in ("pallas_triton", "pallas_mosaic"):
        fwd = jax.jit(lambda x, y, mask: jaxops.logprob_entropy(x, y, keep_mask=mask, with_entropy=ent, implementation=impl))
        def fb_(x, y, mask, g):
            out, vjp = jax.vjp(lambda x: jaxops.logprob_entropy(x, y, keep_mask=mask, with_entropy=ent, implementation=impl), x)
            return out, vjp((g, g) if ent else (g, None))
        fb = jax.jit(fb_)
        try:
            tf = timeit(fwd, x, y, mask); tfb = timeit(fb, x, y, mask, g)
            o = fb(x, y, mask, g); outs[impl] = o
            row[impl] = dict(fwd_ms=round(tf, 4), fb_ms=round(tfb, 4), fwd_x=round(tf / row["roofline_ms"][0], 3), fb_x=round(tfb / row["roofline_ms"][1], 3))
        except Exception as e:
            row[impl] = dict(error=repr(e)[:600])
    if len(outs) == 2:
        (lp1, *r1), (d1,) = outs["pallas"]; (lp2, *r2), (d2,) = outs["pallas_mosaic"]
        row["max_abs_diff_logprob"] = float(jnp.max(jnp.abs(lp1 - lp2)))
        # row by row: an fp32 copy of the whole [T, V] difference does not fit at T = 32768
        row["max_abs_diff_grad"] = max(float(jnp.max(jnp.abs(d1[i:i + 1024].astype(jnp.float32) - d2[i:i + 1024].astype(jnp.float32)))) for i in range(0, T, 1024))
    del outs
    print(json.dumps(row), flush=True)
    res["cases"].append(row)
    json.dump(res, open(os.path.join(OUT, "mosaic_probe.json"), "w"), indent=1)
    del x, mask
